// The model-state budget of a rank; see state_budget.h.
#include "memory/state_budget.h"

#include "common/settings.h"
#include "cuda/cuda_api.h"
#include "fsdp/memory.h"

#include <algorithm>

namespace fsdp {
namespace detail {

// Note [Model-state budget]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// DDP, FSDP and the ZeRO stages refuse a configuration whose model state (parameters,
// gradients, optimizer state, buffers) cannot fit, before allocating any of it, with the
// computed need and the flags that would fit. What it must fit in is where the state lives:
// on the CPU, the memory budget (FSDP_MEMORY_BUDGET, else MemAvailable over the node's ranks);
// on a CUDA device, the device's total memory as the driver reports it, divided by the local
// ranks that share the device (rank r on r % devices). Total, not free: the model itself is
// on the device when the strategy sets it up (Note [Moving the model to the device]), and a
// peer on the same device may not have allocated yet, so "free" would count the wrong things
// at the wrong time; total is a bound nothing can exceed, so a refusal is never false for the
// state the estimate counts. Activations are not in the estimate: a configuration that passes
// can still run out during the step, which the Trainer then reports as one sentence
// (Note [Out of memory during fit] in src/train/trainer.cpp). FSDP_MEMORY_BUDGET=0 turns both
// checks off.

int ranks_sharing_device(int local_world_size, int devices, int index) {
  if (devices <= 0 || index < 0 || index >= devices) return 0;
  const int n = std::max(local_world_size, 1);
  return n / devices + (index < n % devices ? 1 : 0);
}

ModelStateBudget device_state_budget(c10::Device device, int64_t total_bytes, int ranks_sharing) {
  ModelStateBudget b;
  const int ranks = std::max(ranks_sharing, 1);
  b.bytes = total_bytes / ranks;
  b.what = device.str() + "'s memory (" + format_bytes(total_bytes) +
           (ranks > 1 ? ", " + std::to_string(ranks) + " ranks share it)" : ")");
  b.more = ranks > 1 ? "or fewer ranks per GPU" : "or GPUs with more memory";
  return b;
}

namespace {

ModelStateBudget budget_with_host(c10::Device device, int local_world_size, int64_t host) {
  if (host <= 0) return {};
  if (!device.is_cuda()) return {host, "the memory budget", "or raise FSDP_MEMORY_BUDGET"};
  const int index = device.has_index() ? device.index() : 0;
  const auto info = device_memory_info(index);
  if (!info) return {};
  return device_state_budget(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index)),
                             info->total_bytes,
                             ranks_sharing_device(local_world_size, cuda_device_count(), index));
}

}  // namespace

}  // namespace detail

ModelStateBudget model_state_budget(c10::Device device, int local_world_size) {
  return detail::budget_with_host(device, local_world_size, memory_budget());
}

ModelStateBudget planned_model_state_budget(c10::Device device, int local_world_size) {
  const std::optional<int64_t> set = detail::read_settings().memory_budget;
  ModelStateBudget b = detail::budget_with_host(
      device, local_world_size, set ? *set : default_memory_budget(local_world_size));
  if (b.bytes > 0 && !device.is_cuda()) {
    b.what += set ? " (FSDP_MEMORY_BUDGET)"
                  : " (MemAvailable / " + std::to_string(std::max(local_world_size, 1)) +
                        " ranks; FSDP_MEMORY_BUDGET sets it)";
  }
  return b;
}

}  // namespace fsdp
