#!/usr/bin/env bash
# Recreates gpu-deps/ (gitignored): the Debian packages a GPU machine without development
# packages lacks to configure and build fsdp.cpp (Gloo, liburing, CLI11, nlohmann-json,
# GoogleTest, zlib's headers, and the runtime libraries they load), downloaded with
# `apt-get download` and unpacked with `dpkg-deb -x` into gpu-deps/usr. scripts/gpu-check.sh
# builds against it. Needs apt's package lists (run `apt-get update` first when they are
# empty); needs no root. Usage: scripts/gpu-deps.sh [OUTPUT_DIR]   (default: gpu-deps)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/gpu-deps}

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
du -sh "$out" | sed 's/^/gpu-deps: /'
echo "gpu-deps: ${#PACKAGES[@]} packages unpacked into $out (scripts/gpu-check.sh uses it)"
