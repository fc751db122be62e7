#!/usr/bin/env bash
# Qwen3-4B, fully-async GRPO: 4 trainer (actor) GPUs + 4 initial one-GPU SGLang rollout engines; the
# autoscaler (AUTOSCALER_CONFIG) keeps the pool between 4 and 8 engines while training runs.
# Launch through scripts/entrypoint/ray-job.sh (see README.md beside this file).
set -euo pipefail
: "${MODEL_DIR:?set MODEL_DIR (holds Qwen3-4B/)}"
: "${DATA_DIR:?set DATA_DIR (holds dapo-math-17k/ and aime-2024/)}"
: "${EXP_DIR:?set EXP_DIR (checkpoints and metrics go there)}"
AUTOSCALER_CONFIG=${AUTOSCALER_CONFIG:-examples/elastic_rollout/autoscaler.yaml}

relax_require_path "$MODEL_DIR/Qwen3-4B/" "model"
relax_require_path "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl" "training data"
relax_require_path "$DATA_DIR/aime-2024/aime-2024.jsonl" "evaluation data"
relax_require_path "$AUTOSCALER_CONFIG" "autoscaler config"

mapfile -t AFFINITY_ARGS < <(relax_affinity_args)   # --no-enable-affinity when ENABLE_AFFINITY=0
ELASTIC_ARGS=(
  --fully-async
  --resource '{"actor": [1, 4], "rollout": [1, 4]}'
  --rollout-num-gpus-per-engine 1
  --autoscaler-config "$AUTOSCALER_CONFIG"
  "${AFFINITY_ARGS[@]}"
)
MODEL_ARGS=(
  --swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32
  --group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear
  --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128
  --qk-layernorm
)
# --load = --save (slime's idiom): the first launch starts from --hf-checkpoint, a relaunch after a crash or
# preemption resumes from the newest complete checkpoint into the same --output-dir (without --load, a start
# into an --output-dir that already holds this run's metrics is refused).
# --keep-checkpoints 3: each checkpoint is the full fp32 model and Adam state (~48 GB for 4B parameters) and
# --save-interval 20 over 3000 steps would write 150 of them (~7 TB); three keep two to fall back on should
# the newest be unusable (a policy that went bad, a disk that filled mid-run) at ~150 GB.
CKPT_ARGS=(
  --hf-checkpoint "$MODEL_DIR/Qwen3-4B/"
  --load "$EXP_DIR/Qwen3-4B-elastic/checkpoints/"
  --save "$EXP_DIR/Qwen3-4B-elastic/checkpoints/"
  --save-interval 20
  --keep-checkpoints 3
  --output-dir "$EXP_DIR/Qwen3-4B-elastic/"
)
ROLLOUT_ARGS=(
  --prompt-data "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl"
  --input-key prompt --label-key label --apply-chat-template --rollout-shuffle
  --rm-type dapo
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
  --rollout-max-response-len 8192 --rollout-temperature 0.8
  --global-batch-size 256 --balance-data
  --max-staleness 1
)
EVAL_ARGS=(
  --eval-interval 20
  --eval-prompt-data aime "$DATA_DIR/aime-2024/aime-2024.jsonl"
  --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7
)
PERF_ARGS=(
  --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
  --context-parallel-size 1 --expert-model-parallel-size 1 --expert-tensor-parallel-size 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --use-dynamic-batch-size --max-tokens-per-gpu 9216
)
GRPO_ARGS=(
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
  --eps-clip 0.2 --eps-clip-high 0.28 --use-tis
)
OPTIMIZER_ARGS=(
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
)
SGLANG_ARGS=(--rollout-backend sglang --sglang-mem-fraction-static 0.7)
MISC_ARGS=(
  --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32 --attention-backend flash
)

relax_submit "${ELASTIC_ARGS[@]}" "${MODEL_ARGS[@]}" "${CKPT_ARGS[@]}" "${ROLLOUT_ARGS[@]}" "${EVAL_ARGS[@]}" \
  "${PERF_ARGS[@]}" "${GRPO_ARGS[@]}" "${OPTIMIZER_ARGS[@]}" "${SGLANG_ARGS[@]}" "${MISC_ARGS[@]}" "$@"
