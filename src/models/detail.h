// Helpers shared by the demo models (private to src/models).
#pragma once

#include <ATen/ATen.h>

namespace fsdp::demos::detail {

// Dropout that costs nothing when it is off (p == 0 or eval mode).
inline at::Tensor dropout(const at::Tensor& x, double p, bool training) {
  return (p > 0.0 && training) ? at::dropout(x, p, /*train=*/true) : x;
}

// inputs[i] when present, else an undefined tensor ("no argument").
inline at::Tensor arg(const std::vector<at::Tensor>& inputs, size_t i) {
  return i < inputs.size() ? inputs[i] : at::Tensor();
}

}  // namespace fsdp::demos::detail
