#!/usr/bin/env bash
# Build infra/Dockerfile without a Docker daemon or a base-image registry, then run the demo inside it.
#
#   sudo bash infra/verify-image.sh [cpu|cuda]   # measured here: cpu 6-7 minutes on 2 cores, cuda about 7 (6.3 GB)
#
# For machines like the development one: root, Debian, package registries only. buildah builds the image
# (chroot isolation, no daemon); the base image is Debian bookworm made by debootstrap from the Debian
# mirror: with its Python 3.11 for cpu, standing in for python:3.11-slim-bookworm; without Python for cuda,
# standing in for nvidia/cuda (Ubuntu without Python), so the image's install-Python step runs. cuda takes
# torch from PyPI (the CUDA wheel); the demo then runs on CPU unless the machine has a GPU. Wheels and the
# CA bundle of a TLS-intercepting proxy are passed the way the Dockerfile documents (PIP_FIND_LINKS, PIP_CERT).
# Where Docker works, `docker build -f infra/Dockerfile .` is the whole story.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${1:-cpu}
case "$VARIANT" in
  cpu) BASE=localhost/imgest-base-bookworm-python; INCLUDE=python3,python3-venv,ca-certificates ;;
  cuda) BASE=localhost/imgest-base-bookworm-bare; INCLUDE=ca-certificates ;;
  *) echo "usage: $0 [cpu|cuda]" >&2; exit 2 ;;
esac
BUILDAH=(buildah --storage-driver overlay)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"; "${BUILDAH[@]}" rm imgest-verify >/dev/null 2>&1 || true' EXIT

command -v buildah >/dev/null && command -v debootstrap >/dev/null \
  || DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah debootstrap >/dev/null

if ! "${BUILDAH[@]}" inspect "$BASE" >/dev/null 2>&1; then
  debootstrap --variant=minbase --include="$INCLUDE" bookworm "$WORK/rootfs" \
    http://deb.debian.org/debian >/dev/null
  tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar" .
  printf 'FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]\n' >"$WORK/Containerfile"
  "${BUILDAH[@]}" bud --isolation chroot -t "$BASE" "$WORK" >/dev/null
fi

# The build context is the committed tree, as a clean clone would have it.
git archive HEAD | tar -x -C "$WORK" --one-top-level=context
args=(--build-arg "BASE=$BASE" --build-arg TORCH_INDEX=https://pypi.org/simple)
[ "$VARIANT" = cpu ] && [ -d /opt/wheels ] && args+=(--build-arg PIP_FIND_LINKS=/wheels -v /opt/wheels:/wheels:ro)
[ -f /etc/ssl/certs/ca-certificates.crt ] \
  && args+=(--build-arg PIP_CERT=/certs/ca-certificates.crt -v /etc/ssl/certs:/certs:ro)
"${BUILDAH[@]}" bud --pull=never --isolation chroot -f infra/Dockerfile -t "localhost/imgest:$VARIANT" "${args[@]}" \
  "$WORK/context"

# The demo, as the image's unprivileged user, with the Debian Fashion-MNIST package mounted read-only.
mkdir -p "$WORK/run" && chown 10001 "$WORK/run"
"${BUILDAH[@]}" from --pull=never --name imgest-verify "localhost/imgest:$VARIANT" >/dev/null
"${BUILDAH[@]}" run --isolation chroot imgest-verify -- imgest --help >/dev/null
"${BUILDAH[@]}" run --isolation chroot imgest-verify -- python -c \
  "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available())"
# What a Kubernetes flow run does first (infra/k8s/prefect.yaml): load the module entrypoint from the
# installed package, in the pull step's working directory; and the image holds no second copy of the code.
"${BUILDAH[@]}" run --isolation chroot --workingdir /home/imgest imgest-verify -- python -c \
  "from prefect.flows import load_flow_from_entrypoint as load; print('entrypoint', load('imgest.flows.nightly:nightly').name)"
"${BUILDAH[@]}" run --isolation chroot imgest-verify -- sh -c \
  'test ! -e /app/flows && test ! -e /src && ! python -c "import flows" 2>/dev/null && echo "one copy of the code"'
"${BUILDAH[@]}" run --isolation chroot -v /usr/share/datasets/fashion-mnist:/usr/share/datasets/fashion-mnist:ro \
  -v "$WORK/run:/work" --workingdir /work imgest-verify -- imgest demo --per-class 20 | tail -8
"${BUILDAH[@]}" images "localhost/imgest:$VARIANT"
