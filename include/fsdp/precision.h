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
// What each precision does (docs/precision.md):
//   "32-true"    fp32 everything (default; alias "32").
//   "bf16-mixed" FSDP: MixedPrecisionPolicy{bf16, bf16, bf16}: fp32 sharded master parameters
//                and optimizer state, bf16 all-gather / compute / reduce-scatter.
//                single / DDP: CPU autocast to bf16 around training_step, fp32 parameters.
//   "bf16-true"  the model is cast to bf16 after configure_model: parameters, gradients,
//                optimizer state and compute in bf16.
//   "16-mixed"   as bf16-mixed with fp16 (FSDP: MixedPrecisionPolicy{fp16, fp16, fp16}; other
//                strategies: CPU autocast to fp16), plus dynamic loss scaling: the Trainer
//                scales the loss by a ShardedGradScaler and skips the optimizer step on every
//                rank when any rank's unscaled gradients hold inf/nan (Lightning's 16-mixed).
//   "16-true"    the model is cast to fp16 after configure_model (no loss scaling, as
//                Lightning). Adam/AdamW need an eps that fp16 can hold (>= 6e-8; 1e-4 is
//                safe): the default 1e-8 rounds to 0 and a zero gradient becomes 0/0 = NaN,
//                which the Trainer refuses up front.
//   "64-true"    the model is cast to fp64 after configure_model (alias "64").
// fp16 on CPU needs libtorch 2.x (1.13 had no fp16 matmul), and is fast only where oneDNN has
// fp16 kernels (AVX512-FP16 / AMX-FP16); elsewhere it is correct but far slower than fp32 and
// bf16 (docs/precision.md; measured in docs/benchmarks/precision_cpu-2core_2026-11-22.md).
#pragma once

#include "fsdp/comm.h"

#include <ATen/ATen.h>
#include <c10/util/Optional.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
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
// Throws a one-sentence error when this libtorch cannot compute `precision` on CPU ("16-mixed"
// and "16-true" need fp16 matmul, probed once); does nothing otherwise.
void check_precision_supported(Precision precision);
// "16-mixed" / "16-true" on a CPU where libtorch has no fast fp16 matmul (its oneDNN fp16
// kernels need AVX512-FP16 or AMX-FP16; without them fp16 GEMM falls back to a scalar loop,
// measured ~100x slower than fp32 here): one line saying so, printed by the Trainer on global
// rank 0. nullopt otherwise.
std::optional<std::string> precision_performance_warning(Precision precision);
// Throws when CPU matmul in `dtype` is not implemented by the libtorch this runs on (probed
// once per dtype with a 2x2 matmul); `who` starts the message, e.g. "[precision] '16-mixed'".
void check_cpu_matmul_supported(at::ScalarType dtype, const std::string& who);
// bf16-mixed under FSDP: {bf16, bf16, bf16}.
MixedPrecisionPolicy bf16_mixed_policy();
// 16-mixed under FSDP: {fp16, fp16, fp16} (as Lightning's FSDPPrecision for "16-mixed").
MixedPrecisionPolicy fp16_mixed_policy();
// The FSDP policy of "bf16-mixed" / "16-mixed"; nullopt for the others.
std::optional<MixedPrecisionPolicy> mixed_precision_policy(Precision precision);
// The CPU autocast dtype of "bf16-mixed" / "16-mixed" outside FSDP; nullopt for the others.
std::optional<at::ScalarType> autocast_dtype(Precision precision);
// Whether the Trainer scales the loss (a ShardedGradScaler over the world): "16-mixed" only.
bool uses_grad_scaler(Precision precision);

// RAII: autocast of `device_type` (CPU or CUDA) to `dtype` while alive, as Lightning's
// MixedPrecision plugin does for "bf16-mixed" / "16-mixed" (matmul-like ops run in bf16/fp16,
// parameters stay fp32). nullopt does nothing. Nests; the cast cache is cleared when the
// outermost guard ends.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, std::optional<at::ScalarType> dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_type_;
  bool enabled_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// CPU autocast (AutocastGuard on the CPU).
class CpuAutocastGuard : public AutocastGuard {
 public:
  explicit CpuAutocastGuard(std::optional<at::ScalarType> dtype)
      : AutocastGuard(c10::DeviceType::CPU, dtype) {}
};

// RAII: torch's default dtype while alive, so modules built in configure_model create their
// parameters in it ("bf16-true", "16-true", "64-true"; Lightning's init context does the same).
class DefaultDtypeGuard {
 public:
  explicit DefaultDtypeGuard(std::optional<at::ScalarType> dtype);
  ~DefaultDtypeGuard();
  DefaultDtypeGuard(const DefaultDtypeGuard&) = delete;
  DefaultDtypeGuard& operator=(const DefaultDtypeGuard&) = delete;

 private:
  std::optional<caffe2::TypeMeta> prev_;
};

// The dtype "bf16-true" / "16-true" / "64-true" train in; nullopt for the others.
std::optional<at::ScalarType> true_precision_dtype(Precision precision);
// "16-true": throws when an Adam/AdamW parameter group's eps rounds to 0 in fp16 (the default
// 1e-8 does): the first exactly-zero gradient would turn its parameter into 0/0 = NaN. The
// Trainer calls it after configure_optimizers; does nothing for other precisions.
void check_optimizer_precision(const torch::optim::Optimizer& optimizer, Precision precision);

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
  // Same, with the step itself done by `step_fn` (the Trainer passes its strategy's
  // optimizer_step). Returns whether it ran.
  bool step(torch::optim::Optimizer& optimizer, const std::function<void()>& step_fn);
  // Backoff after a skipped step; growth after growth_interval clean steps in a row.
  void update();
  // Checkpoint state (Lightning keeps the scaler's state_dict in the checkpoint): a JSON object
  // {"scale", "growth_tracker", "skipped_steps"} as text, and back.
  std::string state_dict() const;
  void load_state_dict(const std::string& state);

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
