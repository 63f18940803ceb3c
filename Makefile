PORT ?= 8000

.PHONY: run test check bootstrap bench lint docs

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	.venv/bin/sluice up --model-repository model_repository --http-port $(PORT)

# Everything: the static checks, then unit, integration and fault tests (about 20 minutes on two cores).
test: bootstrap
	scripts/test.sh

# The inner loop (about a minute): the static checks and the unit tests not marked slow, in
# two streams.
check: bootstrap
	scripts/lint.sh
	.venv/bin/python -m pytest -q tests/unit -m "not slow" -n 2

bench: bootstrap
	.venv/bin/python -m bench --model mlp --mode binary

# ruff check, ruff format --check, lint-imports and mypy --strict.
lint: bootstrap
	scripts/lint.sh

# The documentation site on http://127.0.0.1:8088 (reference pages regenerated first).
docs: bootstrap
	.venv/bin/python docs/gen_reference.py
	.venv/bin/mkdocs serve -a 127.0.0.1:8088
