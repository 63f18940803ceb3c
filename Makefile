PORT ?= 8000

.PHONY: run test bootstrap bench lint

bootstrap:
	@scripts/bootstrap.sh

run: bootstrap
	.venv/bin/sluice up --model-repository model_repository --http-port $(PORT)

test: bootstrap
	scripts/test.sh

bench: bootstrap
	.venv/bin/python -m bench --model mlp --mode binary

lint: bootstrap
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy -p sluice
