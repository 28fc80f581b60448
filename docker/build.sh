#!/usr/bin/env bash
# Builds Tandem's images with buildah: no Docker daemon, no container registry.
#
#   docker/build.sh cpu|cuda        (make image / make image-cuda)
#
# 1. The base, once: a Debian root file system that debootstrap (--variant=minbase) fetches from this
#    machine's Debian mirror (/etc/apt/sources.list*), kept as localhost/tandem-base:<suite>-<hash of its sources>.
# 2. docker/Containerfile.<device> on it: Debian's runtime libraries, then scripts/setup.sh as the README
#    installs Tandem. The image is named as the Helm chart's defaults: <image.repository>:<appVersion>-<device>.
#
# buildah runs as root with chroot isolation (no daemon, no user namespaces) and the overlay storage driver
# where the kernel allows, else vfs. Each step is a cached layer: a rebuild after a source change re-runs
# only the last setup step. Environment:
#   TANDEM_IMAGE_ROOT     buildah's storage under it (storage/, run/; default: buildah's, /var/lib/containers)
#   TANDEM_STORAGE_DRIVER overlay | vfs (default: as above)
#   TANDEM_DEBIAN_MIRROR  the mirror debootstrap uses (default: the host's, for the host's suite)
# pip inside the build uses this machine's CA bundle and (CPU) local wheels: see host_pip_flags.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cpu}
case "$DEVICE" in cpu|cuda) ;; *) echo "usage: docker/build.sh cpu|cuda" >&2; exit 2 ;; esac

[ "$(id -u)" -eq 0 ] || { echo "[image] run as root: debootstrap and buildah's chroot isolation need it" >&2; exit 2; }

need_tools() {
  command -v buildah >/dev/null && command -v debootstrap >/dev/null && return
  echo "[image] installing Debian packages buildah debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah debootstrap >/dev/null
}

# The URIs of the host's `deb` sources that carry `suite` (one-line and deb822 files), first first.
apt_uris() {
  local suite=$1
  awk -v s="$suite" '$1 == "deb" { for (i = 2; i < NF; i++) if ($i ~ /:\/\//) { if ($(i + 1) == s) print $i; break } }' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true
  awk -v s="$suite" 'BEGIN { RS = "" } {
      uri = ""; deb = 0; has = 0; n = split($0, line, "\n")
      for (i = 1; i <= n; i++) {
        m = split(line[i], f, /[ \t]+/)
        if (f[1] == "Types:") for (j = 2; j <= m; j++) if (f[j] == "deb") deb = 1
        if (f[1] == "URIs:") uri = f[2]
        if (f[1] == "Suites:") for (j = 2; j <= m; j++) if (f[j] == s) has = 1
      }
      if (deb && has && uri != "") print uri
    }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true
}

SUITE=$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")
MIRROR=${TANDEM_DEBIAN_MIRROR:-$(apt_uris "$SUITE" | head -1)}
SECURITY=$(apt_uris "$SUITE-security" | head -1)
BASE_PACKAGES=ca-certificates,debian-archive-keyring  # what a build's first step needs (https, apt's keys)
BASE=localhost/tandem-base:$SUITE-$(echo "$MIRROR $SECURITY $BASE_PACKAGES" | sha256sum | cut -c1-8)
IMAGE_CA=/etc/ssl/certs/ca-certificates.crt
REPO=$(awk '/^image:/ { on = 1 } on && $1 == "repository:" { print $2; exit }' helm/tandem/values.yaml)
VERSION=$(awk -F'"' '/^appVersion:/ { print $2 }' helm/tandem/Chart.yaml)
IMAGE=$REPO:$VERSION-$DEVICE
STORE=${TANDEM_IMAGE_ROOT:+$TANDEM_IMAGE_ROOT/storage}

# overlay where the kernel mounts one here (layers shared, not copied), else vfs (a full copy per layer: about
# twice the build time); a store keeps the driver it was made with.
storage_driver() {
  local root=${STORE:-/var/lib/containers/storage} probe
  for d in overlay vfs; do [ -d "$root/$d-images" ] && echo "$d" && return; done
  mkdir -p "$root"
  probe=$(mktemp -d "$root/.probe.XXXXXX")
  mkdir "$probe"/{lower,upper,work,merged}
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" 2>/dev/null; then
    umount "$probe/merged"
    echo overlay
  else
    echo vfs
  fi
  rm -rf "$probe"
}

# Debian's sources inside the base: the mirror's suite and its updates, and the security suite where the host has one.
base_sources() {
  printf 'Types: deb\nURIs: %s\nSuites: %s %s-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$MIRROR" "$SUITE" "$SUITE"
  [ -z "$SECURITY" ] || printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$SECURITY" "$SUITE"
}

make_base() {
  if "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then echo "[image] base $BASE (kept)"; return; fi
  [ -n "$MIRROR" ] || { echo "[image] no Debian mirror for $SUITE in /etc/apt/sources.list*: set TANDEM_DEBIAN_MIRROR" >&2; exit 2; }
  echo "[image] base $BASE: debootstrap --variant=minbase $SUITE from $MIRROR"
  local start=$SECONDS root
  ctr=$("${B[@]}" from --name "tandem-base-$SUITE-$$" scratch)
  trap '"${B[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT  # a failed debootstrap leaves no container
  root=$("${B[@]}" mount "$ctr")
  debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$root" "$MIRROR" >/dev/null
  rm -f "$root/etc/apt/sources.list"
  base_sources >"$root/etc/apt/sources.list.d/debian.sources"
  rm -rf "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log
  "${B[@]}" config --env LANG=C.UTF-8 --cmd /bin/bash \
    --created-by "debootstrap --variant=minbase $SUITE $MIRROR" "$ctr"
  "${B[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
  trap - EXIT
  echo "[image] base made in $((SECONDS - start)) s"
}

# This machine's pip settings that a build needs, as `buildah build` flags. Each is mounted read-only for
# the RUN steps over a path the image has anyway, so nothing of it stays in the image: the CA bundle pip
# trusts (PIP_CERT, pip's global.cert: a proxy's CA) over the image's own, and for the CPU image the first
# local wheel directory that holds a CPU torch (PIP_FIND_LINKS, global.find-links) at /mnt.
pip_setting() { printf '%s %s' "${!1:-}" "$(python3 -m pip config get "$2" 2>/dev/null || true)"; }
host_pip_flags() {
  local f
  for f in $(pip_setting PIP_CERT global.cert); do
    [ -f "$f" ] && printf '%s\n' "-v=$f:$IMAGE_CA:ro" "--build-arg=PIP_CERT=$IMAGE_CA" && break
  done
  [ "$DEVICE" = cpu ] || return 0
  for f in $(pip_setting PIP_FIND_LINKS global.find-links); do
    compgen -G "$f/torch-*+cpu-*.whl" >/dev/null && printf '%s\n' "-v=$f:/mnt:ro" "--build-arg=PIP_FIND_LINKS=/mnt" && break
  done
  return 0
}

need_tools
B=(buildah --storage-driver "${TANDEM_STORAGE_DRIVER:-$(storage_driver)}")
[ -z "$STORE" ] || B+=(--root "$STORE" --runroot "$TANDEM_IMAGE_ROOT/run")
make_base
mapfile -t FLAGS < <(host_pip_flags)
echo "[image] $IMAGE from docker/Containerfile.$DEVICE ${FLAGS[*]}"
start=$SECONDS
"${B[@]}" build --isolation chroot --network host --layers --force-rm --build-arg "BASE=$BASE" "${FLAGS[@]}" \
  -f "docker/Containerfile.$DEVICE" -t "$IMAGE" .
# in a store of our own (the tests'), the layers of earlier sources that no image uses any more go
[ -z "$STORE" ] || "${B[@]}" rmi --prune >/dev/null || true
echo "[image] built $IMAGE in $((SECONDS - start)) s: $("${B[@]}" images --format '{{.Size}}' "$IMAGE")"
echo "[image] to push it: ${B[*]} push $IMAGE docker://<registry>/tandem:$VERSION-$DEVICE"
