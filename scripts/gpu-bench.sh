#!/usr/bin/env bash
# The GPU benchmark (bench/gpu_bench.py) on a GPU machine, in one call of at most
# FSDP_GPU_BENCH_S seconds (default 270), after scripts/gpu-check.sh has built fsdp-train in
# build-gpu/ (a machine kept warm keeps the build; a fresh one needs gpu-check.sh first).
# GPT-2 124M against PyTorch (eager, torch.compile, FSDP2) and llm.c's train_gpt2cu, and
# transformer-1b FULL_SHARD against PyTorch FSDP2 and a floor measured in the same run; see
# docs/gpu.md, "GPU benchmark". Writes gpu-bench.json and gpu-bench.log into $OUT (default:
# build-gpu/out). Extra arguments go to bench/gpu_bench.py (e.g. --rows gpt2 --steps 20).
#
# Environment (defaults are the GPU machine's):
#   FSDP_GPU_PYTHON   interpreter of the CUDA torch venv   (/opt/torch/.venv/bin/python3)
#   FSDP_GPU_BUILD    build folder with bin/fsdp-train      (build-gpu)
#   FSDP_GPU_DEPS     gpu-deps.sh's folder; llm.c's sources in its llmc/   (gpu-deps)
#   FSDP_GPU_BENCH_S  the whole run's limit in seconds; rows that would start in its last
#                     30 s are reported "not run"       (270)
#   CUDA_HOME         the toolkit whose nvcc builds llm.c   (/usr/local/cuda)
set -uo pipefail
py=${FSDP_GPU_PYTHON:-/opt/torch/.venv/bin/python3}
build=${FSDP_GPU_BUILD:-build-gpu}
deps=${FSDP_GPU_DEPS:-gpu-deps}
limit=${FSDP_GPU_BENCH_S:-270}
out=${OUT:-$build/out}
mkdir -p "$out"
json="$out/gpu-bench.json"
log="$out/gpu-bench.log"
rm -f "$json"

# fsdp-train's run-time libraries from gpu-deps (libgloo's own dependencies are not on RPATH),
# as scripts/gpu-check.sh sets them.
if deps_abs=$(cd "$deps" 2>/dev/null && pwd); then
  export LD_LIBRARY_PATH="$deps_abs/usr/lib:$deps_abs/usr/lib/x86_64-linux-gnu:$deps_abs/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi
{
  echo "gpu-bench: $(date -u +%FT%TZ), limit ${limit}s, python $py"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
} > "$log"

timeout --kill-after=10 "$limit" "$py" bench/gpu_bench.py \
  --fsdp-train "$build/bin/fsdp-train" --llmc-src "$deps/llmc" \
  --cuda-home "${CUDA_HOME:-/usr/local/cuda}" --deadline-s $((limit - 30)) \
  --work-dir "$build/gpu-bench" --out "$json" "$@" > /dev/null 2>> "$log"
rc=$?
echo "gpu-bench: exit $rc" >> "$log"
if [ -f "$json" ]; then
  cat "$json"
else
  echo "gpu-bench: no JSON (exit $rc); the log: $log" >&2
  tail -20 "$log" >&2
fi
exit $rc
