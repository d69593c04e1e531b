// The loss of a vocabulary head without its whole logits: cross-entropy(x W^T + b, target) over
// chunks of tokens. Each chunk's logits are computed, reduced to the chunk's share of the loss
// and dropped; backward recomputes them chunk by chunk (Liger's fused linear-cross-entropy
// idea), so the (tokens x vocab) logits, their log-softmax and their gradient never exist whole.
//
//   at::Tensor h = trunk(input).reshape({-1, E});                 // (N, E)
//   at::Tensor loss = fsdp::linear_cross_entropy(h, W, b, target.reshape(-1));
//   // == at::cross_entropy_loss(at::linear(h, W, b).to(kFloat), target) (mean, ignore -100)
//
// See Note [Chunked linear cross-entropy] in src/nn/linear_cross_entropy.cpp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace fsdp {

// How a vocabulary head computes its loss.
struct VocabLossPolicy {
  static constexpr int64_t kAuto = 0;        // chunks sized by the rule of chunk_tokens_for
  static constexpr int64_t kWholeLogits = -1;  // the plain path: all logits, then cross-entropy
  // Tokens per chunk: kAuto, kWholeLogits, or a positive count.
  int64_t chunk_tokens = kAuto;
  int64_t ignore_index = -100;  // targets equal to it count neither in the sum nor the mean
};

// Fewest tokens per chunk under kAuto: smaller chunks make the head's matmuls bound by reading
// the whole weight once per chunk, three times over (Note [Chunked linear cross-entropy]).
constexpr int64_t kMinChunkTokens = 64;
// Under kAuto, whole logits of at most this many fp32 bytes (tokens x vocab x 4) are not
// chunked: the memory chunking would save is small beside the recomputation it costs.
constexpr int64_t kAutoWholeLogitsBytes = int64_t{64} << 20;

// The chunk length `policy` gives for `tokens` rows of width `hidden` into `vocab` logits;
// `tokens` (one chunk) means the whole logits at once. kAuto: one chunk when vocab <= hidden
// (chunking would save nothing) or when the whole fp32 logits take at most
// kAutoWholeLogitsBytes; else ceil(tokens / ceil(vocab / hidden)), so a chunk's logits are no
// larger than the hidden states, but never fewer than kMinChunkTokens tokens per chunk (then
// equal chunks of at least that many; under 128 tokens is one chunk).
int64_t chunk_tokens_for(const VocabLossPolicy& policy, int64_t tokens, int64_t vocab,
                         int64_t hidden);

// Mean cross-entropy over the targets that are not ignore_index, of logits = hidden weight^T
// (+ bias), in fp32 for 16-bit hidden and weight (as the demo models' bf16 path), else in their dtype:
//   hidden (N, E) floating, weight (V, E) same dtype, bias (V) or undefined, target (N) int64.
// Differentiable in hidden, weight and bias. NaN when every target is ignored (as
// at::cross_entropy_loss). `chunk_tokens` >= N takes the plain path (whole logits, autograd).
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& bias, const at::Tensor& target,
                                const VocabLossPolicy& policy = {});

}  // namespace fsdp
