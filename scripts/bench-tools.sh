#!/usr/bin/env bash
# The C load generators of `python -m bench --loadgen wrk|h2load`: wrk (Debian package wrk)
# and h2load (Debian package nghttp2-client), and LuaJIT (wrk's Lua, which the bench's unit
# tests run its wrk script under). Installed with apt-get when missing and run as root;
# otherwise a note says what to install (the bench's Python clients need none of them).
# scripts/bootstrap.sh runs it too.
set -euo pipefail

missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v h2load >/dev/null 2>&1 || missing+=(nghttp2-client)
command -v luajit >/dev/null 2>&1 || missing+=(luajit)
[ "${#missing[@]}" = 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} (Debian packages) for python -m bench --loadgen" >&2
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    echo "note: ${missing[*]} missing: install the Debian package(s) (apt-get install" \
        "${missing[*]}) for python -m bench --loadgen wrk / h2load" >&2
fi
