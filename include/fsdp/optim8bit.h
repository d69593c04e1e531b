// 8-bit AdamW (bitsandbytes AdamW8bit / PagedAdamW8bit, optim="adamw_8bit" / "paged_adamw_8bit"
// in transformers' TrainingArguments):
//
//   auto opt = std::make_shared<fsdp::AdamW8bit>(trainable, fsdp::AdamW8bitOptions(2.5e-5));
//
// Each parameter's two Adam moments are stored in 8 bits, block-wise: blocks of 256 elements,
// each with an fp32 absmax, the first moment on the signed dynamic code book and the second on
// the unsigned one (bitsandbytes create_dynamic_map). A step dequantizes both, applies AdamW
// in fp32 (decoupled weight decay p *= 1 - lr*wd, bias corrections as bitsandbytes), updates
// the parameter and quantizes the moments again. State: 2 bytes + 8/256 bytes per element
// instead of 8. Parameters with fewer than min_8bit_size (4096) elements keep fp32 moments
// (bitsandbytes' 32-bit update for them). The arithmetic is bitsandbytes 0.50.2's CPU kernel,
// op for op (tested against bitsandbytes.optim.AdamW8bit).
//
// "Paged" optimizers (paged_adamw_8bit) put the states in CUDA unified memory so the driver can
// evict them to host RAM under GPU memory pressure. On CPU the states already live in host RAM:
// bitsandbytes itself falls back to ordinary buffers there, and so do we -- `paged` is accepted
// and changes nothing.
//
// Under FSDP the optimizer steps this rank's shard of each parameter: blocks (and min_8bit_size)
// apply to the shard, so per-block absmaxes differ from a single-process run by where blocks
// begin; the update agrees to within the 8-bit quantization error.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace fsdp {

struct AdamW8bitOptions : public torch::optim::OptimizerCloneableOptions<AdamW8bitOptions> {
  AdamW8bitOptions(double lr = 1e-3) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta1) = 0.9;
  TORCH_ARG(double, beta2) = 0.999;
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;  // bitsandbytes' default
  TORCH_ARG(int64_t, min_8bit_size) = 4096;
  TORCH_ARG(bool, paged) = false;          // accepted, no effect on CPU (see above)

  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct AdamW8bitState : public torch::optim::OptimizerCloneableParamState<AdamW8bitState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, state1);   // uint8 (8-bit) or fp32 (small parameters), param's shape
  TORCH_ARG(at::Tensor, state2);
  TORCH_ARG(at::Tensor, absmax1);  // fp32 (blocks), 8-bit only
  TORCH_ARG(at::Tensor, absmax2);
};

class AdamW8bit : public torch::optim::Optimizer {
 public:
  explicit AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     AdamW8bitOptions defaults = {});
  explicit AdamW8bit(std::vector<at::Tensor> params, AdamW8bitOptions defaults = {});
  at::Tensor step(LossClosure closure = nullptr) override;
  // Bytes of optimizer state held now (for memory reports).
  int64_t state_nbytes() const;

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

}  // namespace fsdp
