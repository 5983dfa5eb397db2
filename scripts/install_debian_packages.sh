#!/usr/bin/env bash
# Installs the Debian packages keras_geeps needs: Fashion-MNIST for the main
# job (files under /usr/share/datasets/fashion-mnist/). Idempotent.
set -euo pipefail
packages=(dataset-fashion-mnist)
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
