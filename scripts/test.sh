#!/usr/bin/env bash
# The whole test suite: lint, import contracts, then unit, integration and fault tests
# against real redis-server, uvicorn and worker processes. Fails loudly when no test ran.
set -uo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check . || exit 1
.venv/bin/lint-imports --no-cache >/dev/null || { .venv/bin/lint-imports --no-cache; exit 1; }
.venv/bin/python -m pytest -ra "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$status"
