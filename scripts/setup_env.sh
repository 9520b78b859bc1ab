#!/usr/bin/env bash
# Build the CPU development environment in .venv (idempotent; a second run takes seconds).
#   torch 2.13.0 CPU  + sglang 0.5.23 --no-deps + the deps SGLang really imports (env/sglang-deps-cpu.txt)
#   + torchvision 0.28.0 --no-deps with patches/torchvision_meta_guard.py
#   + patches/sgl_kernel_cpu (pure-torch stand-in for the two sgl_kernel ops used on CPU)
#   + env/fleet.txt (redis, hiredis, smg: the fleet hint index and the live baseline router)
#   + env/t2.txt (Mooncake Store client and master, CPU build: T2; needs libibverbs1, scripts/install_t2_deps.sh)
#   + this package, editable.
# The Debian package redis-server is needed by the fleet tests and `make fleet-bench`:
# scripts/install_redis.sh (root) installs it; .ci/run calls it.
# Override the interpreter with PYTHON=..., the venv location with VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0

stamp_inputs=(scripts/setup_env.sh env/sglang-deps-cpu.txt env/fleet.txt env/t2.txt pyproject.toml setup.py
  patches/torchvision_meta_guard.py patches/sgl_kernel_cpu/pyproject.toml
  patches/sgl_kernel_cpu/sgl_kernel/__init__.py)
want=$(cat "${stamp_inputs[@]}" | sha256sum | cut -c1-16)
if [ -f "$VENV/.sglang-tiered-env" ] && [ "$(cat "$VENV/.sglang-tiered-env")" = "$want" ]; then
  exit 0
fi

echo "[env] building $VENV (sglang $SGLANG_VERSION, torch $TORCH_VERSION CPU) ..."
t0=$SECONDS
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade "pip>=24" "setuptools>=70" wheel
# CPU torch first. On machines that keep a CPU wheel in a find-links folder pip takes it from there;
# elsewhere point PIP_FIND_LINKS at a folder holding the CPU wheel (PyPI's default is the CUDA build).
pip install "torch==$TORCH_VERSION"
pip install -r env/sglang-deps-cpu.txt "torch==$TORCH_VERSION"
pip install -r env/fleet.txt
pip install --no-deps -r env/t2.txt
pip install --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
pip install --no-deps --no-build-isolation ./patches/sgl_kernel_cpu
"$VENV/bin/python" patches/torchvision_meta_guard.py
pip install --no-deps --no-build-isolation -e .
"$VENV/bin/python" - <<'PY'
import torch, sglang, sgl_kernel, sglang_tiered, sglang_tiered.kernels  # noqa: F401
print(f"[env] torch {torch.__version__}, sglang {sglang.__version__}, shim {sgl_kernel.__version__}")
PY
echo "$want" > "$VENV/.sglang-tiered-env"
echo "[env] ready in $((SECONDS - t0)) s"
