#!/usr/bin/env bash
# Installs what fsdp.cpp needs, idempotently (both README commands run it):
#  1. Debian packages: compilers and build tools, OpenMPI, Gloo, CLI11, nlohmann-json,
#     GoogleTest/Benchmark, clang (the default compiler, and the fuzz targets). Nothing is
#     installed when all are present.
#  2. The project's Python virtual environment (.venv, or $FSDP_VENV) with the pinned packages of
#     scripts/requirements*.txt: torch==2.13.0 (CPU), whose libtorch the C++ build links, and the
#     peers that tests and benchmarks run beside fsdp.cpp. Nothing is installed when the
#     environment already matches the pinned files (a stamp holds their hash).
# Environment: FSDP_PYTHON (interpreter that creates the venv, default python3), FSDP_VENV.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libgloo-dev                   # the gloo backend calls Gloo directly (docs/design.md, Note [Gloo backend])
  libopenmpi-dev openmpi-bin    # the mpi backend
  libcli11-dev nlohmann-json3-dev
  liburing-dev                  # the disk tier's asynchronous I/O (io_uring)
  zlib1g-dev                    # checkpoint checksums (crc32; src/ckpt/safetensors.h)
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev      # the compiler make picks (Makefile); libFuzzer targets (tests/fuzz)
  python3 python3-venv          # the project's virtual environment
)

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# --- Python environment -------------------------------------------------------------------
PYTHON=${FSDP_PYTHON:-python3}
VENV=${FSDP_VENV:-$root/.venv}
reqs=("$root/scripts/requirements.txt" "$root/scripts/requirements-nobuild.txt")
want=$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
stamp="$VENV/.fsdp-requirements.sha256"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the Python environment $VENV ($($PYTHON --version 2>&1))"
  if ! "$PYTHON" -m venv "$VENV"; then
    echo "setup: '$PYTHON -m venv' failed. ---> HINT: install python3-venv, or set FSDP_PYTHON to a" \
         "Python 3.11 interpreter that has venv" >&2
    exit 1
  fi
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "setup: installing the pinned Python packages into $VENV (torch 2.13.0 CPU + peers; once)"
# torch==2.13.0 resolves to the CPU build where one is offered (the local version label +cpu
# sorts above the registry's CUDA build of the same version).
"${pip[@]}" install -q -r "$root/scripts/requirements.txt"
"${pip[@]}" install -q --no-build-isolation -r "$root/scripts/requirements-nobuild.txt"
"$VENV/bin/python" - <<'PY'
import sys, torch
v = torch.__version__
if not v.startswith("2.13.0"):
    sys.exit(f"setup: the environment has torch {v}, expected 2.13.0")
print(f"setup: torch {v} (cuda: {torch.version.cuda}); libtorch CMake package in "
      f"{torch.utils.cmake_prefix_path}")
PY
echo "$want" > "$stamp"
