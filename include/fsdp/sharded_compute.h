// Modules that compute on their parameter shards instead of gathering them: the vocabulary
// units' way to run under FSDP (vocabulary parallelism inside a data-parallel step).
//
// Under FSDP a unit's parameters are all-gathered before its forward and backward, and its
// gradients reduce-scattered after. For a vocabulary matrix (vocab x width) that is the largest
// unit of a language model at a real vocabulary, while the tokens it meets in one step are few:
// transformer-small at 33,278 words holds 17M elements in the head, and a rank's batch of 140
// tokens has 72K hidden values. A module that implements ShardedComputeModule instead moves the
// tokens: every rank computes with its own rows of the matrix for the tokens of all ranks, and
// small collectives over the hidden states and the loss's row statistics put the result
// together. Its matrix is never gathered and its gradient is formed sharded, already averaged,
// so nothing is reduce-scattered for it. See Note [Computing on shards] in
// src/nn/vocab_parallel.cpp.
//
//   class MyEmbedding : public fsdp::nn::Module, public fsdp::ShardedComputeModule {
//     bool computes_on_shards() const override { return true; }
//     void set_shard_context(std::shared_ptr<const fsdp::ShardContext> c) override { ctx_ = c; }
//     at::Tensor forward(const fsdp::nn::Inputs& in) override {
//       if (ctx_) return fsdp::sharded_embedding(in[0], ctx_->param("weight"), *ctx_);
//       return at::embedding(weight, in[0]);
//     }
//     ...
//   };
//
// The strategy (FSDPStrategy, and ZeRO stage 3 through it) asks each unit's module once, at
// setup: when the module says yes and its unit is sharded over two or more ranks with no
// replication (not HYBRID_SHARD), no offload and only the module's own parameters, it installs
// no hooks on the unit and hands the module a context; it hands it nullptr when the strategy is
// destroyed. Every rank must then call the module the same number of times in the same order,
// as for any unit.
#pragma once

#include "fsdp/comm.h"
#include "fsdp/linear_cross_entropy.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace fsdp {

// One parameter as the strategy shards it: rank r of the group holds rows
// [r * rows_per_rank, (r + 1) * rows_per_rank) of the parameter viewed as (dim0, ...); rows past
// dim0 (the last ranks') are zero padding. `shard` is the leaf the optimizer steps; gradients
// computed for it are the group's average, as a reduce-scatter would leave them.
struct ParamShard {
  at::Tensor shard;           // (rows_per_rank, rest...), or (rows_per_rank) for a 1-d parameter
  int64_t dim0 = 0;           // rows of the whole parameter
  int64_t rows_per_rank = 0;  // ceil(dim0 / group size)
  int rank = 0;               // this rank in the group
  int64_t row_begin() const { return rank * rows_per_rank; }
  // The real rows this rank holds (0 for a rank past the end of a small parameter).
  int64_t real_rows() const;
};

struct ShardContext {
  ProcessGroupPtr group;  // the ranks the parameters are split over (2 or more)
  // The dtype the unit computes in (MixedPrecisionPolicy::param_dtype), nullopt: the shard's.
  std::optional<at::ScalarType> compute_dtype;
  // The unit's parameters by the name the module registered them under. A parameter the
  // strategy leaves whole on every rank (ignored, ZeRO-3's persistent ones) is not here: the
  // module computes with its own tensor for it, and the strategy reduces its gradient.
  std::map<std::string, ParamShard> params;
  // The parameter registered as `name`; an error naming the module's parameters when missing.
  const ParamShard& param(const std::string& name) const;
  bool has(const std::string& name) const { return params.count(name) > 0; }
};

class ShardedComputeModule {
 public:
  virtual ~ShardedComputeModule() = default;
  // Asked once when a strategy sets the module up as a unit: may it compute on its shards?
  virtual bool computes_on_shards() const = 0;
  // The shards to compute with from now on; nullptr: back to the module's own parameters.
  virtual void set_shard_context(std::shared_ptr<const ShardContext> context) = 0;
};

// --- the vocabulary-parallel operations (src/nn/vocab_parallel.cpp). Collective: every rank of
// context.group calls them in the same order; ranks may hold different numbers of tokens.

// at::embedding(weight, ids) for this rank's ids (any shape; output ids.sizes() + (dim)), where
// `weight` (vocab, dim) is sharded by rows. Each rank looks up the ids of all ranks that fall in
// its rows; a reduce-scatter over the (tokens x dim) results returns each rank its own. Exact:
// every output row is one rank's row plus zeros.
at::Tensor sharded_embedding(const at::Tensor& ids, const ParamShard& weight,
                             const ShardContext& context);

// fsdp::linear_cross_entropy(hidden, weight, bias, target, policy) for this rank's tokens,
// where weight (vocab, dim) and bias (vocab, or nullptr) are sharded by rows: each rank forms
// the logits of all ranks' tokens for its rows, chunk by chunk; an all-reduce of each token's
// max and sum of exponentials gives the log-sum-exp. Backward recomputes the chunks.
// `replicated_bias` (vocab), instead of a bias shard: a bias every rank holds whole (one the
// strategy left unsharded, e.g. ZeRO-3's persistent parameters); its gradient is then this
// rank's own, to be reduced by the strategy as for any replicated parameter.
at::Tensor sharded_linear_cross_entropy(const at::Tensor& hidden, const ParamShard& weight,
                                        const ParamShard* bias, const at::Tensor& target,
                                        const ShardContext& context,
                                        const VocabLossPolicy& policy = {},
                                        const at::Tensor& replicated_bias = {});

// The whole parameter, all-gathered from its shards (differentiable: the gradient is
// reduce-scattered and averaged into the shard). For the uses that need the whole matrix (all
// logits of a head); it lives as long as autograd keeps it.
at::Tensor gathered_param(const ParamShard& param, const ShardContext& context);

}  // namespace fsdp
