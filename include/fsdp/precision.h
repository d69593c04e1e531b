// Precision: the names the Trainer and fsdp-train accept, FSDP's mixed-precision policy, and a
// sharded gradient scaler for fp16 loss scaling.
//
//   fsdp::Trainer trainer({.devices = 2, .strategy = "fsdp", .precision = "bf16-mixed"});
//
//   // or an explicit policy on the strategy (it wins over the Trainer's precision):
//   fsdp::FSDPOptions o;
//   o.mixed_precision = fsdp::MixedPrecisionPolicy{.param_dtype = at::kBFloat16,
//                                                  .reduce_dtype = at::kFloat};
//
// What each precision does (README "Precision"):
//   "32-true"    fp32 everything (default; alias "32").
//   "bf16-mixed" FSDP: MixedPrecisionPolicy{bf16, bf16, bf16}: fp32 sharded master parameters
//                and optimizer state, bf16 all-gather / compute / reduce-scatter.
//                single / DDP: CPU autocast to bf16 around training_step, fp32 parameters.
//   "bf16-true"  the model is cast to bf16 after configure_model: parameters, gradients,
//                optimizer state and compute in bf16.
//   "16-mixed", "16-true"  refused: CPU libtorch 1.13 has no fp16 matmul.
//   "64-true"    the model is cast to fp64 after configure_model (alias "64").
#pragma once

#include "fsdp/comm.h"

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

// FSDP mixed precision (FSDP2's MixedPrecisionPolicy). Unset fields keep the parameters' own
// dtype (fp32). The sharded parameters the optimizer sees always keep their original dtype
// (fp32 master shards), so optimizer state stays fp32.
struct MixedPrecisionPolicy {
  // Dtype of the all-gather input/output and of the unsharded parameters that compute;
  // floating forward inputs of every unit are cast to it.
  std::optional<at::ScalarType> param_dtype;
  // Dtype of the reduce-scatter (and replicate all-reduce); unset = param_dtype. The reduced
  // gradient is accumulated into the fp32 sharded gradient.
  std::optional<at::ScalarType> reduce_dtype;
  // Floating module buffers are cast to this dtype at setup; unset = keep.
  std::optional<at::ScalarType> buffer_dtype;

  // Dtype the reduce-scatter runs in, for parameters whose own dtype is `fallback`.
  at::ScalarType reduce_dtype_or(at::ScalarType fallback) const {
    return reduce_dtype.value_or(param_dtype.value_or(fallback));
  }
  std::string to_string() const;  // "{param=BFloat16, reduce=BFloat16, buffer=unset}"
};

enum class Precision { k32True, kBf16Mixed, kBf16True, k16Mixed, k16True, k64True };

// The one parser of precision names: "32-true" ("32"), "bf16-mixed", "bf16-true", "16-mixed",
// "16-true", "64-true" ("64"). An unknown name is an error listing the valid ones.
Precision parse_precision(const std::string& name);
const char* to_string(Precision precision);
std::vector<std::string> precision_names();  // every accepted spelling, aliases included
// Throws the one-sentence fp16 error for "16-mixed"/"16-true"; does nothing for the others.
void check_precision_supported(Precision precision);
// bf16-mixed under FSDP: {bf16, bf16, bf16}.
MixedPrecisionPolicy bf16_mixed_policy();

// RAII: CPU autocast to `dtype` while alive, as Lightning's MixedPrecision plugin does for
// "bf16-mixed" on CPU (matmul-like ops run in bf16, parameters stay fp32). enabled=false does
// nothing. Nests; the cast cache is cleared when the outermost guard ends.
class CpuAutocastGuard {
 public:
  explicit CpuAutocastGuard(bool enabled, at::ScalarType dtype = at::kBFloat16);
  ~CpuAutocastGuard();
  CpuAutocastGuard(const CpuAutocastGuard&) = delete;
  CpuAutocastGuard& operator=(const CpuAutocastGuard&) = delete;

 private:
  bool enabled_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// RAII: torch's default dtype while alive, so modules built in configure_model create their
// parameters in it ("bf16-true", "64-true"; Lightning's init context does the same).
class DefaultDtypeGuard {
 public:
  explicit DefaultDtypeGuard(std::optional<at::ScalarType> dtype);
  ~DefaultDtypeGuard();
  DefaultDtypeGuard(const DefaultDtypeGuard&) = delete;
  DefaultDtypeGuard& operator=(const DefaultDtypeGuard&) = delete;

 private:
  std::optional<caffe2::TypeMeta> prev_;
};

// The dtype "bf16-true" / "64-true" train in; nullopt for the others.
std::optional<at::ScalarType> true_precision_dtype(Precision precision);

// Loss scaling for fp16 training over sharded gradients (Lightning's ShardedGradScaler).
//
//   fsdp::ShardedGradScaler scaler(world);
//   strategy.backward(scaler.scale(loss));
//   if (scaler.step(optimizer)) { ... }   // unscales; skips the step when a grad is inf/nan
//   scaler.update();
//
// Every rank holds only its shards, so "found inf" is all-reduced (MAX) over `group`: when one
// rank sees an inf, every rank skips the step and backs the scale off together.
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;  // clean steps in a row before the scale grows
};

class ShardedGradScaler {
 public:
  // group may be null (one rank).
  explicit ShardedGradScaler(ProcessGroupPtr group = nullptr, GradScalerOptions options = {});

  at::Tensor scale(const at::Tensor& loss) const { return loss * scale_; }
  // Divides every gradient of `optimizer` by the scale (once per step) and records whether any
  // is inf/nan on any rank of the group (a collective: every rank calls it).
  void unscale(torch::optim::Optimizer& optimizer);
  // unscale (if not yet done) and optimizer.step() unless inf/nan was found. Returns whether
  // the step ran.
  bool step(torch::optim::Optimizer& optimizer);
  // Backoff after a skipped step; growth after growth_interval clean steps in a row.
  void update();

  double get_scale() const { return scale_; }
  bool found_inf() const { return found_inf_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  int64_t skipped_steps() const { return skipped_steps_; }

 private:
  ProcessGroupPtr group_;
  GradScalerOptions options_;
  double scale_;
  bool unscaled_ = false;
  bool found_inf_ = false;
  int64_t growth_tracker_ = 0;
  int64_t skipped_steps_ = 0;
};

}  // namespace fsdp
