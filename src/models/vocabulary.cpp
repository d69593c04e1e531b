// Vocabulary (embedding / head as one FSDP unit) and the demo models' loss. See models.h.
#include "fsdp/models.h"

#include "models/detail.h"

namespace fsdp::demos {

Vocabulary::Vocabulary(at::Tensor w, at::Tensor b) : fsdp::nn::Module("Vocabulary") {
  TORCH_CHECK(w.defined() && w.dim() == 2, "[Vocabulary] weight must be (vocab, dim), got ",
              w.defined() ? w.sizes() : at::IntArrayRef{});
  TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0)),
              "[Vocabulary] bias must be (", w.size(0), "), got ", b.sizes());
  weight = register_parameter("weight", std::move(w));
  if (b.defined()) bias = register_parameter("bias", std::move(b));
}

at::Tensor Vocabulary::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = detail::arg(inputs, 0);
  const at::Tensor target = detail::arg(inputs, 1);
  TORCH_CHECK(x.defined(), "[Vocabulary] forward needs token ids or hidden states");
  if (!x.is_floating_point()) {
    TORCH_CHECK(!target.defined(), "[Vocabulary] token ids take no target (targets go with "
                "hidden states: forward({hidden, target}) is the loss)");
    if (shards_) return sharded_embedding(x, shards_->param("weight"), *shards_);
    return at::embedding(weight, x);  // (..., dim)
  }
  TORCH_CHECK(x.size(-1) == dim(), "[Vocabulary] hidden states must end in dim ", dim(), ", got ",
              x.sizes());
  if (shards_) return forward_on_shards(x, target);
  if (!target.defined()) return at::linear(x, weight, bias);  // (..., vocab)
  return linear_cross_entropy(x.reshape({-1, dim()}), weight, bias, target.reshape({-1}),
                              loss_policy);
}

// The head's logits or loss with the matrix on its shards (Note [Computing on shards] in
// src/nn/vocab_parallel.cpp).
at::Tensor Vocabulary::forward_on_shards(const at::Tensor& x, const at::Tensor& target) {
  const ShardContext& ctx = *shards_;
  const ParamShard& w = ctx.param("weight");
  const ParamShard* b = ctx.has("bias") ? &ctx.param("bias") : nullptr;
  // A bias the strategy left whole on every rank (ZeRO-3 keeps small parameters replicated).
  const at::Tensor whole_bias = !b && bias.defined() ? bias : at::Tensor();
  if (!target.defined()) {  // all logits: the whole matrix is needed
    return at::linear(x, gathered_param(w, ctx), b ? gathered_param(*b, ctx) : whole_bias);
  }
  return sharded_linear_cross_entropy(x.reshape({-1, dim()}), w, b, target.reshape({-1}), ctx,
                                      loss_policy, whole_bias);
}

at::Tensor language_model_loss(fsdp::nn::Module& model, const at::Tensor& input,
                               const at::Tensor& target) {
  if (auto* lm = dynamic_cast<VocabHeadModel*>(&model)) return lm->loss(input, target);
  return at::nll_loss(model(input, target), target.reshape(-1));
}

void set_vocab_loss_policy(torch::nn::Module& model, const VocabLossPolicy& policy) {
  // Validates the policy once, here, rather than at the first forward.
  (void)chunk_tokens_for(policy, 1, 1, 1);
  for (auto& m : model.modules()) {
    if (auto* v = dynamic_cast<Vocabulary*>(m.get())) v->loss_policy = policy;
  }
}

void set_vocab_compute_on_shards(torch::nn::Module& model, bool on) {
  for (auto& m : model.modules()) {
    if (auto* v = dynamic_cast<Vocabulary*>(m.get())) v->compute_on_shards = on;
  }
}

}  // namespace fsdp::demos
