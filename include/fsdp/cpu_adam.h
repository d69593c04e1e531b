// fsdp::optim::CPUAdam: a fast Adam / AdamW for parameters in host memory (the role of
// DeepSpeed's DeepSpeedCPUAdam), usable by every strategy because it is a plain
// torch::optim::Optimizer:
//
//   auto opt = std::make_shared<fsdp::optim::CPUAdam>(
//       parameters(), fsdp::optim::CPUAdamOptions{.lr = 3e-4, .weight_decay = 0.01});
//   // fsdp-train --optimizer cpu_adamw   (or cpu_adam for Adam's L2 weight decay)
//
// One step makes one fused pass over every element of parameter, gradient, exp_avg and
// exp_avg_sq (4 reads, 3 writes), vectorized with ATen's at::vec::Vectorized at the widest ISA
// the CPU has (AVX512 / AVX2 / scalar, chosen like ATen's own kernels) and split over
// at::get_num_threads() threads with at::parallel_for. libtorch's Adam runs ~8 separate
// tensor ops per parameter instead. See Note [CPU Adam] in docs/design.md.
//
// Math: exactly torch::optim::Adam (adamw_mode = false: weight decay is L2, added to the
// gradient) or torch::optim::AdamW (adamw_mode = true, the default as in DeepSpeed: decoupled,
// p *= 1 - lr * weight_decay), with bias correction and amsgrad; results agree with libtorch's
// to fp32 rounding (tests/test_cpu_adam.cpp).
//
// Dtypes: float32, bfloat16 and float16 parameters (gradients of the same dtype); the state is
// always float32. A 16-bit parameter is read, updated in fp32 and rounded back once per step
// (round to nearest even) - there is no fp32 master copy; keep fp32 parameters (FSDP's
// mixed precision does) when that rounding matters.
//
// State and checkpoints: per-parameter state is torch::optim::AdamWParamState (adamw_mode) or
// AdamParamState, and the parameter groups hold AdamWOptions / AdamOptions, so fsdp's
// checkpoints (saved as "adamw" / "adam") and torch::save / torch::load archives are
// interchangeable with torch::optim::AdamW / Adam at any world size.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

namespace fsdp::optim {

// The defaults are DeepSpeedCPUAdam's (note weight_decay 0, where torch's AdamW has 1e-2).
struct CPUAdamOptions {
  double lr = 1e-3;
  std::tuple<double, double> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  // true: AdamW (decoupled weight decay); false: Adam (L2 weight decay in the gradient).
  bool adamw_mode = true;
  // false: no bias correction (lr used as is, sqrt(exp_avg_sq) not rescaled), as DeepSpeed's
  // bias_correction=False. libtorch's Adam always corrects.
  bool bias_correction = true;
};

class CPUAdam : public torch::optim::Optimizer {
 public:
  // Every parameter in one group with `options`.
  explicit CPUAdam(std::vector<at::Tensor> params, CPUAdamOptions options = {});
  // Groups may carry their own options: torch::optim::AdamWOptions when adamw_mode,
  // AdamOptions otherwise (a group without options takes `options`).
  explicit CPUAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                   CPUAdamOptions options = {});

  // One fused, vectorized, multi-threaded update of every parameter with a gradient.
  at::Tensor step(LossClosure closure = nullptr) override;

  // torch::save / torch::load in torch::optim::AdamW's (adamw_mode) or Adam's layout.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  bool adamw_mode() const { return adamw_mode_; }
  bool bias_correction() const { return bias_correction_; }
  // The instruction set the kernels run with: "avx512", "avx2" or "default" (scalar).
  static const char* isa();

 private:
  bool adamw_mode_;
  bool bias_correction_;
};

}  // namespace fsdp::optim
