#!/usr/bin/env bash
# The whole test suite: the static checks (scripts/lint.sh: ruff, formatting, import
# contracts, mypy --strict), then unit, integration and fault tests against real
# redis-server, uvicorn and worker processes. Fails loudly when no test ran.
# Arguments go to pytest, e.g. `scripts/test.sh -m "not compose and not cluster"`.
#
# Without arguments, the tests run in two streams (pytest-xdist, a file's tests together),
# and the compose test (minutes of podman image builds, mostly waiting) in a pytest of its
# own beside them; its report follows theirs, and either failing fails the suite.
set -uo pipefail
cd "$(dirname "$0")/.."

scripts/lint.sh || exit 1

pytest_status() {  # pytest's exit status, with "no test ran" made a failure
    if [ "$1" -eq 5 ]; then
        echo "pytest collected no tests: failing on purpose" >&2
        return 1
    fi
    return "$1"
}

if [ "$#" -gt 0 ]; then
    .venv/bin/python -m pytest -ra --durations=15 "$@"
    pytest_status $?
    exit $?
fi

compose_dir=$(mktemp -d)
trap 'rm -rf "$compose_dir"' EXIT
# (At a lower priority: its image builds take what the other tests leave of the cores, so
# that the fault tests' timings are not theirs to share.)
nice -n 5 .venv/bin/python -m pytest -ra -m compose -p no:cacheprovider \
    --basetemp="$compose_dir/tmp" >"$compose_dir/report" 2>&1 &
compose_pid=$!
# Two streams of tests (pytest-xdist), each file's tests in one stream: most tests wait on
# the processes they start, so two streams use the two cores the suite is sized for.
.venv/bin/python -m pytest -ra --durations=15 -m "not compose" -n 2 --dist loadfile
pytest_status $?
status=$?
wait "$compose_pid"
pytest_status $?
compose_status=$?
echo
echo "================ the compose test, run beside the others ================"
cat "$compose_dir/report"
if [ "$status" -eq 0 ]; then
    status=$compose_status
fi
exit "$status"
