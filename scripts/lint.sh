#!/usr/bin/env bash
# The static checks, fastest first: ruff (lint and format), the import contracts
# (lint-imports) and mypy --strict (strict through pyproject.toml; incremental, so a second
# run reads its cache). `make lint`, `make check` and scripts/test.sh run it.
set -uo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
.venv/bin/lint-imports --no-cache >/dev/null || { .venv/bin/lint-imports --no-cache; exit 1; }
.venv/bin/mypy -p sluice || exit 1
