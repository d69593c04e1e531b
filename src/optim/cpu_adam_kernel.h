// The fused Adam/AdamW element kernel behind fsdp::optim::CPUAdam (include/fsdp/cpu_adam.h).
// src/optim/kernels/cpu_adam_kernel.cpp is compiled once per instruction set (DEFAULT, AVX2,
// AVX512: CMakeLists.txt, fsdp_cpu_adam_kernels) into the namespace of that name;
// cpu_adam.cpp picks one at run time with ATen's own choice (at::get_cpu_capability(),
// which honours ATEN_CPU_CAPABILITY). See Note [CPU Adam] in docs/design.md.
//
// This header is included by the per-ISA translation units: it must stay free of libtorch
// headers beyond c10's ScalarType, so nothing inline is compiled with AVX512 flags and then
// picked by the linker for the generic code.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace fsdp::detail::cpu_adam {

// The step's scalars, in float as libtorch's kernels use them (computed in double first).
struct Scalars {
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float bias_correction2_sqrt = 1.f;  // sqrt(1 - beta2^step), 1 without bias correction
  float neg_step_size = -1e-3f;       // -lr / (1 - beta1^step)
  float eps = 1e-8f;
  float l2 = 0.f;                     // Adam: grad += l2 * param (0: off)
  float decay = 1.f;                  // AdamW: param *= decay = 1 - lr * weight_decay (1: off)
  bool amsgrad = false;
};

// One parameter's contiguous buffers. param and grad have `dtype` (Float, BFloat16, Half); the
// moments are float.
struct Span {
  void* param = nullptr;
  const void* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // amsgrad only
  int64_t numel = 0;
  c10::ScalarType dtype = c10::ScalarType::Float;
  Scalars s;
};

// Updates elements [begin, end) of `span`, one pass, in place.
using RangeFn = void (*)(const Span& span, int64_t begin, int64_t end);

namespace DEFAULT {
void adam_range(const Span& span, int64_t begin, int64_t end);
int vector_width();  // floats per Vectorized<float>
}  // namespace DEFAULT
namespace AVX2 {
void adam_range(const Span& span, int64_t begin, int64_t end);
int vector_width();
}  // namespace AVX2
namespace AVX512 {
void adam_range(const Span& span, int64_t begin, int64_t end);
int vector_width();
}  // namespace AVX512

}  // namespace fsdp::detail::cpu_adam
