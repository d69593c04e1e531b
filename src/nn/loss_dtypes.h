// The dtypes the vocabulary losses compute in, shared by fsdp::linear_cross_entropy
// (linear_cross_entropy.cpp) and its vocabulary-parallel form (vocab_parallel.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include <cstdint>

namespace fsdp::detail {

// fp32 for 16-bit tensors (logits, losses and gradients are formed in fp32), else their own dtype.
inline at::ScalarType accumulate_dtype(const at::Tensor& t) {
  return t.element_size() < 4 ? at::kFloat : t.scalar_type();
}

// The autocast dtype in force now for `t`'s device type (CPU or CUDA autocast), as an int64
// for an autograd context's saved_data (Undefined: autocast is off). Backward, which the engine
// does not necessarily run under autocast, recomputes logits in the dtype forward used.
inline int64_t autocast_dtype_code(const at::Tensor& t) {
  const c10::DeviceType type = t.device().type();
  return static_cast<int64_t>(at::autocast::is_autocast_enabled(type)
                                  ? at::autocast::get_autocast_dtype(type)
                                  : at::ScalarType::Undefined);
}

}  // namespace fsdp::detail
