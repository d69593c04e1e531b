#include "nn/activation_partitioning.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>

namespace fsdp {
namespace {

std::mutex config_mutex;
std::optional<ActivationPartitioning>& config() {
  static std::optional<ActivationPartitioning> c;
  return c;
}

}  // namespace

void configure_activation_partitioning(std::optional<ActivationPartitioning> c) {
  std::lock_guard<std::mutex> lock(config_mutex);
  config() = std::move(c);
}

std::optional<ActivationPartitioning> activation_partitioning() {
  std::lock_guard<std::mutex> lock(config_mutex);
  return config();
}

namespace detail {

// Note [Activation partitioning]
// ------------------------------
// ZeRO-R's partitioned activation checkpointing (DeepSpeed runtime/activation_checkpointing/
// checkpointing.py): with model (tensor) parallelism every rank of a model-parallel group holds
// the same block input, so each keeps 1/W of it and the recompute all-gathers it back. Here:
//   forward   the checkpoint function saves, for each floating input of >= W elements, the
//             flattened input's slice [r*c, (r+1)*c), c = ceil(numel / W), copied into its own
//             storage (zero padded past numel), instead of the input; the input itself is then
//             referenced by nothing the graph keeps, and is freed once the caller drops it.
//   backward  before the recompute, one all-gather per partitioned input over the group gives
//             W*c elements; the first numel, viewed as the input's sizes, are the input (bitwise:
//             the ranks held the same values), made a leaf that requires grad where the input did.
// The all-gathers run inside autograd's backward, in the order the blocks' backwards run: the
// same on every rank of the group since they run the same model on the same inputs.
// cpu_checkpointing: the slice is kept in host memory and moved back for the gather; with a
// CPU compute device both moves are no-ops. Unlike DeepSpeed we do not check that the numel
// divides by W (we pad), and contiguous_memory_optimization (one preallocated buffer for all
// slices) is not implemented.
bool partitions(const at::Tensor& t, int world) {
  return world > 1 && t.defined() && t.is_floating_point() && t.numel() >= world;
}

at::Tensor partition_activation(const at::Tensor& t, const ProcessGroup& group, bool to_cpu) {
  const int64_t w = group.size(), r = group.rank();
  const int64_t numel = t.numel();
  const int64_t chunk = (numel + w - 1) / w;
  at::Tensor flat = t.detach().reshape({-1});
  at::Tensor part = at::zeros({chunk}, flat.options().device(to_cpu ? c10::Device(c10::kCPU)
                                                                     : flat.device()));
  const int64_t begin = std::min(numel, r * chunk), end = std::min(numel, (r + 1) * chunk);
  if (end > begin) part.narrow(0, 0, end - begin).copy_(flat.narrow(0, begin, end - begin));
  return part;
}

at::Tensor gather_activation(const at::Tensor& part, at::IntArrayRef sizes, c10::Device device,
                             ProcessGroup& group) {
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  at::Tensor mine = part.to(device);
  at::Tensor all = at::empty({mine.numel() * group.size()}, mine.options());
  group.all_gather_into_tensor(all, mine);
  TORCH_INTERNAL_ASSERT(all.numel() >= numel, "[activation partitioning] gathered ", all.numel(),
                        " elements for an input of ", numel);
  return all.narrow(0, 0, numel).view(sizes);
}

}  // namespace detail
}  // namespace fsdp
