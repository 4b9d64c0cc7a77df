#!/usr/bin/env bash
# Build the expertmesh base image (Debian bookworm + Python 3.11 + venv + pip, all from Debian)
# with debootstrap and `docker import`, for hosts that cannot pull from a container registry.
#
#   bash docker/build-base.sh            # prints the image reference on its last line
#
# The root filesystem tarball is cached under $EXPERTMESH_CACHE_DIR/base, keyed by this
# script's content and the CA certificates baked in, so a second run only re-imports it (or
# does nothing when the image is already loaded).
#
# Environment:
#   EXPERTMESH_CACHE_DIR     cache root                    (default /var/cache/expertmesh)
#   EXPERTMESH_BASE_TAG      image repository name         (default expertmesh-base)
#   EXPERTMESH_DEBIAN_MIRROR Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   EXPERTMESH_CA_DIR        extra CA certificates to trust (default /usr/local/share/ca-certificates)
set -euo pipefail

SUITE=bookworm
CACHE_DIR=${EXPERTMESH_CACHE_DIR:-/var/cache/expertmesh}
BASE_TAG=${EXPERTMESH_BASE_TAG:-expertmesh-base}
MIRROR=${EXPERTMESH_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_DIR=${EXPERTMESH_CA_DIR:-/usr/local/share/ca-certificates}
PACKAGES=python3,python3-venv,python3-pip,ca-certificates

log() { echo "[build-base] $*" >&2; }

ca_files() {
    [[ -d $CA_DIR ]] || return 0
    find "$CA_DIR" -type f -name '*.crt' | LC_ALL=C sort
}

# NOTE: the key covers everything that ends up in the tarball: this script (suite, package
# list, trimming) and the certificates. The mirror is left out on purpose: any mirror serves
# the same suite.
cache_key() {
    {
        cat "${BASH_SOURCE[0]}"
        ca_files | while read -r f; do cat "$f"; done
    } | sha256sum | cut -c1-16
}

unmount_under() {
    local dir=$1 m
    # deepest first; debootstrap may leave proc/sys mounted when it fails half-way
    awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/mounts | sort -r |
        while read -r m; do umount -l "$m" || true; done
}

make_tarball() {
    local tarball=$1 work
    command -v debootstrap >/dev/null || { log "debootstrap is not installed (apt-get install debootstrap)"; exit 1; }
    [[ $(id -u) == 0 ]] || { log "debootstrap needs root"; exit 1; }
    mkdir -p "$(dirname "$tarball")"
    work=$(mktemp -d "$(dirname "$tarball")/rootfs.XXXXXX")
    # shellcheck disable=SC2064
    trap "unmount_under '$work'; rm -rf --one-file-system '$work'" EXIT
    log "debootstrap $SUITE ($PACKAGES) from $MIRROR"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/root" "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
        { tail -n 40 "$work/debootstrap.log" >&2; exit 1; }
    unmount_under "$work/root"

    local root=$work/root
    cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
    # Keep later apt installs in derived images small.
    cat >"$root/etc/dpkg/dpkg.cfg.d/01-expertmesh-nodoc" <<'EOF'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
EOF
    if [[ -n $(ca_files) ]]; then
        log "trusting $(ca_files | wc -l) CA certificate(s) from $CA_DIR"
        ca_files | while read -r f; do cp "$f" "$root/usr/local/share/ca-certificates/"; done
        chroot "$root" update-ca-certificates >/dev/null
    fi
    rm -rf "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
        "$root"/usr/share/locale/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
        "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/tmp/*
    : >"$root/etc/resolv.conf"
    : >"$root/etc/hostname"
    tar --numeric-owner -C "$root" -cf "$work/base.tar" .
    mv "$work/base.tar" "$tarball"
    log "wrote $tarball ($(du -h "$tarball" | cut -f1))"
}

main() {
    local key tarball image
    key=$(cache_key)
    tarball=$CACHE_DIR/base/$BASE_TAG-$SUITE-$key.tar
    image=$BASE_TAG:$SUITE-$key
    if [[ -f $tarball ]]; then
        log "cached rootfs $tarball"
    else
        make_tarball "$tarball"
        # older tarballs of this script are dead weight
        find "$CACHE_DIR/base" -maxdepth 1 -name "$BASE_TAG-$SUITE-*.tar" ! -name "$(basename "$tarball")" -delete
    fi
    if docker image inspect "$image" >/dev/null 2>&1; then
        log "image $image already loaded"
    else
        log "docker import -> $image"
        docker import \
            --change 'ENV LANG=C.UTF-8' \
            --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
            --change 'CMD ["/bin/bash"]' \
            "$tarball" "$image" >/dev/null
    fi
    docker tag "$image" "$BASE_TAG:$SUITE"
    echo "$image"
}

main "$@"
