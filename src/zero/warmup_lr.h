// DeepSpeed's WarmupLR and WarmupDecayLR schedulers (deepspeed/runtime/lr_schedules.py), for
// the "scheduler" block of a DeepSpeed JSON config. Stepped once per optimizer step.
//
//   iteration t (0 at construction, +1 per step()):
//     gamma(t) = log(t + 1) / log(W)   (warmup_type "log")   for t < W = max(2, warmup_num_steps)
//              = t / W                 (warmup_type "linear")
//              = 1                     (WarmupLR, t >= W)
//              = max(0, (T - t) / max(1, T - W))  (WarmupDecayLR, t >= W; T = total_num_steps)
//     lr(t) = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma(t), every param group.
// As DeepSpeed's, the constructor already sets lr(0) (its last_batch_iteration -1 + step()).
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

class WarmupLR : public torch::optim::LRScheduler {
 public:
  // total_num_steps > 0: WarmupDecayLR; 0: WarmupLR.
  WarmupLR(torch::optim::Optimizer& optimizer, double min_lr, double max_lr, int64_t warmup_steps,
           const std::string& warmup_type, int64_t total_num_steps = 0);
  double lr_at(int64_t iteration) const;

 private:
  std::vector<double> get_lrs() override;
  torch::optim::Optimizer& optimizer_;
  double min_lr_, max_lr_;
  int64_t warmup_steps_;
  bool log_;
  int64_t total_;
};

}  // namespace fsdp::detail
