#!/bin/sh
# Writes compose.yaml's .env: every secret the stack needs, random, in a file only you can
# read (mode 0600). compose.yaml refuses to start without it.
#
#   scripts/compose-env.sh                      # .env beside compose.yaml, one tenant: demo
#   scripts/compose-env.sh team-a team-b        # one API key per tenant named
#   scripts/compose-env.sh --output FILE [TENANT ...]
#
# An existing file is never overwritten: it is kept as it is (exit status 0, so that
# `scripts/compose-env.sh && docker compose up -d` always works); remove it to make a new
# one (the volumes keep the old Redis and MinIO state: `docker compose down -v` first).
#
# What it holds: REDIS_PASSWORD; MinIO's root user (for the minio and minio-init services
# only) and one MinIO user per service, each limited by a policy of deploy/minio/ (workers
# and controller read the models bucket, models-upload writes it, the gateway and the batch
# worker read and write the batch store bucket and nothing else); SLUICE_API_KEYS (one
# tenant:key per tenant), SLUICE_ADMIN_KEYS (admin:key), SLUICE_METRICS_KEY (Prometheus'
# scrapes, tenant prometheus); GRAFANA_ADMIN_PASSWORD. Secrets are random hex strings from
# /dev/urandom (safe in URLs, YAML and shells): 256 bits, 160 for MinIO's (its limit of 40
# characters). Nothing secret is printed.
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
output=$here/.env
tenants=

usage() {
    echo "usage: $0 [--output FILE] [TENANT ...]" >&2
    exit 2
}

while [ $# -gt 0 ]; do
    case $1 in
        --output)
            [ $# -ge 2 ] || usage
            output=$2
            shift 2
            ;;
        --output=*)
            output=${1#--output=}
            shift
            ;;
        -h | --help) usage ;;
        -*)
            echo "compose-env.sh: unknown option $1" >&2
            usage
            ;;
        *)
            # Tenant names go into Redis keys and storage paths (sluice/tenants.py).
            if ! printf '%s' "$1" | grep -Eq '^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$'; then
                echo "compose-env.sh: '$1' is not a tenant name (1 to 64 letters, digits," \
                    "'_', '.', '-', starting with a letter or digit)" >&2
                exit 2
            fi
            case $1 in admin | prometheus)
                echo "compose-env.sh: tenant '$1' is taken (admin key, Prometheus)" >&2
                exit 2
                ;;
            esac
            tenants="$tenants $1"
            shift
            ;;
    esac
done
[ -n "$tenants" ] || tenants=demo

if [ -e "$output" ] || [ -L "$output" ]; then
    echo "compose-env.sh: $output exists; kept as it is (remove it to make a new one)" >&2
    exit 0
fi

# N random bytes (default 32) as hex digits.
secret() {
    od -An -N"${1:-32}" -tx1 /dev/urandom | tr -d ' \n'
}

umask 077
directory=$(dirname "$output")
draft=$(mktemp "$directory/.env.XXXXXX")
trap 'rm -f "$draft"' EXIT INT TERM

api_keys=
for tenant in $tenants; do
    api_keys="${api_keys:+$api_keys,}$tenant:$(secret)"
done

cat >"$draft" <<EOF
# compose.yaml's secrets, made by scripts/compose-env.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ).
# Keep this file private (mode 0600); it is in .gitignore.

# Redis: every Sluice service's SLUICE_REDIS_URL carries it.
REDIS_PASSWORD=$(secret)
# Redis refuses writes beyond this (maxmemory, noeviction): 503s instead of lost entries.
REDIS_MAXMEMORY=1gb

# MinIO's root user: the minio and minio-init services only.
# (MinIO: access keys of 20 characters at most, secret keys of 40: 160 random bits.)
MINIO_ROOT_USER=root-$(secret 6)
MINIO_ROOT_PASSWORD=$(secret 20)
# One MinIO user per service (policies in deploy/minio/).
MODELS_READER_ACCESS_KEY=models-read-$(secret 4)
MODELS_READER_SECRET_KEY=$(secret 20)
MODELS_UPLOADER_ACCESS_KEY=models-put-$(secret 4)
MODELS_UPLOADER_SECRET_KEY=$(secret 20)
BATCH_STORE_ACCESS_KEY=batch-store-$(secret 4)
BATCH_STORE_SECRET_KEY=$(secret 20)

# API keys (Authorization: Bearer <key>): tenant:key entries, comma-separated.
SLUICE_API_KEYS=$api_keys
# Admin keys: every route, management included.
SLUICE_ADMIN_KEYS=admin:$(secret)
# Prometheus scrapes the gateway's metrics port with this key (tenant prometheus).
SLUICE_METRICS_KEY=$(secret)

# Grafana's admin user (anonymous access is off).
GRAFANA_ADMIN_USER=admin
GRAFANA_ADMIN_PASSWORD=$(secret)
EOF

# A hard link never replaces an existing file: if another run made one meanwhile, it stays.
if ! ln "$draft" "$output" 2>/dev/null; then
    echo "compose-env.sh: $output exists; kept as it is (remove it to make a new one)" >&2
    exit 0
fi
echo "compose-env.sh: wrote $output (mode 0600): tenants$tenants, admin key, Redis, MinIO" \
    "and Grafana secrets. Your API keys: SLUICE_API_KEYS in that file." >&2
