#!/usr/bin/env bash
# Installs the Debian packages fsdp.cpp needs. Idempotent: when every package is
# present it installs nothing and touches no package list.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev            # libtorch 1.13 (CPU); pulls c10d Gloo
  libgloo-dev             # Gloo headers that ProcessGroupGloo.hpp includes
  libopenmpi-dev openmpi-bin
  libopenblas0-pthread libopenblas-dev
  libcli11-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-numpy python3-torch   # independent safetensors reader (tests), PyTorch DDP peer (bench)
  clang libclang-rt-14-dev      # libFuzzer target for the checkpoint readers (tests/fuzz)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# libtorch links whatever libblas.so.3 is selected; the reference BLAS is ~30x slower.
blas=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ -e "$blas" ] && command -v update-alternatives >/dev/null; then
  current=$(readlink -f /etc/alternatives/libblas.so.3-x86_64-linux-gnu 2>/dev/null || true)
  if [ "$current" != "$blas" ]; then
    echo "setup: selecting OpenBLAS as libblas.so.3"
    SUDO=""; if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
    $SUDO update-alternatives --set libblas.so.3-x86_64-linux-gnu "$blas"
    lapack=/usr/lib/x86_64-linux-gnu/openblas-pthread/liblapack.so.3
    [ -e "$lapack" ] && $SUDO update-alternatives --set liblapack.so.3-x86_64-linux-gnu "$lapack" || true
  fi
fi
