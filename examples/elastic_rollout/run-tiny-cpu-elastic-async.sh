#!/usr/bin/env bash
# The tiny CPU twin of run-qwen3-4B-8xgpu-elastic-async.sh: same entrypoint and flags, sized for the tiny
# preset on a CPU machine — 2 trainer + 2 initial engine logical GPUs, pool autoscaled between 2 and 4.
#
#   relax preset tiny --out /tmp/tiny && relax cluster up --gpus 4 --max-elastic 2
#   MODEL_DIR=/tmp/tiny DATA_DIR=/tmp/tiny EXP_DIR=/tmp/exp WORKING_DIR=./ \
#     bash scripts/entrypoint/ray-job.sh examples/elastic_rollout/run-tiny-cpu-elastic-async.sh
set -euo pipefail
: "${MODEL_DIR:?set MODEL_DIR (the tiny preset directory: holds model/)}"
: "${DATA_DIR:?set DATA_DIR (the tiny preset directory: holds data/)}"
: "${EXP_DIR:?set EXP_DIR (checkpoints and metrics go there)}"
AUTOSCALER_CONFIG=${AUTOSCALER_CONFIG:-examples/elastic_rollout/autoscaler-tiny.yaml}
NUM_ROLLOUT=${NUM_ROLLOUT:-200}

relax_require_path "$MODEL_DIR/model/" "model"
relax_require_path "$DATA_DIR/data/train.jsonl" "training data"
relax_require_path "$DATA_DIR/data/eval.jsonl" "evaluation data"
relax_require_path "$AUTOSCALER_CONFIG" "autoscaler config"

mapfile -t AFFINITY_ARGS < <(relax_affinity_args)   # --no-enable-affinity when ENABLE_AFFINITY=0
ELASTIC_ARGS=(
  --fully-async
  --resource '{"actor": [1, 2], "rollout": [1, 2]}'
  --rollout-num-gpus-per-engine 1
  --autoscaler-config "$AUTOSCALER_CONFIG"
  --scale-out-partial-success-policy keep_partial   # keep the engines that came up; the autoscaler asks again
  "${AFFINITY_ARGS[@]}"
)
CKPT_ARGS=(--hf-checkpoint "$MODEL_DIR/model/" --output-dir "$EXP_DIR/tiny-elastic/")
ROLLOUT_ARGS=(
  --prompt-data "$DATA_DIR/data/train.jsonl"
  --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type tiny
  --num-rollout "$NUM_ROLLOUT" --rollout-batch-size 8 --n-samples-per-prompt 8
  --rollout-max-response-len 16 --rollout-temperature 1.0
  --global-batch-size 64
  --max-staleness 1
)
EVAL_ARGS=(
  --eval-interval 50
  --eval-prompt-data tiny "$DATA_DIR/data/eval.jsonl"
  --n-samples-per-eval-prompt 4 --eval-max-response-len 16
)
GRPO_ARGS=(--advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 --use-tis --calculate-per-token-loss)
OPTIMIZER_ARGS=(--optimizer adam --lr 1e-3 --adam-beta1 0.9 --adam-beta2 0.98)
CONTROL_ARGS=(--api-host 127.0.0.1 --api-port "${RELAX_API_PORT:-8000}")

relax_submit "${ELASTIC_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" "${CONTROL_ARGS[@]}" "$@"
