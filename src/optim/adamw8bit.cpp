// 8-bit AdamW. See include/fsdp/optim8bit.h.
#include "fsdp/optim8bit.h"

#include "fsdp/quantization.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace fsdp {
namespace {

constexpr int64_t kBlocksize = 256;

}  // namespace

AdamW8bit::AdamW8bit(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                     AdamW8bitOptions defaults)
    : Optimizer(groups, std::make_unique<AdamW8bitOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0 && defaults.eps() >= 0 && defaults.weight_decay() >= 0 &&
                  defaults.beta1() >= 0 && defaults.beta1() < 1 && defaults.beta2() >= 0 &&
                  defaults.beta2() < 1,
              "[AdamW8bit] invalid options: lr ", defaults.lr(), ", betas (", defaults.beta1(), ", ",
              defaults.beta2(), "), eps ", defaults.eps(), ", weight_decay ", defaults.weight_decay());
}

AdamW8bit::AdamW8bit(std::vector<at::Tensor> params, AdamW8bitOptions defaults)
    : AdamW8bit(std::vector<torch::optim::OptimizerParamGroup>{
                    torch::optim::OptimizerParamGroup(std::move(params))},
                defaults) {}

at::Tensor AdamW8bit::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable(true);
    loss = closure();
  }
  const at::Tensor& qmap1 = quant::dynamic_map(true);
  const at::Tensor& qmap2 = quant::dynamic_map(false);
  for (auto& group : param_groups()) {
    const auto& o = static_cast<const AdamW8bitOptions&>(group.options());
    const double lr = o.lr(), beta1 = o.beta1(), beta2 = o.beta2(), eps = o.eps(), wd = o.weight_decay();
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(p.is_floating_point(), "[AdamW8bit] parameter of dtype ", p.scalar_type(),
                  " has a gradient; only floating parameters can be optimized");
      auto& slot = state()[p.unsafeGetTensorImpl()];
      const bool eight_bit = p.numel() >= o.min_8bit_size();
      if (!slot) {
        auto s = std::make_unique<AdamW8bitState>();
        if (eight_bit) {
          const int64_t blocks = (p.numel() + kBlocksize - 1) / kBlocksize;
          s->state1(at::zeros(p.sizes(), at::kByte));
          s->state2(at::zeros(p.sizes(), at::kByte));
          s->absmax1(at::zeros({blocks}, at::kFloat));
          s->absmax2(at::zeros({blocks}, at::kFloat));
        } else {
          s->state1(at::zeros(p.sizes(), at::kFloat));
          s->state2(at::zeros(p.sizes(), at::kFloat));
        }
        slot = std::move(s);
      }
      auto& s = static_cast<AdamW8bitState&>(*slot);
      s.step(s.step() + 1);
      const double step = static_cast<double>(s.step());
      const double correction1 = 1.0 - std::pow(beta1, step);
      const double correction2 = std::sqrt(1.0 - std::pow(beta2, step));
      at::Tensor grad = p.grad().to(at::kFloat) * 1.0;  // g.float() * gnorm_scale
      at::Tensor pf = p.detach().to(at::kFloat);       // the parameter itself when fp32
      if (!eight_bit) {
        // bitsandbytes _optimizer_update_32bit_cpu ("adam").
        at::Tensor m = s.state1(), v = s.state2();
        m.mul_(beta1).add_(grad, 1.0 - beta1);
        v.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        const double step_size = -lr * correction2 / correction1;
        if (wd > 0.0) pf.mul_(1.0 - lr * wd);
        at::Tensor update = m / (v.sqrt() + eps * correction2);
        pf.add_(update, step_size);
      } else {
        // bitsandbytes _optimizer_update_8bit_blockwise_cpu ("adam"): dequantize, update in fp32,
        // quantize again.
        at::Tensor m = quant::dequantize_blockwise(s.state1(), s.absmax1(), qmap1, kBlocksize);
        at::Tensor v = quant::dequantize_blockwise(s.state2(), s.absmax2(), qmap2, kBlocksize);
        m.mul_(beta1).add_(grad, 1.0 - beta1);
        v.mul_(beta2).addcmul_(grad, grad, 1.0 - beta2);
        at::Tensor denom = (v.sqrt() / correction2).add_(eps);
        if (wd > 0.0) pf.mul_(1.0 - lr * wd);
        pf.addcdiv_(m, denom, -lr / correction1);
        at::Tensor q1 = s.state1(), a1 = s.absmax1(), q2 = s.state2(), a2 = s.absmax2();
        quant::quantize_blockwise_into(m, qmap1, kBlocksize, q1, a1);
        quant::quantize_blockwise_into(v, qmap2, kBlocksize, q2, a2);
      }
      if (pf.data_ptr() != p.data_ptr()) p.detach().copy_(pf);  // p.data.copy_(p_fp32)
    }
  }
  return loss;
}

int64_t AdamW8bit::state_nbytes() const {
  int64_t total = 0;
  for (const auto& [key, st] : state()) {
    const auto& s = static_cast<const AdamW8bitState&>(*st);
    for (const at::Tensor* t : {&s.state1(), &s.state2(), &s.absmax1(), &s.absmax2()}) {
      if (t->defined()) total += t->nbytes();
    }
  }
  return total;
}

void AdamW8bit::save(torch::serialize::OutputArchive&) const {
  TORCH_CHECK(false, "[AdamW8bit] saving optimizer state to a torch archive is not implemented; "
              "fsdp-finetune saves adapters (PEFT format), not optimizer state");
}

void AdamW8bit::load(torch::serialize::InputArchive&) {
  TORCH_CHECK(false, "[AdamW8bit] loading optimizer state from a torch archive is not implemented");
}

}  // namespace fsdp
