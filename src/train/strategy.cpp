// Strategy: the defaults every strategy inherits, configure_model under a strategy (the
// construction scope fsdp::wrap() and fsdp::nn::built() reach it through), and the dim-0 row
// layout the checkpointer shares with FSDP.
#include "fsdp/strategy.h"

#include "fsdp/lightning.h"
#include "nn/construction_scope.h"

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
  // On the gradients' device (the sum stays there until item()); the group stages it when
  // it lives elsewhere (Note [Staging device tensors]).
  const c10::Device device = grads.empty() ? group.device() : grads.front().device();
  at::Tensor total = at::zeros({1}, at::TensorOptions(at::kDouble).device(device));
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
  // On the group's device (host values to a CUDA device for NCCL), then back.
  at::Tensor out = value.detach().to(world_->device(), /*non_blocking=*/false, /*copy=*/true)
                       .contiguous();
  world_->all_reduce(out, op);
  return out.to(value.device());
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

// Note [Configure-model scope]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// While module.configure_model() runs, the model tells the strategy two things: a layer is
// finished (fsdp::nn::built, which deferred initialization shards at once; see Note [Deferred
// initialization] in src/shard/deferred_init.cpp) and a module is to be a unit (fsdp::wrap).
// The strategy is passed explicitly wherever it can be: configure_model_with is given it, the
// Trainer gives it its own, and DeepSpeed stage 3 hands the finished layers to its FSDP engine.
// The model's calls cannot be given it: built() runs inside the constructors of plain libtorch
// modules (the demo models' factories, a user's own blocks) that know nothing of strategies or
// of the LightningModule they will be registered in, and a libtorch module has no link to its
// parent through which wrap(block) could look one up. So configure_model_with opens a
// construction scope for exactly the duration of the call (detail::ConstructionScope,
// src/nn/construction_scope.h): a thread-local pointer to the running strategy, set here and
// nowhere else, cleared on return and on exception, refusing to nest. It is the construction
// context Python users know as deepspeed.zero.Init() and FSDP1's enable_wrap(). It is not
// process state: another thread, and everything outside the call (a model built before fit, a
// second Trainer), sees no scope, and built() / wrap() then do nothing.

namespace {

class StrategyListener final : public detail::ConstructionListener {
 public:
  explicit StrategyListener(Strategy& strategy) : strategy_(strategy) {}
  void on_built(torch::nn::Module& module) override { strategy_.on_module_built(module); }
  void on_wrap(fsdp::nn::Module& module) override { strategy_.on_module_wrapped(module); }

 private:
  Strategy& strategy_;
};

}  // namespace

void configure_model_with(Strategy& strategy, LightningModule& module) {
  StrategyListener listener(strategy);
  // The whole enter/configure/exit sequence: fsdp::wrap() may be called from any of it.
  detail::ConstructionScope scope(listener, "strategy '" + strategy.name() + "'");
  strategy.enter_configure_model();
  module.configure_model();
  strategy.exit_configure_model();
}

}  // namespace fsdp
