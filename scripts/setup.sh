#!/usr/bin/env bash
# Create ./.venv (if missing) and install xmodal with its test extra into it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# The SSH server and rsync that tests/test_ray_up.py runs in its rehearsal hosts (the cluster launcher
# works over SSH and rsync), and PostgreSQL, the cluster head's MLflow database there and in
# tests/test_cluster_postgres.py, and Chromium, the headless browser tests/examples/test_examples_browser.py
# drives through Playwright (whose own browser download is not reachable everywhere): installed where this
# runs as root with apt and they are missing (CI, a container). Elsewhere nothing is installed, and the
# tests that need them skip, saying why.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    need=()
    [ -x /usr/sbin/sshd ] || need+=(openssh-server)
    command -v ssh >/dev/null || need+=(openssh-client)
    command -v rsync >/dev/null || need+=(rsync)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null || need+=(postgresql)
    command -v chromium >/dev/null || command -v chromium-browser >/dev/null || need+=(chromium)
    if [ "${#need[@]}" -gt 0 ]; then
        # openssh-server's install would start a machine-wide sshd on every interface; a policy-rc.d
        # that answers 101 forbids starting services during the install (the rehearsal starts its own).
        policy=/usr/sbin/policy-rc.d
        if [ ! -e "$policy" ]; then
            printf '#!/bin/sh\nexit 101\n' > "$policy"
            chmod 755 "$policy"
            trap 'rm -f "$policy"' EXIT
        fi
        if ! { apt-get -o DPkg::Lock::Timeout=600 update -qq &&
               DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
                   --no-install-recommends "${need[@]}"; }; then
            echo "setup.sh: could not install ${need[*]} with apt: tests/test_ray_up.py," \
                 "tests/test_cluster_postgres.py and tests/examples/test_examples_browser.py will skip" >&2
        fi
    fi
fi

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# Pin torch first: 2.13.0 resolves to the CPU wheel on CPU-only team machines and to the CUDA
# build on PyPI elsewhere; an unpinned `torch` would pull a newer multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "torch==2.13.0"
fi
# The rest through uv (a wheel from PyPI): pip took 4-6 min to resolve and install these ~150
# packages on a 2-core machine, uv well under one (docs/performance.md, "The test suite's time").
# Bytecode compiled at install: a process that may not write .pyc files (PYTHONDONTWRITEBYTECODE)
# would otherwise compile every module it imports, each time. pip stays the way where uv is not had.
if .venv/bin/python -m pip install -q "uv>=0.5" && .venv/bin/uv --version >/dev/null 2>&1; then
    .venv/bin/uv pip install --python .venv/bin/python -q --compile-bytecode -e ".[cluster,test,extract]"
else
    echo "setup.sh: uv could not be installed; installing with pip (slower)" >&2
    .venv/bin/python -m pip install -q -e ".[cluster,test,extract]"
fi
echo "xmodal installed in $(pwd)/.venv"
