// WarmupLR / WarmupDecayLR. See warmup_lr.h.
#include "zero/warmup_lr.h"

#include <algorithm>
#include <cmath>

namespace fsdp::detail {

WarmupLR::WarmupLR(torch::optim::Optimizer& optimizer, double min_lr, double max_lr,
                   int64_t warmup_steps, const std::string& warmup_type, int64_t total_num_steps)
    : torch::optim::LRScheduler(optimizer),
      optimizer_(optimizer),
      min_lr_(min_lr),
      max_lr_(max_lr),
      warmup_steps_(std::max<int64_t>(2, warmup_steps)),
      log_(warmup_type != "linear"),
      total_(total_num_steps) {
  for (auto& group : optimizer_.param_groups()) group.options().set_lr(lr_at(0));
}

double WarmupLR::lr_at(int64_t t) const {
  double gamma = 1.0;
  if (t < warmup_steps_) {
    gamma = log_ ? std::log(static_cast<double>(t + 1)) / std::log(static_cast<double>(warmup_steps_))
                 : static_cast<double>(t) / static_cast<double>(warmup_steps_);
  } else if (total_ > 0) {
    gamma = std::max(0.0, static_cast<double>(total_ - t) /
                              std::max(1.0, static_cast<double>(total_ - warmup_steps_)));
  }
  return min_lr_ + (max_lr_ - min_lr_) * gamma;
}

std::vector<double> WarmupLR::get_lrs() {
  // step() calls this before counting the step: the iteration after it is step_count_ + 1.
  return std::vector<double>(optimizer_.param_groups().size(),
                             lr_at(static_cast<int64_t>(step_count_) + 1));
}

}  // namespace fsdp::detail
