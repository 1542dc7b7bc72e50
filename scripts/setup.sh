#!/usr/bin/env bash
# One-time, idempotent setup: .venv with CPU torch, the supported sglang (CPU way), this project, redis-server.
# On a GPU host set FLYING_GPU=1 to install stock sglang with its CUDA torch instead.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV=${FLYING_VENV:-$ROOT/.venv}
# the supported SGLang version is written once, in worker_ext/sglang_patches/__init__.py
SGLANG=$(sed -n 's/^SUPPORTED_SGLANG = "\([^"]*\)".*/\1/p' "$ROOT/worker_ext/sglang_patches/__init__.py")
[ -n "$SGLANG" ] || { echo "setup: SUPPORTED_SGLANG not found in worker_ext/sglang_patches/__init__.py" >&2; exit 1; }

die() { echo "setup: $*" >&2; exit 1; }
command -v "$PY" >/dev/null || die "python3 not found (need Python >= 3.11)"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11)' || die "need Python >= 3.11, got $($PY -V)"

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV" || die "python3 -m venv failed (Debian: apt-get install python3-venv)"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check -q)

if [ "${FLYING_GPU:-0}" = "1" ]; then
  echo "setup: GPU host: stock sglang==$SGLANG with its CUDA torch"
  "${PIP[@]}" "sglang==$SGLANG"
  "${PIP[@]}" -e ".[test]"
else
  CONSTRAINTS="$ROOT/scripts/cpu-constraints.txt"
  if ! "$VPY" -c 'import torch' 2>/dev/null; then
    echo "setup: installing CPU torch 2.13.0"
    "${PIP[@]}" "torch==2.13.0+cpu" 2>/dev/null \
      || "${PIP[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
      || die "no CPU build of torch 2.13.0 found (local find-links or the PyTorch CPU index)"
  fi
  TORCH_VER=$("$VPY" -c 'import torch; print(torch.__version__)')
  echo "torch==$TORCH_VER" > "$CONSTRAINTS.local"
  if ! "$VPY" -c 'import sglang' 2>/dev/null; then
    echo "setup: installing sglang==$SGLANG (no deps) and its CPU runtime deps"
    "${PIP[@]}" --no-deps "sglang==$SGLANG"
  fi
  "${PIP[@]}" -c "$CONSTRAINTS.local" -r "$ROOT/scripts/sglang-cpu-requirements.txt"
  "${PIP[@]}" -c "$CONSTRAINTS.local" -e ".[test]"
  "$VPY" -m worker_ext.cpu_compat.install   # torchvision import guard (CPU only; idempotent)
fi

if ! command -v redis-server >/dev/null; then
  echo "setup: installing redis-server (Debian package)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null \
    || die "could not install redis-server; install it (apt-get install redis-server) and re-run"
  # Debian starts a system redis on 6379; we always run our own on a free port.
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi
if ! command -v prometheus >/dev/null; then
  # optional: the metrics test scrapes the live CPU stack with a real Prometheus (it skips, saying why, without)
  echo "setup: installing prometheus (Debian package, for the metrics test)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  { $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; } \
    || echo "setup: prometheus could not be installed; the metrics test will skip"
  $SUDO service prometheus stop >/dev/null 2>&1 || true  # we run our own, on a free port
fi
"$VPY" -c 'import sglang, torch, redis, starlette, msgspec, httpx' || die "import check failed"
echo "setup: ok ($VENV)"
