#!/usr/bin/env bash
# Installs the Debian packages keras_geeps needs: Fashion-MNIST for the main
# job (files under /usr/share/datasets/fashion-mnist/), and, where they are
# missing, a C compiler and the headers of Debian's Python (pyaegis, the
# sealed channel's cipher, builds from source) and its venv module (the
# Makefile makes .venv). Idempotent.
set -euo pipefail
packages=(dataset-fashion-mnist)
command -v cc >/dev/null 2>&1 || packages+=(gcc)
python=${PYTHON:-python3}
# Debian's python3.X-dev and python3.X-venv (a Python not from Debian
# brings its own headers and ensurepip)
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if ! "$python" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(
    os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  packages+=("python$version-dev")
fi
"$python" -c 'import ensurepip' 2>/dev/null || packages+=("python$version-venv")
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q "${missing[@]}" </dev/null \
  || { $sudo apt-get update -q </dev/null && \
       $sudo apt-get install -y -q "${missing[@]}" </dev/null; }
