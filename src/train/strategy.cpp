// Strategy: the defaults every strategy inherits, the active-strategy slot fsdp::wrap() reads
// while configure_model runs, and the dim-0 row layout the checkpointer shares with FSDP.
#include "fsdp/strategy.h"

#include "fsdp/lightning.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace fsdp {

RowRange shard_row_range(int64_t dim0, int64_t shard_rows, int rank) {
  const int64_t begin = std::min<int64_t>(dim0, rank * shard_rows);
  return {begin, std::min<int64_t>(dim0, begin + shard_rows)};
}

double clip_grad_norm_of_parts(const std::vector<at::Tensor>& grads, ProcessGroup& group,
                               double max_norm) {
  at::NoGradGuard no_grad;
  at::Tensor total = at::zeros({1}, at::kDouble);
  for (const auto& g : grads) total += g.detach().to(at::kDouble).pow(2).sum();
  if (group.size() > 1) group.all_reduce(total, ReduceOp::kSum);
  const double norm = std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);  // torch.nn.utils.clip_grad_norm_'s
  if (coef < 1.0) {
    for (const auto& g : grads) g.mul_(coef);
  }
  return norm;
}

at::Tensor Strategy::reduce(const at::Tensor& value, ReduceOp op) {
  if (!world_ || world_->size() == 1) return value;
  at::Tensor out = value.detach().clone().contiguous();
  world_->all_reduce(out, op);
  return out;
}

void Strategy::barrier() {
  if (world_) world_->barrier();
}

int64_t Strategy::comm_bytes() const { return world_ ? total_bytes(world_->counters()) : 0; }

std::pair<int64_t, int64_t> Strategy::parameter_counts(torch::nn::Module& module) {
  int64_t all = 0, trainable = 0;
  for (const auto& p : module.parameters()) {
    all += p.numel();
    if (p.requires_grad()) trainable += p.numel();
  }
  return {all, trainable};
}

LocalShards Strategy::local_shards() {
  LocalShards shards;
  shards.replica_rank = rank();  // every rank holds the whole model
  return shards;
}

namespace {
Strategy* g_active_strategy = nullptr;
}  // namespace

Strategy* active_strategy() { return g_active_strategy; }

void configure_model_with(Strategy& strategy, LightningModule& module) {
  TORCH_CHECK(g_active_strategy == nullptr,
              "[configure_model] configure_model is already running under strategy '",
              g_active_strategy ? g_active_strategy->name() : "", "'; it must not nest");
  // Active for the whole enter/configure/exit sequence: fsdp::wrap() may be called from any of it.
  g_active_strategy = &strategy;
  try {
    strategy.enter_configure_model();
    module.configure_model();
    strategy.exit_configure_model();
  } catch (...) {
    g_active_strategy = nullptr;
    throw;
  }
  g_active_strategy = nullptr;
}

}  // namespace fsdp
