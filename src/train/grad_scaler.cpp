// ShardedGradScaler: dynamic loss scaling over sharded gradients. See fsdp/precision.h.
#include "fsdp/precision.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace fsdp {

ShardedGradScaler::ShardedGradScaler(ProcessGroupPtr group, GradScalerOptions options)
    : group_(std::move(group)), options_(options), scale_(options.init_scale) {
  TORCH_CHECK(options_.init_scale > 0 && std::isfinite(options_.init_scale),
              "[ShardedGradScaler] init_scale must be a positive finite number, got ",
              options_.init_scale);
  TORCH_CHECK(options_.growth_factor > 1.0, "[ShardedGradScaler] growth_factor must be > 1, got ",
              options_.growth_factor);
  TORCH_CHECK(options_.backoff_factor > 0.0 && options_.backoff_factor < 1.0,
              "[ShardedGradScaler] backoff_factor must be in (0, 1), got ",
              options_.backoff_factor);
  TORCH_CHECK(options_.growth_interval >= 1,
              "[ShardedGradScaler] growth_interval must be >= 1, got ", options_.growth_interval);
}

void ShardedGradScaler::unscale(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(!unscaled_, "[ShardedGradScaler] unscale called twice in one step; call update() "
              "after every step");
  at::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  // 1.0 when any local gradient element is inf or nan. Computed in fp32 whatever the grads'
  // dtype, so a bf16/fp16 overflow is seen.
  bool local_found = false;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      at::Tensor g = p.mutable_grad();
      if (!at::isfinite(g).all().item<bool>()) local_found = true;
      g.mul_(inv);
    }
  }
  // On the group's device (a CUDA device for NCCL).
  const c10::Device device = group_ ? group_->device() : c10::Device(c10::kCPU);
  at::Tensor found =
      at::full({1}, local_found ? 1.0 : 0.0, at::TensorOptions(at::kFloat).device(device));
  // Every rank holds different shards: agree on one answer, so all skip (or step) together.
  if (group_ && group_->size() > 1) group_->all_reduce(found, ReduceOp::kMax);
  found_inf_ = found.item<float>() > 0;
  unscaled_ = true;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  return step(optimizer, [&] { optimizer.step(); });
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer,
                             const std::function<void()>& step_fn) {
  if (!unscaled_) unscale(optimizer);
  if (found_inf_) {
    ++skipped_steps_;
    return false;
  }
  step_fn();
  return true;
}

void ShardedGradScaler::update() {
  TORCH_CHECK(unscaled_, "[ShardedGradScaler] update() without unscale()/step() in this step");
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ >= options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

std::string ShardedGradScaler::state_dict() const {
  return nlohmann::json{{"scale", scale_},
                        {"growth_tracker", growth_tracker_},
                        {"skipped_steps", skipped_steps_}}
      .dump();
}

void ShardedGradScaler::load_state_dict(const std::string& state) {
  const nlohmann::json j = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object() && j.contains("scale") && j["scale"].is_number() &&
                  j.contains("growth_tracker") && j["growth_tracker"].is_number_integer(),
              "[ShardedGradScaler] load_state_dict needs a JSON object with a numeric 'scale' "
              "and an integer 'growth_tracker' (as state_dict() writes), got: ", state);
  const double scale = j["scale"].get<double>();
  TORCH_CHECK(scale > 0 && std::isfinite(scale), "[ShardedGradScaler] load_state_dict: scale ",
              "must be a positive finite number, got ", scale);
  scale_ = scale;
  growth_tracker_ = j["growth_tracker"].get<int64_t>();
  skipped_steps_ = j.value("skipped_steps", int64_t{0});
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace fsdp
