// What the rest of the engine asks of the CUDA path. This header includes no CUDA header: a CUDA
// build defines these functions in src/cuda/*.cpp, a CPU build in src/cuda/cpu_only/cuda_stubs.cpp
// (cuda_built() false, no devices, no statistics, NCCL an error). See docs/gpu.md.
#pragma once

#include "fsdp/comm.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace fsdp::detail {

// True when this build has the CUDA path (cmake/cuda.cmake, FSDP_WITH_CUDA).
bool cuda_built();
// Visible CUDA devices (0 in a CPU build, or when the driver sees none).
int cuda_device_count();
// Makes `device` this thread's current CUDA device. CPU build: an error.
void set_cuda_device(int device);

// The CUDA caching allocator's statistics for one device, all streams together (the C++
// analogue of torch.cuda.max_memory_allocated / memory_allocated / max_memory_reserved).
struct DeviceMemoryStats {
  int device = 0;
  int64_t peak_allocated = 0;
  int64_t current_allocated = 0;
  int64_t peak_reserved = 0;
};
// nullopt in a CPU build or when no device is visible; else the statistics of `device`
// (-1: the current device).
std::optional<DeviceMemoryStats> device_memory_stats(int device = -1);
// Resets the peaks of `device` (-1: current) to the current values. CPU build: no-op.
void reset_device_peak(int device = -1);

// What the driver says of a device's memory (cudaMemGetInfo): free and total bytes, all
// processes together. nullopt in a CPU build or when no device is visible.
struct DeviceMemoryInfo {
  int device = 0;
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
std::optional<DeviceMemoryInfo> device_memory_info(int device = -1);

struct NcclGroupOptions {
  c10::intrusive_ptr<c10d::Store> store;  // the job's rendezvous store (src/comm/rendezvous.h)
  int rank = 0;
  int size = 1;
  int device = 0;  // the CUDA device this rank uses
  std::string key = "nccl/world";  // store key of the ncclUniqueId; the same on every rank
  std::chrono::milliseconds timeout{std::chrono::minutes(1)};  // waiting for rank 0's id
  // A collective not complete after this long aborts the group, naming the ranks that did not
  // join (FSDP_COLLECTIVE_TIMEOUT_S; Note [NCCL watchdog] in src/cuda/nccl_process_group.cpp).
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(10)};
  // The job's store on a connection of its own, for the heartbeats behind the culprit naming;
  // null: the timeout message cannot name ranks.
  c10::intrusive_ptr<c10d::Store> monitor_store;
};
// The world group over NCCL (src/cuda/nccl_process_group.cpp). Collective. CPU build: an error
// that names the CUDA build (docs/gpu.md).
ProcessGroupPtr make_nccl_group(const NcclGroupOptions& options);

}  // namespace fsdp::detail
