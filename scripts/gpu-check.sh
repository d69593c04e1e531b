#!/usr/bin/env bash
# Builds fsdp.cpp's CUDA path against a CUDA libtorch and runs the `gpu`-labelled tests, in one
# call of at most 9 minutes on a GPU machine that has no network and no Debian development
# packages (docs/gpu.md). Run from the repository root after scripts/gpu-deps.sh has made
# gpu-deps/ (it travels with the working tree). Writes gpu-check.json and gpu-check.log into
# $OUT (default: build-gpu/out). Each stage runs under `timeout`; a stage that fails or runs out
# of time is recorded and the stages after it are skipped.
#
# Environment (defaults are the GPU machine's):
#   FSDP_GPU_PYTHON   interpreter of the CUDA torch venv   (/opt/torch/.venv/bin/python3)
#   FSDP_GPU_BUILD    build folder                          (build-gpu)
#   FSDP_GPU_JOBS     compile jobs                          (nproc)
#   FSDP_GPU_ARCH     TORCH_CUDA_ARCH_LIST                  (9.0: H100/H200)
#   FSDP_GPU_DEPS     the unpacked packages of gpu-deps.sh  (gpu-deps)
#   FSDP_GPU_CONFIGURE_S / FSDP_GPU_BUILD_S / FSDP_GPU_TEST_S  stage limits (60 / 330 / 150 s)
set -uo pipefail
root=$(pwd)
py=${FSDP_GPU_PYTHON:-/opt/torch/.venv/bin/python3}
build=${FSDP_GPU_BUILD:-build-gpu}
jobs=${FSDP_GPU_JOBS:-$(nproc)}
arch=${FSDP_GPU_ARCH:-9.0}
deps=$(cd "${FSDP_GPU_DEPS:-gpu-deps}" 2>/dev/null && pwd) || {
  echo "gpu-check: no ${FSDP_GPU_DEPS:-gpu-deps}/ here; run scripts/gpu-deps.sh first" >&2; exit 2; }
out=${OUT:-$build/out}
mkdir -p "$out"
log="$out/gpu-check.log"
json="$out/gpu-check.json"
: > "$log"

stages=()  # JSON objects, one per stage
failed=""
stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  if [ -n "$failed" ]; then
    stages+=("{\"stage\":\"$name\",\"status\":\"skipped\",\"after\":\"$failed\"}")
    return
  fi
  echo "=== $name (limit ${limit}s): $*" >> "$log"
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local secs
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  local status=ok
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status=timeout; elif [ $rc -ne 0 ]; then status=failed; fi
  echo "=== $name: $status (rc $rc, ${secs}s)" >> "$log"
  stages+=("{\"stage\":\"$name\",\"status\":\"$status\",\"rc\":$rc,\"seconds\":$secs}")
  [ "$status" = ok ] || failed=$name
}

site=$("$py" -c 'import site; print(site.getsitepackages()[0])' 2>>"$log")
torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>>"$log")
torch_version=$("$py" -c 'import torch; print(torch.__version__)' 2>>"$log")
nvrtc=$(find "$site/nvidia" -name 'libnvrtc.so.*' ! -name '*builtins*' ! -name '*alt*' 2>/dev/null | head -1)
nccl_root=$(dirname "$(find "$site/nvidia" -name nccl.h -path '*nccl/include/*' 2>/dev/null | head -1)")/..
cuda_home=${CUDA_HOME:-/usr/local/cuda}
export TORCH_CUDA_ARCH_LIST=$arch
# Run time: the unpacked packages' libraries (libgloo's own dependencies are not on RPATH).
export LD_LIBRARY_PATH="$deps/usr/lib:$deps/usr/lib/x86_64-linux-gnu:$deps/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
{
  echo "torch $torch_version at $torch_prefix"; echo "nvrtc: $nvrtc"; echo "nccl: $nccl_root"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
} >> "$log"

stage configure "${FSDP_GPU_CONFIGURE_S:-60}" \
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DFSDP_VENV="$(dirname "$(dirname "$py")")" -DFSDP_PYTHON="$py" \
    -DCMAKE_PREFIX_PATH="$deps/usr;$torch_prefix" -DFSDP_WITH_CUDA=ON -DFSDP_WITH_MPI=OFF \
    -DFSDP_BUILD_BENCH=OFF -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_INSTALL=OFF \
    -DFSDP_NCCL_ROOT="$nccl_root" -DCUDAToolkit_ROOT="$cuda_home" -DCUDA_TOOLKIT_ROOT_DIR="$cuda_home" \
    -DCMAKE_CUDA_COMPILER="$cuda_home/bin/nvcc" -DCUDA_nvrtc_LIBRARY="$nvrtc" \
    -DTORCH_CUDA_ARCH_LIST="$arch"
stage build "${FSDP_GPU_BUILD_S:-330}" \
  cmake --build "$build" -j "$jobs" --target fsdp fsdp-train fsdp-gpu-tests
stage test "${FSDP_GPU_TEST_S:-150}" \
  ctest --test-dir "$build" -L gpu -j 6 --output-on-failure --timeout 140 --output-junit "$(cd "$out" && pwd)/gpu-tests.xml"

# Pass/skip/fail counts from ctest's summary, when the test stage ran.
counts=$(grep -Eo '[0-9]+% tests passed, [0-9]+ tests failed out of [0-9]+' "$log" | tail -1)
skipped=$(grep -c 'Not Run\|\*\*\*Skipped' "$log" || true)
{
  printf '{"torch":"%s","arch":"%s","jobs":%s,"date":"%s",' "$torch_version" "$arch" "$jobs" "$(date -u +%FT%TZ)"
  printf '"gpu":"%s",' "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  printf '"tests":"%s","skipped":%s,"stages":[' "$counts" "$skipped"
  (IFS=,; printf '%s' "${stages[*]}")
  printf ']}\n'
} > "$json"
cat "$json"
[ -z "$failed" ]
