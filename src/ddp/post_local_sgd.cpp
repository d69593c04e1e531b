// Post-local SGD: PostLocalSGDState, post_local_sgd_hook, average_parameters and
// PeriodicModelAverager, PyTorch's ddp_comm_hooks/post_localSGD_hook.py and
// model_averaging/{averagers,utils}.py in C++.
#include "fsdp/comm_hooks.h"

#include "ddp/hook_util.h"
#include "fsdp/launcher.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

namespace fsdp {

PostLocalSGDState::PostLocalSGDState(PostLocalSGDOptions options, ProcessGroupPtr process_group)
    : CommHookState(std::move(process_group)), options_(std::move(options)) {
  TORCH_CHECK(options_.start_local_sgd_iter >= 0, "[PostLocalSGDState] start_local_sgd_iter "
              "must be set (>= 0; got ", options_.start_local_sgd_iter, "): the number of "
              "iterations with global gradient all-reduce before local SGD starts");
  TORCH_CHECK(options_.subgroup_size >= 0, "[PostLocalSGDState] subgroup_size must be >= 0 "
              "(0: the ranks of one node), got ", options_.subgroup_size);
  subgroup_ = options_.subgroup;
}

void PostLocalSGDState::setup(const ProcessGroupPtr& world, const LaunchInfo& launch) {
  CommHookState::setup(world, launch);
  if (subgroup_) return;
  // dist.new_subgroups(group_size): consecutive ranks of the process group, every rank creating
  // every subgroup in the same order (new_subgroup is collective), keeping its own.
  const int n = process_group->size();
  int size = options_.subgroup_size > 0 ? options_.subgroup_size : launch.local_world_size;
  if (size <= 0 || size > n) size = n;
  TORCH_CHECK(n % size == 0, "[PostLocalSGDState] the process group's ", n, " ranks do not "
              "split into subgroups of ", size, "; set PostLocalSGDOptions::subgroup_size "
              "(fsdp-train --post-local-sgd-subgroup-size) to a divisor of ", n);
  const auto& ranks = process_group->world_ranks();
  for (int g = 0; g < n / size; ++g) {
    std::vector<int> members(ranks.begin() + g * size, ranks.begin() + (g + 1) * size);
    if (auto sub = process_group->new_subgroup(members)) subgroup_ = sub;
  }
  TORCH_INTERNAL_ASSERT(subgroup_, "this rank is in none of the post-local SGD subgroups");
}

std::vector<ProcessGroupPtr> PostLocalSGDState::other_groups() const {
  if (!subgroup_ || subgroup_ == process_group) return {};
  return {subgroup_};
}

void PostLocalSGDState::maybe_increase_iter(bool bucket_is_last) {
  if (bucket_is_last) ++iter_;
}

CommHookStateDict PostLocalSGDState::state_dict() const {
  CommHookStateDict d;
  d.values["iter"] = std::to_string(iter_);
  return d;
}

void PostLocalSGDState::load_state_dict(const CommHookStateDict& d, bool /*same_world*/) {
  auto it = d.values.find("iter");
  TORCH_CHECK(it != d.values.end(), "[PostLocalSGDState::load_state_dict] saved state lacks "
              "'iter'");
  iter_ = std::stoll(it->second);
}

CommFuture post_local_sgd_hook(CommHookState& s, GradBucket& bucket) {
  constexpr const char* kHook = "post_local_sgd_hook";
  PostLocalSGDState& state = detail::state_as<PostLocalSGDState>(s, kHook, "PostLocalSGDState");
  ProcessGroup& global = detail::hook_group(state, kHook);
  at::Tensor input = bucket.buffer();
  if (state.iter() < state.options().start_local_sgd_iter) {
    state.maybe_increase_iter(bucket.is_last());
    return detail::allreduce_average(global, input);
  }
  if (!state.options().post_local_gradient_allreduce) return CommFuture::ready(input);
  TORCH_CHECK(state.subgroup(), "[", kHook, "] no subgroup: DDP creates it at setup (for a hook "
              "called by hand, call state.setup(world, launch_info) first)");
  return detail::allreduce_average(*state.subgroup(), input);
}

void average_parameters(const std::vector<at::Tensor>& params, ProcessGroup& group) {
  if (params.empty()) return;
  std::vector<at::Tensor> flat_parts;
  flat_parts.reserve(params.size());
  for (const auto& p : params) flat_parts.push_back(p.detach().reshape({-1}));
  at::Tensor flat = at::cat(flat_parts);
  flat.div_(group.size());
  group.all_reduce(flat, ReduceOp::kSum);
  // PyTorch rebinds p.data to views of the flat buffer; copying in place gives the same values
  // and keeps the parameters' storage (optimizers and DDP's hooks hold on to it).
  at::NoGradGuard no_grad;
  int64_t offset = 0;
  for (const auto& p : params) {
    at::Tensor data = p.detach();
    data.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
}

PeriodicModelAverager::PeriodicModelAverager(int64_t period, int64_t warmup_steps,
                                             ProcessGroupPtr group)
    : period_(period), warmup_steps_(warmup_steps), group_(std::move(group)) {
  TORCH_CHECK(warmup_steps_ >= 0, "[PeriodicModelAverager] warmup_steps must be >= 0, got ",
              warmup_steps_);
  TORCH_CHECK(period_ >= 1, "[PeriodicModelAverager] period must be >= 1, got ", period_);
  TORCH_CHECK(group_, "[PeriodicModelAverager] needs a process group");
}

bool PeriodicModelAverager::average_parameters(const std::vector<at::Tensor>& params) {
  bool averaged = false;
  if (step_ >= warmup_steps_ && (step_ - warmup_steps_) % period_ == 0) {
    // PyTorch's get_params_to_average: only parameters with a gradient.
    std::vector<at::Tensor> with_grad;
    for (const auto& p : params) {
      if (p.grad().defined()) with_grad.push_back(p);
    }
    fsdp::average_parameters(with_grad, *group_);
    averaged = true;
  }
  ++step_;
  return averaged;
}

}  // namespace fsdp
