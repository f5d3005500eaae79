#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a bare NVIDIA machine: torch, numpy and safetensors
# there; orjson, the runner's payload decoder, travels as a wheel in .whl/ (`make gpu-wheels`
# fetches it for Python 3.12). Writes gpu_check.json to $OUT when set, else to the repo root.
#
#   bench/gpu_check.sh [--oom-headroom-gib 2] [--smoke]     (PYTHON=... picks the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"  # PYTHON=.venv/bin/python: the project's own environment
if ! "$PY" -c "import torch, numpy, safetensors" 2>/dev/null; then
    echo "gpu_check: $PY lacks torch, numpy or safetensors; run it where they are installed, or set PYTHON to an interpreter that has them" >&2
    exit 2
fi
if ! "$PY" -c "import orjson" 2>/dev/null; then
    if ! ls .whl/orjson-*.whl >/dev/null 2>&1; then
        echo "gpu_check: orjson is missing and .whl/ holds no wheel of it; run 'make gpu-wheels' here first and carry .whl" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PY" bench/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
