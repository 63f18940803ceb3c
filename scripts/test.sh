#!/usr/bin/env bash
# The whole test suite: the static checks (scripts/lint.sh: ruff, formatting, import
# contracts, mypy --strict), then unit, integration and fault tests against real
# redis-server, uvicorn and worker processes. Fails loudly when no test ran.
# Arguments go to pytest, e.g. `scripts/test.sh -m "not compose and not cluster"`.
set -uo pipefail
cd "$(dirname "$0")/.."

scripts/lint.sh || exit 1
.venv/bin/python -m pytest -ra --durations=15 "$@"  # (the slowest, to keep the suite short)
status=$?
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$status"
