// MultiheadAttention and the causal mask. See include/fsdp/models.h.
#include "fsdp/models.h"

#include "models/detail.h"

#include <torch/nn/init.h>

#include <cmath>
#include <limits>

namespace fsdp::demos {

at::Tensor causal_mask(int64_t t, const at::TensorOptions& options) {
  // (T, T): -inf strictly above the diagonal, 0 elsewhere.
  return at::full({t, t}, -std::numeric_limits<double>::infinity(), options).triu_(1);
}

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, double dropout)
    : embed_dim_(embed_dim), num_heads_(num_heads), dropout_(dropout) {
  TORCH_CHECK(embed_dim > 0 && num_heads > 0 && embed_dim % num_heads == 0,
              "[MultiheadAttention] embed_dim (", embed_dim,
              ") must be a positive multiple of num_heads (", num_heads, ")");
  TORCH_CHECK(dropout >= 0.0 && dropout < 1.0, "[MultiheadAttention] dropout must be in [0, 1), got ",
              dropout);
  // Same init as torch.nn.MultiheadAttention._reset_parameters: xavier_uniform_ in-projection,
  // zero biases; out_proj.weight keeps nn.Linear's default init.
  in_proj_weight = register_parameter("in_proj_weight", at::empty({3 * embed_dim, embed_dim}));
  in_proj_bias = register_parameter("in_proj_bias", at::empty({3 * embed_dim}));
  out_proj = register_module("out_proj", torch::nn::Linear(embed_dim, embed_dim));
  torch::nn::init::xavier_uniform_(in_proj_weight);
  torch::nn::init::zeros_(in_proj_bias);
  torch::nn::init::zeros_(out_proj->bias);
}

at::Tensor MultiheadAttention::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor query = detail::arg(inputs, 0);      // (B, T, E)
  const at::Tensor key_value = detail::arg(inputs, 1);  // (B, S, E) or undefined (self)
  const at::Tensor mask = detail::arg(inputs, 2);       // (T, S) additive, or undefined
  const int64_t E = embed_dim_, H = num_heads_, D = E / H;
  TORCH_CHECK(query.defined() && query.dim() == 3 && query.size(2) == E,
              "[MultiheadAttention] query must be (batch, seq, ", E, "), got ",
              query.defined() ? query.sizes() : at::IntArrayRef{});
  const int64_t B = query.size(0), T = query.size(1);

  at::Tensor q, k, v;  // each (B*H, T|S, D)
  int64_t S = T;
  if (!key_value.defined()) {
    // Fused in-projection: one (B*T, E) x (E, 3E) matmul, then split heads with one copy.
    at::Tensor qkv = at::linear(query, in_proj_weight, in_proj_bias);  // (B, T, 3E)
    qkv = qkv.view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4}).contiguous();  // (3, B, H, T, D)
    // unbind (not three selects): its backward stacks the grads instead of zero-filling thrice.
    auto parts = qkv.view({3, B * H, T, D}).unbind(0);
    q = parts[0], k = parts[1], v = parts[2];
  } else {
    TORCH_CHECK(key_value.dim() == 3 && key_value.size(0) == B && key_value.size(2) == E,
                "[MultiheadAttention] key/value must be (", B, ", seq, ", E, "), got ",
                key_value.sizes());
    S = key_value.size(1);
    // Cross-attention: q from the query rows of in_proj, k and v (fused) from the rest. split
    // (not narrow): its backward concatenates the grads instead of zero-filling (3E, E) twice.
    auto w = in_proj_weight.split_with_sizes({E, 2 * E});  // (E, E), (2E, E)
    auto b = in_proj_bias.split_with_sizes({E, 2 * E});    // (E), (2E)
    q = at::linear(query, w[0], b[0]);                     // (B, T, E)
    q = q.view({B, T, H, D}).transpose(1, 2).reshape({B * H, T, D});
    at::Tensor kv = at::linear(key_value, w[1], b[1]);     // (B, S, 2E)
    kv = kv.view({B, S, 2, H, D}).permute({2, 0, 3, 1, 4}).contiguous();  // (2, B, H, S, D)
    auto parts = kv.view({2, B * H, S, D}).unbind(0);
    k = parts[0], v = parts[1];
  }

  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor scores;  // (B*H, T, S)
  if (mask.defined()) {
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == T && mask.size(1) == S,
                "[MultiheadAttention] attn_mask must be (", T, ", ", S, "), got ", mask.sizes());
    // scores = mask + scale * q k^T in one BLAS call (the mask broadcasts over batch*heads).
    scores = at::baddbmm(mask.to(q.scalar_type()), q, k.transpose(1, 2), /*beta=*/1.0,
                         /*alpha=*/scale);
  } else {
    scores = at::bmm(q, k.transpose(1, 2)).mul_(scale);
  }
  at::Tensor attn = at::softmax(scores, -1);
  attn = detail::dropout(attn, dropout_, is_training());
  at::Tensor out = at::bmm(attn, v);                                 // (B*H, T, D)
  out = out.view({B, H, T, D}).transpose(1, 2).reshape({B, T, E});  // (B, T, E)
  return out_proj(out);
}

}  // namespace fsdp::demos
