#!/usr/bin/env bash
# Build the real Dockerfile without Docker, the way CI does (tests/container/test_image.py):
# buildah (chroot isolation, vfs storage) FROM a `debootstrap --variant=minbase bookworm` root
# filesystem imported as a local image, with build arguments only: that base instead of the CUDA
# one, the default package index for torch (its Linux wheel runs on the CPU) with the triton that
# torch pins, no cuda-compat package. Where the host has torch's CPU wheel for the image's Python
# (CI's machine: $PIP_FIND_LINKS, /opt/wheels), that wheel is used instead (mounted, a pip find-links:
# a 3.3 GB image instead of 6.3 GB with CUDA libraries nothing here runs, built without downloading
# them), with constraints.txt's triton (what the tests run on; the CPU wheel pins none).
# Build-time mounts give pip the host's CA bundle (a pip.conf naming it, mounted at /etc/pip.conf):
# nothing in the image depends on them.
#
#   container/build-ci-image.sh            # as root; prints the image name as the last line of stdout
#
# Installs buildah, podman and debootstrap with apt-get when missing; exits 3 (and says why) only
# where they cannot be installed, buildah cannot run, or the disk has too little room for the build
# (OPEN_LMI_CI_NEED_GB, default 12: the peak measured was 10.6 GB). Caches (re-runs are fast):
# the debootstrap root filesystem as a tarball in $OPEN_LMI_CI_CACHE (default
# /var/cache/open-lmi-ci), the imported base image, and the built image, tagged with a hash of
# everything the Dockerfile copies (an unchanged tree is not rebuilt; older ci- tags are removed).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${OPEN_LMI_CI_CACHE:-/var/cache/open-lmi-ci}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${HOST_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
INDEX=${TORCH_INDEX_URL:-https://pypi.org/simple}
BASE=localhost/open-lmi-ci-base:bookworm
REPO=localhost/open-lmi
VFS=(--storage-driver vfs)

log() { echo "[build-ci-image] $(date -u +%T) $*" >&2; }

missing=()
for tool in buildah podman debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if ((${#missing[@]})); then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        log "cannot install ${missing[*]}: needs root and apt-get"
        exit 3
    fi
    log "installing ${missing[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah podman debootstrap >/dev/null
fi
if ! err=$(buildah "${VFS[@]}" info 2>&1 >/dev/null); then
    log "buildah cannot run here: ${err##*$'\n'}"
    exit 3
fi
mkdir -p "$CACHE"

if ! podman "${VFS[@]}" image exists "$BASE"; then
    if [ ! -s "$CACHE/rootfs.tar" ]; then
        log "debootstrap --variant=minbase bookworm ($MIRROR)"
        rm -rf "$CACHE/rootfs.tmp"
        debootstrap --variant=minbase bookworm "$CACHE/rootfs.tmp" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
        tar -C "$CACHE/rootfs.tmp" -cf "$CACHE/rootfs.tar.tmp" .
        mv "$CACHE/rootfs.tar.tmp" "$CACHE/rootfs.tar"
        rm -rf "$CACHE/rootfs.tmp"
    fi
    log "importing the base root filesystem as $BASE"
    podman "${VFS[@]}" import "$CACHE/rootfs.tar" "$BASE" >/dev/null
fi

cd "$ROOT"
# torch's CPU wheel from the host, when it has the Dockerfile's version for bookworm's Python (3.11).
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)
WHEELS=${TORCH_WHEEL_DIR:-${PIP_FIND_LINKS:-/opt/wheels}}
TRITON=
LOCAL_TORCH=
MOUNTS=(-v "$CA_BUNDLE:/host-ca.crt:ro" -v "$CACHE/pip.conf:/etc/pip.conf:ro")
PIP_CONF='[global]\ncert = /host-ca.crt\n'
if [ -d "$WHEELS" ] && [ -z "${OPEN_LMI_CI_NO_LOCAL_TORCH:-}" ]; then
    LOCAL_TORCH=$(cd "$WHEELS" && ls "torch-$TORCH_VERSION+cpu-cp311-cp311-manylinux"*_x86_64.whl 2>/dev/null | head -1 || true)
fi
if [ -n "$LOCAL_TORCH" ]; then
    TRITON=$(sed -n 's/^triton==//p' constraints.txt)
    MOUNTS+=(-v "$WHEELS:/wheels:ro")
    PIP_CONF+='find-links = /wheels\n'  # torch==X matches X+cpu, which sorts above PyPI's X: pip takes it
fi

# Older CI images of this repository (another tree's hash): vfs keeps whole copies, so keep none.
remove_older_images() {
    for old in $(buildah "${VFS[@]}" images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep "^$REPO:ci-" | grep -v ":ci-$HASH\$"); do
        log "removing the older image $old"
        buildah "${VFS[@]}" rmi "$old" >/dev/null 2>&1 || true
    done
}

# The build's peak on disk with vfs: the working container, the committed layer and its staged copy
# (each a whole tree), then the tests' container (another copy). Too little free space is the
# machine's limit, not the tree's: say so and exit 3 (the tests skip) rather than fail midway.
NEED_GB=${OPEN_LMI_CI_NEED_GB:-12}
need_disk() {
    local dir avail
    for dir in "$(buildah "${VFS[@]}" info --format '{{.store.GraphRoot}}' 2>/dev/null || echo /var/lib/containers/storage)" \
               "${TMPDIR:-/var/tmp}"; do
        mkdir -p "$dir"
        avail=$(df -P -B1G "$dir" | awk 'NR == 2 {print $4}')
        if [ "$avail" -lt "$NEED_GB" ]; then
            log "not enough disk to build the image: ${avail} GB free under $dir, the build needs about $NEED_GB GB"
            exit 3
        fi
    done
}

# Everything the Dockerfile copies (less what .dockerignore drops), hashed: the image's tag.
HASH=$( (echo "$INDEX $LOCAL_TORCH $TRITON"; find Dockerfile .dockerignore constraints.txt pyproject.toml requirements-model.txt \
             serving.properties serving kernels sdk container -type f ! -name '*.pyc' ! -path '*/__pycache__/*' \
             ! -name build-ci-image.sh -print0 | sort -z | xargs -0 sha256sum) | sha256sum | cut -c1-16)
IMAGE="$REPO:ci-$HASH"
if buildah "${VFS[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE is built already (same files)"
else
    # vfs keeps whole copies: before building, drop what an earlier run left (its image, a killed
    # build's working container, a killed test run's container), then make sure the build fits.
    for ctr in $(buildah "${VFS[@]}" containers --noheading --format '{{.ContainerName}} {{.ImageName}}' 2>/dev/null \
                 | awk -v base="$BASE" -v repo="$REPO:ci-" 'index($1, "open-lmi-test-") == 1 || $2 == base || index($2, repo) == 1 {print $1}'); do
        log "removing the stale container $ctr"
        buildah "${VFS[@]}" rm "$ctr" >/dev/null 2>&1 || true
    done
    remove_older_images
    need_disk
    printf "$PIP_CONF" >"$CACHE/pip.conf"
    log "building $IMAGE${LOCAL_TORCH:+ (torch: $WHEELS/$LOCAL_TORCH, triton $TRITON)}"
    start=$(date +%s)
    buildah "${VFS[@]}" bud --isolation chroot --pull=never --layers=false --force-rm --format docker -t "$IMAGE" \
        --build-arg CUDA_IMAGE="$BASE" \
        --build-arg TORCH_INDEX_URL="$INDEX" \
        --build-arg CUDA_COMPAT_PACKAGE= \
        --build-arg TRITON_VERSION="$TRITON" \
        "${MOUNTS[@]}" \
        "$ROOT" >&2
    log "built $IMAGE in $(($(date +%s) - start)) s"
fi
echo "$IMAGE"
