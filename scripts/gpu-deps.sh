#!/usr/bin/env bash
# Recreates gpu-deps/ (gitignored): the Debian packages a GPU machine without development
# packages lacks to configure and build fsdp.cpp (Gloo, liburing, CLI11, nlohmann-json,
# GoogleTest, zlib's headers, and the runtime libraries they load), downloaded with
# `apt-get download` and unpacked with `dpkg-deb -x` into gpu-deps/usr. scripts/gpu-check.sh
# builds against it. Needs apt's package lists (run `apt-get update` first when they are
# empty); needs no root. Usage: scripts/gpu-deps.sh [OUTPUT_DIR]   (default: gpu-deps)
#
# With FSDP_LLMC_DIR set to a checkout of https://github.com/karpathy/llm.c, it also copies the
# sources of llm.c's CUDA trainer (train_gpt2.cu, llmc/, LICENSE; about 0.4 MB) into
# OUTPUT_DIR/llmc, for scripts/gpu-bench.sh to build on the GPU machine. llm.c is never part of
# the repository. `scripts/gpu-deps.sh --llmc [OUTPUT_DIR]` refreshes only that copy, in a folder
# this script made (or a new one).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
llmc_only=0
if [ "${1:-}" = "--llmc" ]; then llmc_only=1; shift; fi
out=${1:-$root/gpu-deps}

# llm.c's CUDA trainer sources from $FSDP_LLMC_DIR into $out/llmc (replacing an earlier copy).
copy_llmc() {
  if [ -z "${FSDP_LLMC_DIR:-}" ]; then
    echo "gpu-deps: FSDP_LLMC_DIR not set: llm.c's sources not copied (scripts/gpu-bench.sh" \
         "then reports its llm.c row as not run)"
    return 0
  fi
  if [ ! -f "$FSDP_LLMC_DIR/train_gpt2.cu" ] || [ ! -d "$FSDP_LLMC_DIR/llmc" ]; then
    echo "gpu-deps: FSDP_LLMC_DIR=$FSDP_LLMC_DIR has no train_gpt2.cu and llmc/; pass a" \
         "checkout of https://github.com/karpathy/llm.c" >&2
    exit 1
  fi
  rm -rf "$out/llmc"
  mkdir -p "$out/llmc"
  cp "$FSDP_LLMC_DIR/train_gpt2.cu" "$out/llmc/"
  cp -r "$FSDP_LLMC_DIR/llmc" "$out/llmc/llmc"
  if [ -f "$FSDP_LLMC_DIR/LICENSE" ]; then cp "$FSDP_LLMC_DIR/LICENSE" "$out/llmc/"; fi
  local rev
  rev=$(git -C "$FSDP_LLMC_DIR" rev-parse HEAD 2>/dev/null || echo "unknown (not a git checkout)")
  printf 'llm.c sources copied from %s\nrevision: %s\n' "$FSDP_LLMC_DIR" "$rev" \
    > "$out/llmc/SOURCE"
  du -sh "$out/llmc" | sed 's/^/gpu-deps: llm.c sources /'
}

if [ $llmc_only = 1 ]; then
  if [ -e "$out" ] && [ ! -f "$out/.fsdp-gpu-deps" ]; then
    echo "gpu-deps: $out exists and was not made by this script; remove it or pass another" \
         "folder" >&2
    exit 1
  fi
  mkdir -p "$out"
  touch "$out/.fsdp-gpu-deps"
  copy_llmc
  exit 0
fi

PACKAGES=(
  libgloo-dev libgloo0                        # the gloo backend (find_package(Gloo))
  libhiredis0.14 libibverbs1 libnl-3-200 libnl-route-3-200  # what libgloo.so.0 loads
  liburing-dev liburing2                      # the disk tier (src/offload/aio.cpp)
  libcli11-dev nlohmann-json3-dev             # find_package(CLI11), find_package(nlohmann_json)
  libgtest-dev libgmock-dev googletest        # find_package(GTest)
  zlib1g-dev                                  # find_package(ZLIB): checkpoint checksums
)

# Only ever removes a folder this script made (it carries the marker file).
if [ -e "$out" ]; then
  if [ ! -f "$out/.fsdp-gpu-deps" ]; then
    echo "gpu-deps: $out exists and was not made by this script; remove it or pass another" \
         "folder" >&2
    exit 1
  fi
  rm -rf "$out"
fi
mkdir -p "$out/debs"
touch "$out/.fsdp-gpu-deps"
(cd "$out/debs" && apt-get download -qq "${PACKAGES[@]}")
for deb in "$out"/debs/*.deb; do dpkg-deb -x "$deb" "$out"; done
rm -rf "$out/debs" "$out/usr/share/doc" "$out/usr/share/man" "$out/usr/src"

# Debian's GlooTargets names the library by its absolute path (/usr/lib/libgloo.so.0.5.0): point
# it inside this prefix.
for f in "$out"/usr/share/cmake/Gloo/GlooTargets-*.cmake; do
  sed -i 's|"/usr/lib/|"${_IMPORT_PREFIX}/lib/|g' "$f"
done
copy_llmc
du -sh "$out" | sed 's/^/gpu-deps: /'
echo "gpu-deps: ${#PACKAGES[@]} packages unpacked into $out (scripts/gpu-check.sh uses it)"
