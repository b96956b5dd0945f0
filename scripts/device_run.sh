#!/usr/bin/env bash
# The benchmark suite on a bare GPU machine that has torch, transformers and pyarrow but not the
# rest of this project's dependencies (docs/performance.md, "A GPU run").
#
#   bash scripts/device_run.sh fetch              # here, with the package index: the wheels into .whl/
#   bash scripts/device_run.sh run SECTIONS OUT   # there: the suite's SECTIONS (e.g. mult,extract) into OUT
#
# `fetch` downloads pure-Python wheels and pydantic_core for CPython 3.12 on manylinux x86_64 (the
# device machine's Python; set DEVICE_PYTHON=3.11 for another); `run` installs them into /tmp/site
# without touching the machine's own packages, then runs one suite call. DEVICE=cpu and PYTHON=...
# rehearse it on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
fetch)
    rm -rf .whl && mkdir -p .whl
    python3 -m pip download -q --only-binary=:all: --no-deps -d .whl \
        --python-version "${DEVICE_PYTHON:-3.12}" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        "pydantic>=2.7" "pydantic-core" "annotated-types" "typing-inspection" "typing-extensions>=4.12"
    ls .whl
    ;;
run)
    if [ $# -ne 3 ] || [ -z "$2" ] || [ -z "$3" ]; then
        echo "error: device_run.sh run: expected SECTIONS OUT, two non-empty arguments (e.g. run mult,extract" \
             "bench-out), got $(($# - 1)): ${*:2}" >&2
        exit 2
    fi
    sections="$2"
    out="$3"
    py="${PYTHON:-python3}"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD/platform"
    "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
    "$py" jobs/benchmark.py suite --device "${DEVICE:-cuda}" --sections "$sections" --out "$out"
    ;;
*)
    echo "error: device_run.sh: expected fetch or run SECTIONS OUT, got '${1:-}' (usage: bash scripts/device_run.sh fetch | run SECTIONS OUT)" >&2
    exit 2
    ;;
esac
