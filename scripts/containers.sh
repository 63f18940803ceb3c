#!/usr/bin/env bash
# Sets up podman to run compose.yaml on a Debian bookworm machine that has no Docker engine
# and may reach no container registry (tests/integration/test_compose.py calls it):
#   1. Debian's packages: podman, runc, netavark, aardvark-dns, catatonit, nftables,
#      debootstrap;
#   2. podman settings for machines without systemd and without CAP_SYS_RESOURCE
#      (/etc/containers/containers.conf, written only when it does not exist);
#   3. a Debian base image, localhost/debian:bookworm, made with debootstrap from the Debian
#      mirror this host's apt sources name, with this host's extra CA certificates (for apt
#      and pip behind a TLS-inspecting proxy). Built once and kept as a cache: remove it with
#      `podman rmi localhost/debian:bookworm`;
#   4. the Compose v2 binary, taken from Debian trixie's docker-compose package (fetched
#      with a trixie source configured only for that download) into $SLUICE_CONTAINERS_CACHE
#      (default /var/cache/sluice-containers).
# Steps already done are skipped; progress goes to stderr, one line per step. The last line
# on stdout is the path of the compose binary. Needs root and apt-get.
set -euo pipefail

BASE_IMAGE=localhost/debian:bookworm
SUITE=bookworm
CACHE=${SLUICE_CONTAINERS_CACHE:-/var/cache/sluice-containers}
COMPOSE=$CACHE/docker-compose
CONF=/etc/containers/containers.conf

STEP_PREFIX="containers.sh: "
# shellcheck source=lib/step.sh
. "$(dirname "$0")/lib/step.sh"

fail() {
    echo "containers.sh: $*" >&2
    exit 1
}

[ "$(id -u)" = 0 ] || fail "needs root (podman as root, apt-get, debootstrap)"
command -v apt-get >/dev/null 2>&1 || fail "needs apt-get (a Debian or Ubuntu machine)"

# The Debian archive that serves $SUITE according to this host's apt sources.
debian_mirror() {
    local field
    for field in Release Codename; do
        apt-get indextargets --format '$(REPO_URI)' "$field: $SUITE" 'Identifier: Packages' \
            'Component: main' 2>/dev/null | head -n 1 | grep . && return 0
    done
    return 0
}

install_packages() {
    # runc first and without recommends (criu stays out); podman would otherwise pick crun,
    # which rejects hybrid cgroup v1/v2 layouts.
    apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            runc >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            podman catatonit netavark aardvark-dns iptables nftables uidmap debootstrap \
            ca-certificates >/dev/null
}

missing=()
for tool in podman runc nft debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ -x /usr/libexec/podman/catatonit ] || missing+=(catatonit)
[ -x /usr/lib/podman/netavark ] || missing+=(netavark)
if [ ${#missing[@]} -gt 0 ]; then
    step "installing podman and its helpers (missing: ${missing[*]})" install_packages
fi

write_conf() {
    mkdir -p "$(dirname "$CONF")"
    cat >"$CONF" <<'EOF'
# Written by Sluice's scripts/containers.sh.
[containers]
# Root may lack CAP_SYS_RESOURCE (containers, sandboxes): podman's default rlimits would
# then fail to apply.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
# crun rejects hybrid cgroup v1/v2 layouts; runc works. No systemd: cgroupfs.
runtime = "runc"
cgroup_manager = "cgroupfs"
EOF
}
if [ ! -e "$CONF" ]; then
    step "writing $CONF (runc, cgroupfs, rlimits)" write_conf
elif ! grep -q 'runtime *= *"runc"' "$CONF"; then
    echo "containers.sh: note: $CONF exists and does not set runtime = \"runc\"; left as it is" >&2
fi

build_base_image() {
    local mirror rootfs
    mirror=$(debian_mirror)
    if [ -z "$mirror" ]; then
        apt-get update -qq
        mirror=$(debian_mirror)
    fi
    [ -n "$mirror" ] || {
        echo "no Debian $SUITE archive in this host's apt sources" >&2
        return 1
    }
    rootfs=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$rootfs' '$rootfs.log'; trap - RETURN" RETURN
    debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$rootfs" "$mirror" \
        >"$rootfs.log" 2>&1 || {
        tail -n 20 "$rootfs.log" >&2
        return 1
    }
    # This host's extra CA certificates, so that apt and pip inside the images trust what
    # the host trusts.
    if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
        cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
        chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --quiet \
        --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
        --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
}
if ! podman image exists "$BASE_IMAGE"; then
    step "building the base image $BASE_IMAGE with debootstrap (once; kept as a cache)" \
        build_base_image
fi

fetch_compose() {
    local mirror work
    mirror=$(debian_mirror)
    [ -n "$mirror" ] || {
        echo "no Debian $SUITE archive in this host's apt sources" >&2
        return 1
    }
    work=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$work'; trap - RETURN" RETURN
    mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/deb"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" \
        >"$work/sources.list"
    # A private apt state: the host's own sources and lists stay as they are.
    local opts=(
        -o "Dir::Etc::SourceList=$work/sources.list"
        -o "Dir::Etc::SourceParts=-"
        -o "Dir::State::Lists=$work/lists"
        -o "Dir::Cache=$work"
        -o "Dir::Cache::pkgcache="
        -o "Dir::Cache::srcpkgcache="
        -o "APT::Get::List-Cleanup=0"
        -o "APT::Sandbox::User=root"
    )
    apt-get "${opts[@]}" update -qq >/dev/null &&
        (cd "$work/deb" && apt-get "${opts[@]}" download -qq docker-compose >/dev/null) &&
        dpkg-deb -x "$work"/deb/docker-compose_*.deb "$work/root" &&
        mkdir -p "$CACHE" &&
        install -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" "$COMPOSE"
}
if [ ! -x "$COMPOSE" ]; then
    step "fetching Compose v2 (Debian trixie's docker-compose package) into $CACHE" \
        fetch_compose
fi

echo "$COMPOSE"
