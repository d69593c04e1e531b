// "single": one process, no communication. The reference every parallel strategy is
// compared against.
#include "fsdp/single_strategy.h"

#include "fsdp/lightning.h"

#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

namespace fsdp {

void SingleDeviceStrategy::connect(ProcessGroupPtr world, const LaunchInfo& launch) {
  const int size = world ? world->size() : launch.world_size;
  TORCH_CHECK(size == 1, "[strategy 'single'] runs one process, but the world has ", size,
              " ranks (devices x num_nodes, or the launcher's WORLD_SIZE). Use --devices 1, "
              "or a parallel strategy ('ddp', 'fsdp', ...; fsdp-train --help lists them all)");
  Strategy::connect(std::move(world), launch);
}

void SingleDeviceStrategy::setup_module(LightningModule& module) {}

double SingleDeviceStrategy::clip_grad_norm(LightningModule& module, double max_norm) {
  std::vector<at::Tensor> params;
  for (auto& p : module.parameters()) {
    if (p.grad().defined()) params.push_back(p);
  }
  if (params.empty()) return 0.0;
  return torch::nn::utils::clip_grad_norm_(params, max_norm, 2.0);
}

}  // namespace fsdp
