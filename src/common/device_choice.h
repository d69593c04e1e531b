// Which device a rank computes on: the one place that reads an accelerator name ("cpu", "cuda",
// "gpu", "auto") and answers with a device or a clear error. Pure (the build's and the
// machine's facts come in as arguments), so every rule is testable on a machine without a GPU.
#pragma once

#include <string>
#include <vector>

namespace fsdp::detail {

inline const std::vector<std::string> kAcceleratorNames = {"cpu", "auto", "cuda", "gpu"};

struct DeviceFacts {
  bool cuda_built = false;  // cuda_built() (src/cuda/cuda_api.h)
  int visible_devices = 0;  // cuda_device_count()
};

struct DeviceChoice {
  bool cuda = false;
  int index = 0;       // cuda:index when cuda
  std::string notice;  // one line for rank 0 to print ("" = nothing to say)
};

// Rank `local_rank` of `local_world_size` ranks on this node, over process-group `backend`
// ("gloo" | "mpi" | "nccl" | "auto"). Rules (docs/gpu.md):
//  - "cpu": cpu. "auto": cuda when the build has CUDA and a device is visible, else cpu.
//  - "cuda"/"gpu": an error in a build without CUDA (naming the build command's page) or with no
//    visible device; else cuda:(local_rank % visible_devices).
//  - More local ranks than devices: ranks share devices over gloo/mpi (said once in `notice`);
//    refused over nccl, whose rule is one rank per device.
DeviceChoice choose_device(const std::string& accelerator, int local_rank, int local_world_size,
                           const std::string& backend, const DeviceFacts& facts);

}  // namespace fsdp::detail
