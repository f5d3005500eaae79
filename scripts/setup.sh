#!/usr/bin/env bash
# Create .venv and install the project. torch is installed first, pinned, so a range like
# torch>=2.4 in pyproject.toml installs nothing more (on these machines 2.13.0 is a local CPU
# wheel). A GPU user installs the CUDA build of torch into .venv first; this script keeps it.
#   usage: scripts/setup.sh [runtime|dev]
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-runtime}
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
if [ "$extra" = dev ]; then
  .venv/bin/python -m pip install -q -e ".[dev]"
else
  .venv/bin/python -m pip install -q -e .
fi
