// Chunked linear + cross-entropy; see fsdp/linear_cross_entropy.h.
#include "fsdp/linear_cross_entropy.h"

#include "nn/loss_dtypes.h"

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
// V 33,278: 18.6 MB each). Here forward loops over chunks of c tokens: logits (c x V) in fp32,
// logsumexp, the target's logit, the chunk's summed loss; the chunk's logits are dropped before
// the next. Only hidden, weight, bias and target are saved. Backward recomputes each chunk's
// logits, turns them into softmax - onehot(target) in place, scales by grad / count, and
// accumulates grad_hidden = G W, grad_weight += G^T h, grad_bias += sum G: one (c x V) buffer
// alive at a time. The price is the head's matmul once more in backward (3 instead of 2).
// Why not form the gradients in forward, as Liger does (no recomputation): the head's weight
// gradient (vocab x width, fp32) would then live from the end of forward into backward, beside
// the unsharded head weight; on transformer-small at its full vocabulary under FULL_SHARD that
// raised the peak by exactly that gradient, 65 MB of 692 (docs/benchmarks/vocab_memory_*).
// Why chunks of at least kMinChunkTokens: every chunk reads the whole weight three times (its
// logits, and in backward its logits again, grad_hidden, grad_weight). With a handful of tokens
// per chunk those matmuls are bound by that traffic, not by arithmetic: transformer-small's 140
// tokens per rank in chunks of 3 made fsdp-train's default step 2.9 times slower.
// Why no chunks at all while the whole fp32 logits take at most kAutoWholeLogitsBytes (64 MiB):
// chunking saves at most about three times those bytes, and costs more than the one extra
// matmul: GPT-2 124M in one process at 4 x 64 tokens (whole logits 51 MB) took 3.90 s per step
// in four chunks of 64 against 3.17 s whole (forward 1.13 against 0.94 s, backward 2.22 against
// 1.73 s), at the same peak tensor bytes with Adam (2,193 MB); with the fused CPU AdamW the
// chunks lowered the peak by 146 MB (2,047 MB). Realistic training shapes are far above the
// threshold (GPT-2 at 8 x 1,024 tokens: 1.6 GB of logits) and are chunked.
// Ignored targets contribute zero loss and zero gradient and are not counted in the mean.
// Under FSDP the weight is the head unit's unsharded parameter: saved as a variable, its storage
// is freed after forward and refilled by the unit's pre-backward before this backward runs, as
// for any layer (src/shard/fsdp_state.cpp).
// fp32 for 16-bit tensors (logits, loss and gradients are formed in fp32), else their own dtype:
// detail::accumulate_dtype (nn/loss_dtypes.h).
using detail::accumulate_dtype;

struct LinearCrossEntropyFunction : torch::autograd::Function<LinearCrossEntropyFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& bias_or_empty,
                            const at::Tensor& target, int64_t ignore_index, int64_t chunk) {
    const at::Tensor bias = bias_or_empty.numel() > 0 ? bias_or_empty : at::Tensor();
    const int64_t n = hidden.size(0);
    const at::Tensor valid = target.ne(ignore_index);  // (N) bool
    const int64_t count = valid.sum().item<int64_t>();
    at::Tensor total = at::zeros({}, hidden.options().dtype(accumulate_dtype(hidden)));
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t len = std::min(chunk, n - begin);
      at::Tensor logits = at::linear(hidden.narrow(0, begin, len), weight, bias);  // (c, V)
      logits = logits.to(accumulate_dtype(logits));
      const at::Tensor t = target.narrow(0, begin, len);
      const at::Tensor ok = valid.narrow(0, begin, len);
      const at::Tensor safe = at::where(ok, t, at::zeros({}, t.options()));  // ignored -> row 0
      at::Tensor picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1);    // (c)
      at::Tensor per_token = (at::logsumexp(logits, {1}) - picked) * ok;     // (c)
      total.add_(per_token.sum());
    }
    ctx->save_for_backward({hidden, weight, bias_or_empty, target});
    // Under CPU autocast forward's logits came from the autocast dtype: backward recomputes them
    // in it too (the autograd engine does not necessarily run backward under autocast).
    ctx->saved_data["autocast_dtype"] = detail::autocast_dtype_code(hidden);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["count"] = count;
    return total / static_cast<double>(count);  // NaN for count 0, as at::cross_entropy_loss
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];  // (N, E)
    const at::Tensor& weight = saved[1];  // (V, E)
    const at::Tensor bias = saved[2].numel() > 0 ? saved[2] : at::Tensor();  // (V) or none
    const at::Tensor& target = saved[3];  // (N)
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t count = ctx->saved_data["count"].toInt();
    const at::ScalarType acc_dtype = accumulate_dtype(weight);
    const at::Tensor scale = grads[0].to(acc_dtype) / static_cast<double>(count);  // ()
    const bool want_hidden = ctx->needs_input_grad(0);
    const bool want_weight = ctx->needs_input_grad(1);
    const bool want_bias = bias.defined() && ctx->needs_input_grad(2);

    const int64_t n = hidden.size(0);
    at::Tensor grad_hidden = want_hidden ? at::empty_like(hidden) : at::Tensor();
    // fp32 accumulators for a lower-precision weight; the weight's own dtype otherwise.
    const auto acc = weight.options().dtype(acc_dtype);
    at::Tensor grad_weight = want_weight ? at::zeros(weight.sizes(), acc) : at::Tensor();
    at::Tensor grad_bias = want_bias ? at::zeros(bias.sizes(), acc) : at::Tensor();
    const at::Tensor valid = target.ne(ignore_index);
    const auto autocast =
        static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt());
    const bool cast = autocast != at::ScalarType::Undefined;
    const at::Tensor w_logits = cast ? weight.to(autocast) : weight;
    const at::Tensor b_logits = cast && bias.defined() ? bias.to(autocast) : bias;
    for (int64_t begin = 0; begin < n; begin += chunk) {
      const int64_t len = std::min(chunk, n - begin);
      const at::Tensor h = hidden.narrow(0, begin, len);  // (c, E)
      // (c, V): the logits as forward computed them, then (in place) their gradient.
      at::Tensor g = at::linear(cast ? h.to(autocast) : h, w_logits, b_logits);
      g = g.to(acc_dtype);
      const at::Tensor t = target.narrow(0, begin, len);
      const at::Tensor ok = valid.narrow(0, begin, len).to(acc_dtype).unsqueeze(1);  // (c, 1)
      const at::Tensor safe = at::where(ok.squeeze(1).to(at::kBool), t, at::zeros({}, t.options()));
      g.sub_(at::logsumexp(g, {1}, /*keepdim=*/true)).exp_();  // softmax
      g.scatter_add_(1, safe.unsqueeze(1), -ok);               // - onehot(target)
      g.mul_(ok * scale);                                      // ignored rows: 0
      const at::Tensor gc = g.scalar_type() == weight.scalar_type() ? g : g.to(weight.scalar_type());
      if (want_hidden) grad_hidden.narrow(0, begin, len).copy_(at::mm(gc, weight));
      if (want_weight) {
        grad_weight.addmm_(g.t(), h.to(acc_dtype));
      }
      if (want_bias) grad_bias.add_(g.sum(0));
    }
    if (want_weight) grad_weight = grad_weight.to(weight.scalar_type());
    if (want_bias) grad_bias = grad_bias.to(bias.scalar_type());
    return {grad_hidden, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
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
  // Note [Chunked linear cross-entropy]: small whole logits are not worth chunking.
  if (tokens * vocab * int64_t{4} <= kAutoWholeLogitsBytes) return tokens;
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
  return LinearCrossEntropyFunction::apply(hidden, weight, bias_or_empty, target,
                                           policy.ignore_index, chunk);
}

}  // namespace fsdp
