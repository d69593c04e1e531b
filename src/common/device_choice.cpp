// See src/common/device_choice.h.
#include "common/device_choice.h"

#include "common/text.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

DeviceChoice choose_device(const std::string& accelerator, int local_rank, int local_world_size,
                           const std::string& backend, const DeviceFacts& facts) {
  DeviceChoice choice;
  const bool wants_cuda = accelerator == "cuda" || accelerator == "gpu";
  if (accelerator == "cpu") return choice;
  if (accelerator == "auto") {
    if (!facts.cuda_built || facts.visible_devices == 0) return choice;
  } else {
    TORCH_CHECK(wants_cuda, "[accelerator] unknown accelerator '", accelerator, "'; valid values: ",
                quoted_list(kAcceleratorNames));
    TORCH_CHECK(facts.cuda_built, "[accelerator] accelerator '", accelerator,
                "': this build of fsdp.cpp has no CUDA (it was configured against a CPU-only "
                "libtorch, where torch::cuda::is_available() is false). Build against a CUDA libtorch as docs/gpu.md shows (FSDP_WITH_CUDA "
                "turns on by itself there), or use accelerator='cpu' (--accelerator cpu).");
    TORCH_CHECK(facts.visible_devices > 0, "[accelerator] accelerator '", accelerator,
                "': this build has CUDA, but no CUDA device is visible (check nvidia-smi and "
                "CUDA_VISIBLE_DEVICES), or use accelerator='cpu'.");
  }
  TORCH_CHECK(local_world_size >= 1 && local_rank >= 0 && local_rank < local_world_size,
              "[accelerator] local rank ", local_rank, " is not in [0, ", local_world_size, ")");
  choice.cuda = true;
  choice.index = local_rank % facts.visible_devices;
  if (local_world_size > facts.visible_devices) {
    TORCH_CHECK(backend != "nccl", "[accelerator] ", local_world_size, " ranks on this node but ",
                facts.visible_devices, " visible CUDA device(s): NCCL allows one rank per "
                "device (two ranks of one communicator on one GPU fail with 'Duplicate GPU "
                "detected'). Start at most ", facts.visible_devices,
                " ranks per node (--devices), or use backend 'gloo' or 'mpi' to share devices.");
    choice.notice = std::to_string(local_world_size) + " ranks share " +
                    std::to_string(facts.visible_devices) +
                    " CUDA device(s): rank r uses cuda:(local_rank % " +
                    std::to_string(facts.visible_devices) + ")";
  }
  return choice;
}

}  // namespace fsdp::detail
