#!/usr/bin/env bash
# Set up imgest on a fresh machine: the demo data set (Debian), a virtualenv, the package and its test extras.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: the demo's images, Chromium for the test that opens the Prefect UI headless, and libturbojpeg
# for the optional PyTurboJPEG decoder the tests cover.
if [ ! -f /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz ] || ! command -v chromium >/dev/null \
    || ! ls /usr/lib/*/libturbojpeg.so.0 >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist chromium libturbojpeg0 >/dev/null
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# torch==2.13.0 (pinned in pyproject.toml) resolves to the CPU build on this disk; never a CUDA download.
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
