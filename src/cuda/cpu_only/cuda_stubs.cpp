// The CUDA path's answers in a build without it (cmake/cuda.cmake compiles this file when
// FSDP_WITH_CUDA resolves to OFF): no devices, no statistics, and a clear error for what needs
// CUDA. Never a silent CPU fallback.
#include "cuda/cuda_api.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

namespace {
constexpr const char* kNoCuda =
    "this build of fsdp.cpp has no CUDA: it was configured against a CPU-only libtorch. Build "
    "against a CUDA libtorch as docs/gpu.md shows (cmake -DFSDP_LIBTORCH=... or a venv with the "
    "CUDA torch wheel; FSDP_WITH_CUDA=AUTO turns the CUDA path on)";
}  // namespace

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }

void set_cuda_device(int device) {
  TORCH_CHECK(false, "[cuda] cannot use cuda:", device, ": ", kNoCuda);
}

std::optional<DeviceMemoryStats> device_memory_stats(int) { return std::nullopt; }
void reset_device_peak(int) {}
std::optional<DeviceMemoryInfo> device_memory_info(int) { return std::nullopt; }

ProcessGroupPtr make_nccl_group(const NcclGroupOptions&) {
  TORCH_CHECK(false, "[init_process_group] backend 'nccl': ", kNoCuda,
              "; on CPU use backend 'gloo' or 'mpi'");
}

}  // namespace fsdp::detail
