#!/usr/bin/env bash
# Launch a Relax run script as a Ray job.
#
#   bash scripts/entrypoint/ray-job.sh <run-script> [args passed to the run script]
#
# Environment (see examples/elastic_rollout/README.md):
#   RAY_DASHBOARD_ADDRESS  Ray dashboard / job server (default http://127.0.0.1:8265)
#   RAY_ADDRESS            Ray GCS address; when RAY_DASHBOARD_ADDRESS is unset, its host's :8265 is used.
#                          The job itself always runs on the job server's cluster.
#   MODEL_DIR DATA_DIR EXP_DIR   input/output roots used by the run script
#   AUTOSCALER_CONFIG      autoscaler YAML (run scripts pass --autoscaler-config "$AUTOSCALER_CONFIG")
#   WORKING_DIR            uploaded as the job's working directory (e.g. ./ from the repository root)
#   RAY_NO_WAIT=1          submit and return instead of following the job's logs
#   ENABLE_AFFINITY=0      no node-group markers on the baseline (plain Ray clusters)
#   RELAX_INITIAL_NODE_GROUP  marker prefix of the stable node group (default: stable)
#   RELAX_STOP_STALE_JOBS=1   stop this run script's own earlier jobs that are still running
#   RELAX_LAUNCH           submit (default): a new Ray job through the dashboard;
#                          here: run the driver in this process, for an entrypoint that already is a Ray job
#                          (a KubeRay RayJob's: examples/elastic_rollout/k8s/);
#                          dry-run: print the plan, nothing started, no cluster needed (missing input paths are
#                          warned about); with RELAX_CLUSTER_MANIFEST=FILE|KUSTOMIZE_DIR the plan is also checked
#                          against that KubeRay RayCluster (exit 1 if it does not fit)
#   RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH  Ray's auth token (token auth stays on: RAY_AUTH_MODE=token unless
#                          you set RAY_AUTH_MODE=disabled, which it warns about). `relax cluster up` prints them.
#
# It checks the dashboard and the run script's input paths before anything is submitted. It only ever
# touches jobs it submitted itself (submission ids relax-<run-script-name>-...), never other tenants'.
set -euo pipefail

die() { echo "ray-job.sh: error: $*" >&2; exit 2; }

[[ $# -ge 1 ]] || die "usage: bash scripts/entrypoint/ray-job.sh <run-script> [args]"
RUN_SCRIPT=$1; shift
[[ -f "$RUN_SCRIPT" ]] || die "run script '$RUN_SCRIPT' not found (run from the repository root?)"

if [[ -z "${RAY_DASHBOARD_ADDRESS:-}" && -n "${RAY_ADDRESS:-}" && "${RAY_ADDRESS}" != ray://* ]]; then
  # RAY_ADDRESS=host:6379 → the same host's dashboard on Ray's default port
  RAY_DASHBOARD_ADDRESS="http://${RAY_ADDRESS%%:*}:8265"
fi
export RAY_DASHBOARD_ADDRESS=${RAY_DASHBOARD_ADDRESS:-http://127.0.0.1:8265}
export RELAX_INITIAL_NODE_GROUP=${RELAX_INITIAL_NODE_GROUP:-stable}
export ENABLE_AFFINITY=${ENABLE_AFFINITY:-1}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
if [[ "${RAY_AUTH_MODE,,}" == "disabled" ]]; then
  echo "ray-job.sh: WARNING: RAY_AUTH_MODE=disabled: Ray's token auth is OFF; anyone who can reach the cluster's" \
       "ports can submit jobs and run code as you. Unset it unless only you can reach the cluster (docs/install.md," \
       "'Security')." >&2
fi
PYTHON=${PYTHON:-python3}
RAY=${RAY:-ray}
export RELAX_LAUNCH=${RELAX_LAUNCH:-submit}
case "$RELAX_LAUNCH" in
  submit | here | dry-run) ;;
  *) die "RELAX_LAUNCH=$RELAX_LAUNCH: use submit (the default), here (inside a Ray job) or dry-run" ;;
esac
if [[ "$RELAX_LAUNCH" == "submit" ]]; then
command -v "$RAY" >/dev/null 2>&1 || die "the 'ray' command is not on PATH (activate the environment with Ray installed)"

# --- the dashboard must answer (with our token, when auth is on): a job cannot be submitted otherwise ------
dashboard_rc=0
"$PYTHON" - "$RAY_DASHBOARD_ADDRESS" <<'PY' >/dev/null 2>&1 || dashboard_rc=$?
import os, pathlib, sys, urllib.error, urllib.request
headers = {}
if os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled":
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    path = os.environ.get("RAY_AUTH_TOKEN_PATH", "").strip() or "~/.ray/auth_token"
    if not token:
        try:
            token = pathlib.Path(path).expanduser().read_text().strip()
        except OSError:
            token = ""
    if token:
        headers["Authorization"] = f"Bearer {token}"
try:
    urllib.request.urlopen(urllib.request.Request(sys.argv[1].rstrip("/") + "/api/version", headers=headers),
                           timeout=5).read()
except urllib.error.HTTPError as e:
    sys.exit(3 if e.code in (401, 403) else 1)
except Exception:
    sys.exit(1)
PY
if [[ $dashboard_rc -eq 3 ]]; then
  die "the Ray dashboard at $RAY_DASHBOARD_ADDRESS refused our Ray auth token (missing or wrong). Set RAY_AUTH_TOKEN \
or RAY_AUTH_TOKEN_PATH to the cluster's token ('relax cluster up' prints them; 'ray get-auth-token' on the head)."
elif [[ $dashboard_rc -ne 0 ]]; then
  die "the Ray dashboard at $RAY_DASHBOARD_ADDRESS does not answer. Start the cluster with its dashboard \
(ray start --head --include-dashboard=true, or 'relax cluster up' locally) or set RAY_DASHBOARD_ADDRESS."
fi
fi  # RELAX_LAUNCH=submit

# --- helpers for run scripts ------------------------------------------------------------------------------
RELAX_RUN_NAME=$(basename "$RUN_SCRIPT" .sh)
export RELAX_RUN_NAME

relax_require_path() {
  # relax_require_path PATH [what]: fail before submitting when an input is missing (a dry run only warns:
  # the paths are often the cluster's, not this machine's).
  [[ -e "$1" ]] && return 0
  if [[ "$RELAX_LAUNCH" == "dry-run" ]]; then
    echo "ray-job.sh: warning: ${2:-input} '$1' does not exist here" >&2; return 0
  fi
  echo "ray-job.sh: error: ${2:-input} '$1' does not exist" >&2; exit 2
}

relax_affinity_args() {
  # --no-enable-affinity when ENABLE_AFFINITY=0 (plain Ray clusters without marker resources).
  if [[ "${ENABLE_AFFINITY}" == "0" ]]; then echo "--no-enable-affinity"; fi
}

relax_stop_stale_jobs() {
  [[ "${RELAX_STOP_STALE_JOBS:-0}" == "1" ]] || return 0
  "$PYTHON" - "$RAY_DASHBOARD_ADDRESS" "relax-${RELAX_RUN_NAME}-" <<'PY'
import sys
from ray.job_submission import JobStatus, JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
for job in client.list_jobs():
    if (job.submission_id or "").startswith(sys.argv[2]) and job.status in (JobStatus.PENDING, JobStatus.RUNNING):
        print(f"ray-job.sh: stopping stale job {job.submission_id}")
        client.stop_job(job.submission_id)
PY
}

relax_submit() {
  # relax_submit [train flags...]: submit python3 -m relax.entrypoints.train with these flags as a Ray job
  # (RELAX_LAUNCH=here: run it in this process; dry-run: print its plan).
  if [[ "$RELAX_LAUNCH" == "here" ]]; then
    echo "ray-job.sh: running the driver in this Ray job ($RELAX_RUN_NAME)"
    exec "$PYTHON" -m relax.entrypoints.train "$@"
  elif [[ "$RELAX_LAUNCH" == "dry-run" ]]; then
    local manifest=()
    [[ -n "${RELAX_CLUSTER_MANIFEST:-}" ]] && manifest=(--ray-cluster-manifest "$RELAX_CLUSTER_MANIFEST")
    exec "$PYTHON" -m relax.entrypoints.train --dry-run "${manifest[@]}" "$@"
  fi
  relax_stop_stale_jobs
  local submission_id
  submission_id="relax-${RELAX_RUN_NAME}-$(date +%Y%m%d-%H%M%S)-$$"
  local env_json
  env_json=$("$PYTHON" - <<'PY'
import json, os
keep = ["RELAX_INITIAL_NODE_GROUP", "RELAX_API_TOKEN", "RAY_AUTH_MODE", "ENABLE_AFFINITY", "HF_HUB_OFFLINE",
        "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "RELAX_ENGINE_API_KEY", "RELAX_SGLANG_API_KEY",
        "RELAX_EXTERNAL_ENGINE_API_KEY"]
env = {k: os.environ[k] for k in keep if k in os.environ}
env.setdefault("TOKENIZERS_PARALLELISM", "false")
runtime = {"env_vars": env}
if os.environ.get("WORKING_DIR"):
    runtime["excludes"] = [".git", ".venv", "outputs", "runs", "*.safetensors", "benchmarks/results"]
print(json.dumps(runtime))
PY
)
  local args=(job submit --address "$RAY_DASHBOARD_ADDRESS" --submission-id "$submission_id"
              --runtime-env-json "$env_json")
  [[ -n "${WORKING_DIR:-}" ]] && args+=(--working-dir "$WORKING_DIR")
  [[ "${RAY_NO_WAIT:-0}" == "1" ]] && args+=(--no-wait)
  echo "ray-job.sh: submitting $submission_id to $RAY_DASHBOARD_ADDRESS"
  "$RAY" "${args[@]}" -- python3 -m relax.entrypoints.train "$@"
}

export -f relax_require_path relax_affinity_args relax_stop_stale_jobs relax_submit die
export PYTHON RAY
bash "$RUN_SCRIPT" "$@"
