# shellcheck shell=bash
# step "what it does" command...: prints "what it does ... done (N s)", or "failed after N s"
# and exits. STEP_PREFIX, when set, starts each line (the calling script's name).
step() {
    local what=$1 started=$SECONDS
    shift
    printf '%s%s ... ' "${STEP_PREFIX:-}" "$what" >&2
    if "$@"; then
        echo "done ($((SECONDS - started)) s)" >&2
    else
        echo "failed after $((SECONDS - started)) s" >&2
        exit 1
    fi
}
