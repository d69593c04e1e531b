// Devices and the CUDA caching allocator's statistics (CUDA build). See docs/gpu.md.
#include "cuda/cuda_api.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

namespace fsdp::detail {

bool cuda_built() { return true; }

int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

void set_cuda_device(int device) {
  const int n = cuda_device_count();
  TORCH_CHECK(device >= 0 && device < n, "[cuda] device cuda:", device, " does not exist: ", n,
              " CUDA device(s) visible (check CUDA_VISIBLE_DEVICES)");
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
}

namespace {
int resolve(int device) {
  return device >= 0 ? device : static_cast<int>(c10::cuda::current_device());
}
}  // namespace

std::optional<DeviceMemoryStats> device_memory_stats(int device) {
  if (cuda_device_count() == 0) return std::nullopt;
  device = resolve(device);
  namespace alloc = c10::cuda::CUDACachingAllocator;
  const auto stats = alloc::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  // Index 0 is StatType::AGGREGATE: small and large pools together (what
  // torch.cuda.max_memory_allocated reports).
  constexpr size_t kAggregate = 0;
  DeviceMemoryStats s;
  s.device = device;
  s.peak_allocated = stats.allocated_bytes[kAggregate].peak;
  s.current_allocated = stats.allocated_bytes[kAggregate].current;
  s.peak_reserved = stats.reserved_bytes[kAggregate].peak;
  return s;
}

void reset_device_peak(int device) {
  if (cuda_device_count() == 0) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(resolve(device)));
}

std::optional<DeviceMemoryInfo> device_memory_info(int device) {
  if (cuda_device_count() == 0) return std::nullopt;
  device = resolve(device);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  size_t free_bytes = 0, total_bytes = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return DeviceMemoryInfo{device, static_cast<int64_t>(free_bytes),
                          static_cast<int64_t>(total_bytes)};
}

}  // namespace fsdp::detail
