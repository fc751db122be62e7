#!/usr/bin/env bash
# Install the real SGLang 0.5.23 for Intel Xeon CPUs with AMX into its own venv (default: .venv-sglang).
#
# SGLang is never a dependency of the relax package: its pins (torch 2.14.1, transformers 5.19) clash with
# ours, so it lives in a venv of its own that Relax launches engines from (--sglang-python).
# Steps: Debian's libraries SGLang's CPU platform preloads, the pinned lock (scripts/sglang_cpu/lock.txt),
# sglang==0.5.23 without its CUDA-only requirements, and the CPU kernel wheel (sgl_kernel built from
# csrc/cpu; PyPI has none). Idempotent: a venv whose stamp matches the lock, the version and the wheel is
# left as it is.
#
#   SGLANG_CPU_VENV   the venv to create (default: .venv-sglang in the checkout)
#   SGLANG_CPU_WHEEL  the kernel wheel, or a folder holding it (default: ../shared/sglang-cpu)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${SGLANG_CPU_VENV:-$root/.venv-sglang}"
wheel_src="${SGLANG_CPU_WHEEL:-$root/../shared/sglang-cpu}"
python="${PYTHON:-python3}"
version=0.5.23

die() { echo "install-sglang-cpu: $*" >&2; exit 2; }

if [ -d "$wheel_src" ]; then
  wheel="$(find "$wheel_src" -maxdepth 1 -name 'sglang_kernel_cpu-*.whl' | sort | head -n 1)"
else
  wheel="$wheel_src"
fi
[ -n "$wheel" ] && [ -f "$wheel" ] || die "no CPU kernel wheel (sglang_kernel_cpu-*.whl) at $wheel_src; set SGLANG_CPU_WHEEL to the wheel or its folder (docs/install.md: building it)"
grep -qw avx512f /proc/cpuinfo || die "this CPU has no AVX-512: SGLang's CPU kernels need it (AMX Xeons are the supported ones)"
grep -qw amx_bf16 /proc/cpuinfo || echo "install-sglang-cpu: no AMX on this CPU: Relax serves with SGLang's torch_native attention here"
"$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || die "$python is not CPython 3.11, which the kernel wheel is built for; set PYTHON=python3.11"

stamp="$venv/.relax-sglang-cpu"
want="$(cat "$here/lock.txt" "$0" | sha256sum | cut -c1-16) sglang==$version $(basename "$wheel")"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "install-sglang-cpu: $venv is up to date"
  exit 0
fi

debs="libnuma-dev numactl libgoogle-perftools4 libtbbmalloc2"
missing=""
for d in $debs; do dpkg -s "$d" >/dev/null 2>&1 || missing="$missing $d"; done
if [ -n "$missing" ]; then
  command -v apt-get >/dev/null || die "missing Debian packages:$missing (install them, then run again)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # shellcheck disable=SC2086  # $missing is a list of package names, split on purpose
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $missing >/dev/null
fi

test -x "$venv/bin/python" || "$python" -m venv "$venv"
pip=("$root/scripts/pip_quiet.sh" "$venv/bin/pip")  # pip without a local index's "Location ... is ignored" lines
"${pip[@]}" install --quiet --upgrade pip
"${pip[@]}" install --quiet -r "$here/lock.txt"
"${pip[@]}" install --quiet --no-deps "sglang==$version"
"${pip[@]}" install --quiet --no-deps --force-reinstall "$wheel"
# The import chain the server runs at start: fails here, not in the first engine's log.
"$venv/bin/python" -c 'import sglang, sgl_kernel; from sglang.srt.server_args import ServerArgs' \
  || die "the SGLang venv at $venv does not import; remove it and run again"
echo "$want" > "$stamp"
echo "install-sglang-cpu: SGLang $version for CPU in $venv"
