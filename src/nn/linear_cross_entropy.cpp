// Chunked linear + cross-entropy; see fsdp/linear_cross_entropy.h.
#include "fsdp/linear_cross_entropy.h"

#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace fsdp {
namespace {

// Note [Chunked linear cross-entropy]
// -----------------------------------
// For N tokens, width E and vocabulary V the plain path holds, at its peak, the logits (N x V),
// their log-softmax (saved for backward) and in backward their gradient: 2-3 x 4 N V bytes,
// more than the whole trunk's activations at a real vocabulary (transformer-small, batch 4 x 35,
// V 33,278: 18.6 MB each). Here forward loops over chunks of c tokens: the chunk's logits
// (c x V) in fp32, their logsumexp, the target's logit and the chunk's summed loss; then, when a
// gradient is wanted, the same buffer becomes softmax - onehot(target) in place, scaled by
// 1 / count, and is reduced at once to grad_hidden = G W, grad_weight += G^T h and
// grad_bias += sum G (Liger's fused linear-cross-entropy). One (c x V) buffer is alive at a time
// and the head's matmul runs three times, as on the plain path. Backward only scales the stored
// gradients by the loss's incoming gradient (the loss is a scalar, so that is exact).
// Ignored targets contribute zero loss and zero gradient and are not counted in the mean.
// Why chunks of at least kMinChunkTokens: every chunk reads the whole weight three times (its
// logits, grad_hidden, grad_weight). With a handful of tokens per chunk those matmuls are bound
// by that traffic, not by arithmetic: transformer-small's 140 tokens in chunks of 3 made the
// default fsdp-train step 2.9 times slower than whole logits on a 2-core x86 box; from a few
// dozen rows up the
// chunked loss was as fast as the plain one (measured: docs/benchmarks/vocab_memory_*).
// Under FSDP the weight is the head unit's unsharded parameter; nothing here outlives forward
// but the gradients (the size of the parameters they belong to), which backward hands to the
// unit's gradient hooks as any layer's (src/shard/fsdp_state.cpp). Activation checkpointing of
// the head recomputes forward, gradients included, and keeps the second copy.
// fp32 for 16-bit tensors (logits, loss and gradients are formed in fp32), else their own dtype.
at::ScalarType accumulate_dtype(const at::Tensor& t) {
  return t.element_size() < 4 ? at::kFloat : t.scalar_type();
}

struct ChunkedLoss {
  at::Tensor loss;  // () mean over the counted targets
  at::Tensor grad_hidden, grad_weight, grad_bias;  // d loss / d input, or undefined
};

// The loss over chunks of `chunk` tokens and, for the inputs flagged in want_*, its gradient.
ChunkedLoss chunked_loss(const at::Tensor& hidden, const at::Tensor& weight,
                         const at::Tensor& bias, const at::Tensor& target, int64_t ignore_index,
                         int64_t chunk, bool want_hidden, bool want_weight, bool want_bias) {
  const int64_t n = hidden.size(0);
  const at::Tensor valid = target.ne(ignore_index);  // (N) bool
  const int64_t count = valid.sum().item<int64_t>();
  const at::ScalarType acc_dtype = accumulate_dtype(weight);
  const auto acc = weight.options().dtype(acc_dtype);
  ChunkedLoss out;
  at::Tensor total = at::zeros({}, hidden.options().dtype(accumulate_dtype(hidden)));
  if (want_hidden) out.grad_hidden = at::empty_like(hidden);
  if (want_weight) out.grad_weight = at::zeros(weight.sizes(), acc);  // fp32 for 16-bit weights
  if (want_bias) out.grad_bias = at::zeros(bias.sizes(), acc);
  const bool want_grad = want_hidden || want_weight || want_bias;
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t len = std::min(chunk, n - begin);
    const at::Tensor h = hidden.narrow(0, begin, len);  // (c, E)
    // (c, V): the logits (under CPU autocast in its dtype, as the plain path's), then in place
    // their gradient.
    at::Tensor g = at::linear(h, weight, bias).to(acc_dtype);
    const at::Tensor t = target.narrow(0, begin, len);
    const at::Tensor ok = valid.narrow(0, begin, len);
    const at::Tensor safe = at::where(ok, t, at::zeros({}, t.options()));  // ignored -> row 0
    const at::Tensor lse = at::logsumexp(g, {1}, /*keepdim=*/true);        // (c, 1)
    const at::Tensor picked = g.gather(1, safe.unsqueeze(1));              // (c, 1)
    total.add_(((lse - picked).squeeze(1) * ok).sum());
    if (!want_grad) continue;
    // The gradient in the parameters' own dtypes, as autograd forms it on the plain path.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
    const at::Tensor ok_col = ok.to(acc_dtype).unsqueeze(1);  // (c, 1)
    g.sub_(lse).exp_();                        // softmax
    g.scatter_add_(1, safe.unsqueeze(1), -ok_col);  // - onehot(target)
    g.mul_(ok_col / static_cast<double>(count));    // ignored rows: 0
    const at::Tensor gc = g.scalar_type() == weight.scalar_type() ? g : g.to(weight.scalar_type());
    if (want_hidden) out.grad_hidden.narrow(0, begin, len).copy_(at::mm(gc, weight));
    if (want_weight) out.grad_weight.addmm_(g.t(), h.to(acc_dtype));
    if (want_bias) out.grad_bias.add_(g.sum(0));
  }
  if (want_weight) out.grad_weight = out.grad_weight.to(weight.scalar_type());
  if (want_bias) out.grad_bias = out.grad_bias.to(bias.scalar_type());
  out.loss = total / static_cast<double>(count);  // NaN for count 0, as at::cross_entropy_loss
  return out;
}

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& bias_or_empty,
                            const at::Tensor& target, int64_t ignore_index, int64_t chunk,
                            bool want_hidden, bool want_weight, bool want_bias) {
    const at::Tensor bias = bias_or_empty.numel() > 0 ? bias_or_empty : at::Tensor();
    ChunkedLoss r = chunked_loss(hidden, weight, bias, target, ignore_index, chunk, want_hidden,
                                 want_weight, want_bias && bias.defined());
    ctx->saved_data["grad_hidden"] = r.grad_hidden;
    ctx->saved_data["grad_weight"] = r.grad_weight;
    ctx->saved_data["grad_bias"] = r.grad_bias;
    return r.loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& scale = grads[0];  // () the loss's incoming gradient
    auto scaled = [&](const char* key, bool wanted) -> at::Tensor {
      const c10::IValue& v = ctx->saved_data[key];
      if (!wanted || !v.isTensor() || !v.toTensor().defined()) return at::Tensor();
      const at::Tensor g = v.toTensor();
      return g * scale.to(g.scalar_type());
    };
    return {scaled("grad_hidden", ctx->needs_input_grad(0)),
            scaled("grad_weight", ctx->needs_input_grad(1)),
            scaled("grad_bias", ctx->needs_input_grad(2)),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t chunk_tokens_for(const VocabLossPolicy& policy, int64_t tokens, int64_t vocab,
                         int64_t hidden) {
  TORCH_CHECK(policy.chunk_tokens >= VocabLossPolicy::kWholeLogits,
              "[linear_cross_entropy] chunk_tokens must be a positive count, 0 (auto) or -1 "
              "(whole logits); got ", policy.chunk_tokens);
  tokens = std::max<int64_t>(tokens, 1);
  if (policy.chunk_tokens == VocabLossPolicy::kWholeLogits) return tokens;
  if (policy.chunk_tokens > 0) return std::min(policy.chunk_tokens, tokens);
  if (vocab <= hidden) return tokens;  // a chunk's logits would be no smaller than the states
  const int64_t chunks = (vocab + hidden - 1) / std::max<int64_t>(hidden, 1);
  int64_t chunk = (tokens + chunks - 1) / chunks;
  if (chunk >= kMinChunkTokens) return chunk;
  // Note [Chunked linear cross-entropy]: no chunk below kMinChunkTokens; equal chunks above it.
  if (tokens <= kMinChunkTokens) return tokens;
  const int64_t n_chunks = tokens / kMinChunkTokens;
  return (tokens + n_chunks - 1) / n_chunks;
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& target,
                                const VocabLossPolicy& policy) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && target.dim() == 1 &&
                  hidden.size(1) == weight.size(1) && hidden.size(0) == target.size(0) &&
                  (!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0))),
              "[linear_cross_entropy] expects hidden (N, E), weight (V, E), bias (V) or none, "
              "target (N); got hidden ", hidden.sizes(), ", weight ", weight.sizes(), ", bias ",
              bias.defined() ? bias.sizes() : at::IntArrayRef{}, ", target ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong, "[linear_cross_entropy] target must be int64, got ",
              target.scalar_type());
  const int64_t n = hidden.size(0);
  const int64_t chunk = chunk_tokens_for(policy, n, weight.size(0), weight.size(1));
  if (chunk >= n) {  // the plain path
    at::Tensor logits = at::linear(hidden, weight, bias);  // (N, V)
    logits = logits.to(accumulate_dtype(logits));
    return at::cross_entropy_loss(logits, target, {}, at::Reduction::Mean, policy.ignore_index);
  }
  // An undefined tensor cannot pass through Function::apply: no bias travels as (0) elements.
  const at::Tensor bias_or_empty = bias.defined() ? bias : at::empty({0}, weight.options());
  // Gradients are formed in forward only for the inputs autograd will ask about.
  const bool grad = at::GradMode::is_enabled();
  const bool want_hidden = grad && hidden.requires_grad();
  const bool want_weight = grad && weight.requires_grad();
  const bool want_bias = grad && bias.defined() && bias.requires_grad();
  if (!want_hidden && !want_weight && !want_bias) {
    return chunked_loss(hidden, weight, bias, target, policy.ignore_index, chunk, false, false,
                        false)
        .loss;
  }
  return LinearCrossEntropyFunction::apply(hidden, weight, bias_or_empty, target,
                                           policy.ignore_index, chunk, want_hidden, want_weight,
                                           want_bias);
}

}  // namespace fsdp
