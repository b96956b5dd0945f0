#!/usr/bin/env bash
# Create ./.venv (if missing) and install xmodal with its test extra into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Pin torch first: 2.13.0 resolves to the CPU wheel on CPU-only team machines and to the CUDA
# build on PyPI elsewhere; an unpinned `torch` would pull a newer multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -e ".[test]"
echo "xmodal installed in $(pwd)/.venv"
