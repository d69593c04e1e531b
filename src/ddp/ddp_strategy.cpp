#include "fsdp/ddp.h"

#include "ddp/reducer.h"
#include "fsdp/lightning.h"
#include "fsdp/memory.h"

#include <torch/nn/utils/clip_grad.h>

#include <cstdio>
#include <unordered_set>

namespace fsdp {
namespace {

// Parameters (or buffers) of a module tree, each tensor once (tied weights appear once, under
// their first name), in registration order.
std::vector<detail::NamedTensor> unique_named(const torch::OrderedDict<std::string, at::Tensor>& d) {
  std::vector<detail::NamedTensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& item : d) {
    if (!item.value().defined()) continue;
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    out.push_back({item.key(), item.value()});
  }
  return out;
}

std::string format_count(int64_t n) {
  char buf[32];
  if (n >= 1000000000) std::snprintf(buf, sizeof(buf), "%.1fB", n / 1e9);
  else if (n >= 1000000) std::snprintf(buf, sizeof(buf), "%.1fM", n / 1e6);
  else if (n >= 1000) std::snprintf(buf, sizeof(buf), "%.1fK", n / 1e3);
  else std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(n));
  return buf;
}

// Broadcasts `tensors` from rank 0 through flat buffers of at most ~cap_bytes, one dtype and
// device per buffer: a handful of collectives instead of one per tensor.
void broadcast_flat(ProcessGroup& group, const std::vector<at::Tensor>& tensors,
                    double cap_bytes) {
  if (group.size() == 1 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  size_t i = 0;
  while (i < tensors.size()) {
    const at::Tensor& first = tensors[i];
    std::vector<at::Tensor> chunk;
    double bytes = 0;
    size_t j = i;
    // Consecutive tensors of the same dtype/device (registration order keeps runs long).
    while (j < tensors.size() && tensors[j].scalar_type() == first.scalar_type() &&
           tensors[j].device() == first.device() && (chunk.empty() || bytes < cap_bytes)) {
      chunk.push_back(tensors[j]);
      bytes += static_cast<double>(tensors[j].nbytes());
      ++j;
    }
    std::vector<at::Tensor> flat_parts;
    flat_parts.reserve(chunk.size());
    for (const auto& t : chunk) flat_parts.push_back(t.detach().reshape({-1}));
    at::Tensor flat = at::cat(flat_parts);
    group.broadcast(flat, 0);
    int64_t offset = 0;
    for (auto& t : chunk) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
    i = j;
  }
}

}  // namespace

DDPMemoryEstimate estimate_ddp_memory(const torch::nn::Module& module, const DDPOptions& options) {
  DDPMemoryEstimate est;
  for (const auto& p : unique_named(module.named_parameters(/*recurse=*/true))) {
    est.num_params += p.tensor.numel();
    est.param_bytes += static_cast<int64_t>(p.tensor.nbytes());
    if (!p.tensor.requires_grad()) continue;
    est.grad_bytes += static_cast<int64_t>(p.tensor.nbytes());
    if (!options.gradient_as_bucket_view) est.bucket_bytes += static_cast<int64_t>(p.tensor.nbytes());
    est.optimizer_bytes += 2 * 4 * p.tensor.numel();  // Adam: exp_avg + exp_avg_sq in fp32
  }
  return est;
}

struct DDPStrategy::Reducer : detail::Reducer {
  using detail::Reducer::Reducer;
};

DDPStrategy::DDPStrategy(DDPOptions options) : options_(std::move(options)) {
  TORCH_CHECK(options_.bucket_cap_mb > 0, "[ddp] bucket_cap_mb must be > 0, got ",
              options_.bucket_cap_mb);
  TORCH_CHECK(options_.model_averaging_period >= 0, "[ddp] model_averaging_period must be >= 0 "
              "(0: off), got ", options_.model_averaging_period);
  const bool post_local =
      dynamic_cast<PostLocalSGDState*>(options_.comm_state.get()) != nullptr;
  // Lightning's rules: post-local SGD needs a period; a period means post-local SGD (Lightning
  // ignores one without it; here it is an error rather than a silent no-op).
  TORCH_CHECK(!post_local || options_.model_averaging_period > 0, "[ddp] comm_state is a "
              "PostLocalSGDState but model_averaging_period is not set: post-local SGD averages "
              "the parameters every model_averaging_period steps (fsdp-train "
              "--model-averaging-period N)");
  TORCH_CHECK(options_.model_averaging_period == 0 || post_local, "[ddp] model_averaging_period=",
              options_.model_averaging_period, " needs comm_state to be a PostLocalSGDState "
              "(and comm_hook = post_local_sgd_hook): model averaging is the second half of "
              "post-local SGD");
}

DDPStrategy::~DDPStrategy() = default;

void DDPStrategy::setup_module(LightningModule& module) { setup(module); }

void DDPStrategy::setup(torch::nn::Module& module) {
  if (!world_) world_ = world_group();
  TORCH_CHECK(world_, "[ddp] no process group: call connect(world, launch) (the Trainer does) or "
                      "fsdp::init_process_group() before setting up the module");
  TORCH_CHECK(!reducer_, "[ddp] setup_module called twice; one DDPStrategy drives one module");

  // Host memory on the CPU, the device's on a GPU: Note [Model-state budget] in
  // src/memory/state_budget.cpp.
  const ModelStateBudget budget = model_state_budget(device(), launch_.local_world_size);
  if (budget.bytes > 0) {
    const DDPMemoryEstimate est = estimate_ddp_memory(module, options_);
    if (est.total_bytes() > budget.bytes) {
      std::ostringstream msg;
      msg << "[ddp] rank " << world_->rank() << ": DDP needs ~" << format_bytes(est.total_bytes())
          << " per rank for " << format_count(est.num_params) << " parameters (params "
          << format_bytes(est.param_bytes) << ", grads " << format_bytes(est.grad_bytes)
          << ", buckets " << format_bytes(est.bucket_bytes) << ", optimizer state "
          << format_bytes(est.optimizer_bytes) << ") but " << budget.what << " is "
          << format_bytes(budget.bytes)
          << " per rank; use strategy fsdp, which shards parameters, gradients and optimizer "
             "state over the ranks, "
          << budget.more;
      throw OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, msg.str());
    }
  }

  module_ = &module;
  const double cap_bytes = options_.bucket_cap_mb * 1024.0 * 1024.0;
  std::vector<detail::NamedTensor> params = unique_named(module.named_parameters(true));
  std::vector<at::Tensor> param_tensors;
  for (const auto& p : params) param_tensors.push_back(p.tensor);
  buffers_.clear();
  for (const auto& b : unique_named(module.named_buffers(true))) buffers_.push_back(b.tensor);
  broadcast_flat(*world_, param_tensors, cap_bytes);
  broadcast_flat(*world_, buffers_, cap_bytes);

  std::vector<detail::NamedTensor> trainable;
  for (auto& p : params) {
    if (p.tensor.requires_grad()) trainable.push_back(p);
  }
  // The comm hook: Lightning's _register_ddp_comm_hook order (wrapper around the hook).
  comm_state_ = options_.comm_state ? options_.comm_state : std::make_shared<CommHookState>();
  comm_state_->setup(world_, launch_);
  CommHook hook = options_.comm_hook ? options_.comm_hook : CommHook(allreduce_hook);
  if (options_.comm_wrapper) hook = options_.comm_wrapper(hook);
  TORCH_CHECK(hook, "[ddp] comm_wrapper returned an empty hook");
  if (options_.model_averaging_period > 0) {
    auto* post_local = dynamic_cast<PostLocalSGDState*>(comm_state_.get());
    TORCH_INTERNAL_ASSERT(post_local);
    averager_ = std::make_unique<PeriodicModelAverager>(
        options_.model_averaging_period, post_local->options().start_local_sgd_iter, world_);
  }
  reducer_ = std::make_unique<Reducer>(world_, std::move(trainable), options_, std::move(hook),
                                       comm_state_);
}

void DDPStrategy::optimizer_step(torch::optim::Optimizer& optimizer) {
  optimizer.step();
  if (!averager_) return;
  // Lightning's DDPStrategy.optimizer_step: the optimizer's parameters that have a gradient.
  std::vector<at::Tensor> params;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) params.push_back(p);
  }
  averager_->average_parameters(params);
}

int64_t DDPStrategy::comm_bytes() const {
  int64_t n = Strategy::comm_bytes();
  if (comm_state_) {
    for (const auto& g : comm_state_->other_groups()) n += total_bytes(g->counters());
  }
  return n;
}

void DDPStrategy::pre_forward(LightningModule& module, bool sync) { prepare_forward(sync); }

void DDPStrategy::prepare_forward(bool sync) {
  TORCH_CHECK(reducer_, "[ddp] pre_forward before setup_module");
  reducer_->prepare_forward(sync);
  if (sync && options_.broadcast_buffers && !buffers_.empty() && torch::GradMode::is_enabled()) {
    broadcast_flat(*world_, buffers_, options_.bucket_cap_mb * 1024.0 * 1024.0);
  }
}

void DDPStrategy::backward(const at::Tensor& loss) {
  TORCH_CHECK(reducer_, "[ddp] backward before setup_module");
  // See Note [DDP end of backward] in src/ddp/reducer.cpp. A loss that does not require grad
  // gets libtorch's own error from backward().
  if (loss.requires_grad()) reducer_->hook_loss(loss);
  loss.backward();
}

void DDPStrategy::post_backward(LightningModule& module, bool sync) { finish_backward(sync); }

void DDPStrategy::finish_backward(bool sync) {
  TORCH_CHECK(reducer_, "[ddp] post_backward before setup_module");
  reducer_->finish_backward(sync);
}

double DDPStrategy::clip_grad_norm(LightningModule& module, double max_norm) {
  return clip_grad_norm(max_norm);
}

double DDPStrategy::clip_grad_norm(double max_norm) {
  TORCH_CHECK(module_, "[ddp] clip_grad_norm before setup_module");
  // After the all-reduce every rank holds the same averaged gradients, so the local norm is
  // the global one: no communication. (Post-local SGD after its start leaves different
  // gradients per subgroup; each rank clips its own, as PyTorch/Lightning DDP does.)
  std::vector<at::Tensor> with_grad;
  for (const auto& p : module_->parameters(true)) {
    if (p.grad().defined()) with_grad.push_back(p);
  }
  if (with_grad.empty()) return 0.0;
  return torch::nn::utils::clip_grad_norm_(with_grad, max_norm);
}

void DDPStrategy::zero_grad(torch::optim::Optimizer& optimizer) {
  if (!options_.gradient_as_bucket_view) {
    optimizer.zero_grad();
    return;
  }
  // Zero in place: .grad stays aliased to the bucket buffers (an optimizer that sets gradients
  // to none would break the aliasing; the reducer repairs it, at the cost of a copy).
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
  }
}

void DDPStrategy::zero_grad() {
  TORCH_CHECK(reducer_, "[ddp] zero_grad before setup_module");
  reducer_->zero_grad();
}

std::vector<DDPStrategy::BucketInfo> DDPStrategy::buckets() const {
  return reducer_ ? reducer_->bucket_infos() : std::vector<BucketInfo>{};
}

std::vector<int> DDPStrategy::last_launch_order() const {
  return reducer_ ? reducer_->last_launch_order() : std::vector<int>{};
}

int64_t DDPStrategy::num_synced_backwards() const {
  return reducer_ ? reducer_->num_synced_backwards() : 0;
}

int64_t DDPStrategy::last_held_buckets() const {
  return reducer_ ? reducer_->last_held_buckets() : 0;
}

}  // namespace fsdp
