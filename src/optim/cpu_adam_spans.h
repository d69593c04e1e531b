// The CPU Adam step over raw spans, for callers that hold the moments themselves (the disk
// tier streams them through swap buffers: src/offload/nvme_adam.cpp). CPUAdam::step is built
// on the same two calls. See Note [CPU Adam] in docs/design.md.
#pragma once

#include "optim/cpu_adam_kernel.h"

#include <cstdint>
#include <vector>

namespace fsdp::detail::cpu_adam {

// One group's hyper-parameters and the optimizer's mode.
struct Hyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool amsgrad = false;
  bool adamw_mode = true;
  bool bias_correction = true;
};

// The kernel's scalars for `step` (1-based) exactly as libtorch's Adam/AdamW computes them.
Scalars make_scalars(const Hyper& h, int64_t step);

// Every span's elements as one range split over at::get_num_threads() threads, at the widest
// instruction set ATen picked.
void run_spans(const std::vector<Span>& spans);

}  // namespace fsdp::detail::cpu_adam
