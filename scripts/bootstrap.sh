#!/usr/bin/env bash
# Prepares a fresh machine: a virtualenv with Sluice and its dev tools, redis-server
# (installed with apt-get when missing and we are allowed to), and the example models.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "Sluice needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.sluice-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "Installing Sluice and its dependencies into .venv ..." >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[dev]"
    touch "$stamp"
fi

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "redis-server is missing: installing Debian's redis-server package" >&2
        apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
    else
        echo "redis-server is missing: install it (apt-get install redis-server / brew install redis)" >&2
        exit 1
    fi
fi

.venv/bin/python model_repository/build.py
