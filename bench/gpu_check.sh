#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) on a bare NVIDIA machine: torch, numpy and safetensors
# there; orjson, the runner's payload decoder, travels as a wheel in .whl/ (`make gpu-wheels`
# fetches it for Python 3.12). Writes gpu_check.json to $OUT when set, else to the repo root.
#
#   bench/gpu_check.sh [--oom-headroom-gib 2] [--smoke]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import orjson" 2>/dev/null; then
    if ! ls .whl/orjson-*.whl >/dev/null 2>&1; then
        echo "gpu_check: orjson is missing and .whl/ holds no wheel of it; run 'make gpu-wheels' here first and carry .whl" >&2
        exit 2
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu-check-site .whl/*.whl
    export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec python3 bench/gpu_check.py --out "${OUT:-.}/gpu_check.json" "$@"
