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

namespace {

// Note [Attention kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~
// libtorch 2.x has at::scaled_dot_product_attention (SDPA). On CPU it dispatches to a fused
// flash-attention kernel when there is no dropout (fp32, fp64, bf16, fp16) and to the "math"
// path otherwise (the same softmax + dropout + matmuls as the manual kernel, after scaling q
// and k by sqrt(scale) each). Measured with `fsdp-bench attention` (forward + backward of the
// kernel alone, 1 intra-op thread as each rank has at world 2; AMD EPYC with AVX-512 BF16 and
// no AMX; machine shared, so ratios from repeated runs; the 35-token numbers of the latest
// run are in docs/design.md "Facts about libtorch 2.13 on this machine"):
//   - bf16: the manual kernel (oneDNN bf16 matmuls) wins everywhere: SDPA's flash kernel is
//     5-30x slower at 35 tokens (40-350x in the latest, loaded run) and 1.1-3x slower at
//     256-1024.
//   - dropout > 0: SDPA takes the math path and is 0.75-0.95x of the manual kernel.
//   - fp32 without dropout: parity at 35 tokens (the benchmark block), 0.9-1.2x at 128, and
//     1.1-1.65x faster at 256, 1.5-1.75x at 1024 (2-2.5x with is_causal instead of the mask).
// So kAuto picks SDPA for fp32 without dropout once the score matrix has >= 256 x 256
// elements (gpt2-124m at block >= 256 with dropout 0, or in evaluation), and the manual kernel
// otherwise; the demo benchmarks (block 35, dropout 0.2) and every test model keep computing
// exactly as before. A causal additive mask is handed to SDPA as is_causal (one T x T compare
// against causal_mask(T), ~1 ms at 1024 tokens against ~150 ms saved).
//
// Dropout inside SDPA draws its mask from the default CPU generator like at::dropout, so a
// recompute under activation checkpointing (which restores the RNG state) reproduces it
// bitwise: tests/test_activation_checkpointing.cpp checks this with the SDPA kernel pinned.
constexpr int64_t kSdpaMinScores = 256 * 256;  // T * S

bool is_causal_mask(const at::Tensor& mask) {
  return mask.dim() == 2 && mask.size(0) == mask.size(1) &&
         at::equal(mask, causal_mask(mask.size(0), mask.options()));
}

}  // namespace

AttentionKernel resolve_attention_kernel(AttentionKernel kernel, const at::Tensor& q,
                                         const at::Tensor& k, double dropout_p) {
  if (kernel != AttentionKernel::kAuto) return kernel;
  // See Note [Attention kernel].
  const bool sdpa = q.scalar_type() == at::kFloat && dropout_p == 0.0 &&
                    q.size(-2) * k.size(-2) >= kSdpaMinScores;
  return sdpa ? AttentionKernel::kSdpa : AttentionKernel::kManual;
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& mask, double dropout_p, AttentionKernel kernel) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "[attention] q, k, v must be (batch, heads, seq, head_dim), got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(!mask.defined() || (mask.dim() == 2 && mask.size(0) == T && mask.size(1) == S),
              "[attention] attn_mask must be (", T, ", ", S, "), got ", mask.sizes());
  if (resolve_attention_kernel(kernel, q, k, dropout_p) == AttentionKernel::kSdpa) {
    if (mask.defined() && is_causal_mask(mask)) {
      return at::scaled_dot_product_attention(q, k, v, std::nullopt, dropout_p, /*is_causal=*/true);
    }
    return at::scaled_dot_product_attention(
        q, k, v, mask.defined() ? std::optional<at::Tensor>(mask.to(q.scalar_type())) : std::nullopt,
        dropout_p);
  }
  // Manual: (B*H, T, D) batches for BLAS (views when q, k, v are contiguous).
  const at::Tensor q3 = q.reshape({B * H, T, D});
  const at::Tensor k3 = k.reshape({B * H, S, D});
  const at::Tensor v3 = v.reshape({B * H, S, D});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  at::Tensor scores;  // (B*H, T, S)
  if (mask.defined()) {
    // scores = mask + scale * q k^T in one BLAS call (the mask broadcasts over batch*heads).
    scores = at::baddbmm(mask.to(q.scalar_type()), q3, k3.transpose(1, 2), /*beta=*/1.0,
                         /*alpha=*/scale);
  } else {
    scores = at::bmm(q3, k3.transpose(1, 2)).mul_(scale);
  }
  at::Tensor attn = at::softmax(scores, -1);
  attn = detail::dropout(attn, dropout_p, dropout_p > 0.0);
  return at::bmm(attn, v3).view({B, H, T, D});
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

  // Projections as strided views: q (B, H, T, D); `packed` (n, B, H, S, D) holds k and v last.
  at::Tensor q, packed;
  if (!key_value.defined()) {
    // Fused in-projection: one (B*T, E) x (E, 3E) matmul.
    at::Tensor qkv = at::linear(query, in_proj_weight, in_proj_bias);  // (B, T, 3E)
    packed = qkv.view({B, T, 3, H, D}).permute({2, 0, 3, 1, 4});       // (3, B, H, T, D)
  } else {
    TORCH_CHECK(key_value.dim() == 3 && key_value.size(0) == B && key_value.size(2) == E,
                "[MultiheadAttention] key/value must be (", B, ", seq, ", E, "), got ",
                key_value.sizes());
    const int64_t S = key_value.size(1);
    // Cross-attention: q from the query rows of in_proj, k and v (fused) from the rest. split
    // (not narrow): its backward concatenates the grads instead of zero-filling (3E, E) twice.
    auto w = in_proj_weight.split_with_sizes({E, 2 * E});  // (E, E), (2E, E)
    auto b = in_proj_bias.split_with_sizes({E, 2 * E});    // (E), (2E)
    q = at::linear(query, w[0], b[0]).view({B, T, H, D}).transpose(1, 2);  // (B, H, T, D)
    at::Tensor kv = at::linear(key_value, w[1], b[1]);                     // (B, S, 2E)
    packed = kv.view({B, S, 2, H, D}).permute({2, 0, 3, 1, 4});           // (2, B, H, S, D)
  }
  const double p = is_training() ? dropout_ : 0.0;
  const AttentionKernel k = resolve_attention_kernel(
      kernel, q.defined() ? q : packed.select(0, 0), packed.select(0, packed.size(0) - 2), p);
  // The manual kernel's batched matmuls want contiguous heads: one copy for all parts (the
  // SDPA kernels read the strided views directly). unbind (not selects): its backward stacks
  // the grads instead of zero-filling per part.
  auto parts = (k == AttentionKernel::kManual ? packed.contiguous() : packed).unbind(0);
  if (!q.defined()) q = parts[0];
  if (k == AttentionKernel::kManual) q = q.contiguous();
  const at::Tensor out = attention(q, parts[parts.size() - 2], parts.back(), mask, p, k);
  return out_proj(out.transpose(1, 2).reshape({B, T, E}));  // (B, T, E)
}

}  // namespace fsdp::demos
