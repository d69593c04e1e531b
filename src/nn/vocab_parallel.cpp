// Vocabulary parallelism on FSDP shards; see fsdp/sharded_compute.h.
#include "fsdp/sharded_compute.h"

#include "nn/group_capsule.h"
#include "nn/loss_dtypes.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace fsdp {

int64_t ParamShard::real_rows() const {
  return std::clamp<int64_t>(dim0 - row_begin(), 0, rows_per_rank);
}

const ParamShard& ShardContext::param(const std::string& name) const {
  auto it = params.find(name);
  if (it != params.end()) return it->second;
  std::string names;
  for (const auto& item : params) names += (names.empty() ? "" : ", ") + item.first;
  TORCH_CHECK(false, "[ShardContext] no parameter '", name, "' among the module's shards (",
              names, ")");
}

namespace {

// Note [Computing on shards]
// --------------------------
// A vocabulary unit (vocab V x width E, sharded by rows over W ranks: rank r holds rows
// [r R, (r+1) R), R = ceil(V / W)) meets N tokens per rank per step. Gathering it costs
// 4 V E bytes of memory and traffic per use (and again for its gradient); the tokens are
// W N E values. So the tokens travel instead (Megatron's vocabulary-parallel embedding and
// cross-entropy, here inside a data-parallel step, where each rank has its own tokens):
//
//   embedding  the ids of all ranks are all-gathered (W N); each rank looks up those in its
//              rows (zeros for the others); a reduce-scatter (sum) of the (W N x E) rows hands
//              each rank its own tokens. Exact: each row is one rank's row plus zeros.
//              Backward: the output gradients are all-gathered and each rank adds those of
//              the ids in its rows into its shard's gradient.
//   loss       the hidden states and targets are all-gathered (W N x E); each rank forms the
//              logits of all of them for its rows, in chunks of tokens, keeping per token the
//              max, the sum of exp(logit - max) and the target's logit if the target is in its
//              rows. An all-reduce (max), then one (sum) of the rescaled sums and the target
//              logits give every token's log-sum-exp; each rank's loss is the mean over its own
//              tokens, as fsdp::linear_cross_entropy. Backward all-gathers the ranks' loss
//              gradients (each rank's d loss / d its mean), recomputes the chunks' logits,
//              forms softmax - onehot for its rows, accumulates the shard's gradient and each
//              token's partial hidden gradient; a reduce-scatter (sum over the vocabulary
//              shards) returns each rank its tokens' hidden gradient.
//
// Gradient semantics: FSDP leaves in S.grad the average over ranks of each rank's gradient
// (its reduce-scatter averages). The shard's gradient formed here sums the contributions of
// every rank's tokens, i.e. the sum over ranks of their gradients restricted to these rows;
// it is divided by W so S.grad is the same average. Nothing is reduce-scattered for the unit.
// Hidden gradients are each rank's own (no division).
//
// Padding rows (past V, on the last ranks) get logits of -inf, so they take no probability and
// their gradient is zero, as FSDP's padding. Ranks may hold different token counts: the counts
// are all-gathered first and every all-gather pads to the largest (padding ids fall in no
// rank's rows; padding targets are ignore_index).
//
// Cost per step, by arithmetic, transformer-small at V 33,278, E 512, N 140, W 2: gathered,
// the two 68 MB matrices are all-gathered on each use (the embedding twice in forward and
// once in backward, the head once in each) and their gradients reduce-scattered: about seven
// 68 MB collectives. On shards: six collectives of W N E = 143K values (573 KB) plus the ids,
// targets and per-token statistics. Memory: the unit's unsharded matrix and its unsharded
// gradient (68 MB each) never exist; the all-gathered hidden states (W N x E) and their
// gradient do.
//
// The chunks of the loss follow fsdp::chunk_tokens_for over the W N gathered tokens and the R
// local logits per token. CPU autocast is handled as in fsdp::linear_cross_entropy: backward
// recomputes the logits in the dtype forward used.

ProcessGroup& group_of(torch::autograd::AutogradContext* ctx) {
  return *detail::group_in_capsule(ctx->saved_data["group"]);
}

using detail::accumulate_dtype;  // nn/loss_dtypes.h, as fsdp::linear_cross_entropy

// Which of `ids` fall in this rank's real rows [row_begin, row_begin + real_rows), and their row
// in the shard (0 for the others, so they can index safely and be masked after).
struct RowsInShard {
  at::Tensor mine;  // bool
  at::Tensor safe;  // int64
};
RowsInShard rows_in_shard(const at::Tensor& ids, int64_t row_begin, int64_t real_rows) {
  const at::Tensor local = ids - row_begin;
  RowsInShard r;
  r.mine = local.ge(0).logical_and_(local.lt(real_rows));
  r.safe = at::where(r.mine, local, at::zeros({}, local.options()));
  return r;
}

// The number of rows each rank of `group` holds, all-gathered; the largest.
int64_t largest_count(int64_t n, ProcessGroup& group) {
  const std::vector<int64_t> all = all_gather_values(group, {n});
  return *std::max_element(all.begin(), all.end());
}

// x (n, ...) padded with `fill` to (rows, ...) and all-gathered: (W rows, ...), rank q's rows
// at [q rows, q rows + n_q).
at::Tensor all_gather_rows(const at::Tensor& x, int64_t rows, ProcessGroup& group,
                           double fill = 0) {
  auto sizes = x.sizes().vec();
  sizes[0] = rows;
  at::Tensor padded = x.contiguous();
  if (x.size(0) < rows) {
    padded = at::full(sizes, fill, x.options());
    padded.narrow(0, 0, x.size(0)).copy_(x);
  }
  sizes[0] = rows * group.size();
  at::Tensor out = at::empty(sizes, x.options());
  group.all_gather_into_tensor(out, padded);
  return out;
}

// x (W rows, ...) summed over the ranks; this rank's first n rows, in x's dtype. The reduction
// runs in fp32 for 16-bit x.
at::Tensor reduce_scatter_rows(const at::Tensor& x, int64_t rows, int64_t n,
                               ProcessGroup& group) {
  at::Tensor in = x.to(accumulate_dtype(x)).contiguous();
  auto sizes = in.sizes().vec();
  sizes[0] = rows;
  at::Tensor out = at::empty(sizes, in.options());
  group.reduce_scatter_tensor(out, in, ReduceOp::kSum);
  return out.narrow(0, 0, n).to(x.scalar_type());
}

at::Tensor in_compute_dtype(const at::Tensor& shard, int64_t compute_dtype) {
  const auto dtype = static_cast<at::ScalarType>(compute_dtype);
  return dtype == at::ScalarType::Undefined || dtype == shard.scalar_type() ? shard
                                                                            : shard.to(dtype);
}

// This rank's rows [row_begin, row_begin + R) of a whole (V) vector, zero past V: a differentiable
// slice, so a replicated bias gets its gradient at those rows.
at::Tensor rows_of_whole(const at::Tensor& whole, int64_t row_begin, int64_t rows) {
  const int64_t end = std::min<int64_t>(whole.size(0), row_begin + rows);
  const int64_t real = std::max<int64_t>(0, end - row_begin);
  at::Tensor part = whole.narrow(0, std::min<int64_t>(row_begin, whole.size(0)), real);
  return real == rows ? part : at::constant_pad_nd(part, {0, rows - real}, 0);
}

int64_t dtype_code(const std::optional<at::ScalarType>& dtype) {
  return static_cast<int64_t>(dtype.value_or(at::ScalarType::Undefined));
}

struct ShardedEmbeddingFunction : torch::autograd::Function<ShardedEmbeddingFunction> {
  // shard (R, E); ids (N) int64. Returns (N, E).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& shard,
                            const at::Tensor& ids, const ProcessGroupPtr& group_ptr,
                            int64_t row_begin, int64_t real_rows, int64_t compute_dtype) {
    ProcessGroup& group = *group_ptr;
    const int64_t n = ids.size(0);
    const int64_t rows = largest_count(n, group);
    const at::Tensor all_ids = all_gather_rows(ids, rows, group, /*fill=*/-1);  // (W rows)
    const auto [mine, safe] = rows_in_shard(all_ids, row_begin, real_rows);
    const at::Tensor weight = in_compute_dtype(shard, compute_dtype);
    at::Tensor looked = weight.index_select(0, safe);  // (W rows, E)
    looked.masked_fill_(mine.logical_not().unsqueeze(1), 0);
    at::Tensor out = reduce_scatter_rows(looked, rows, n, group);

    ctx->save_for_backward({safe, mine});
    ctx->saved_data["group"] = detail::group_capsule(group_ptr);
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["n"] = n;
    ctx->saved_data["shard_rows"] = shard.size(0);
    ctx->saved_data["shard_dtype"] = static_cast<int64_t>(shard.scalar_type());
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& safe = saved[0];
    const at::Tensor& mine = saved[1];
    ProcessGroup& group = group_of(ctx);
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const int64_t shard_rows = ctx->saved_data["shard_rows"].toInt();
    const auto shard_dtype = static_cast<at::ScalarType>(ctx->saved_data["shard_dtype"].toInt());
    const at::Tensor grad = grads[0].to(accumulate_dtype(grads[0]));  // (N, E)
    const at::Tensor all = all_gather_rows(grad, rows, group);       // (W rows, E)
    const at::Tensor where = mine.nonzero().squeeze(1);
    at::Tensor grad_shard = at::zeros({shard_rows, grad.size(1)}, grad.options());
    grad_shard.index_add_(0, safe.index_select(0, where), all.index_select(0, where));
    grad_shard.div_(group.size());  // Note [Computing on shards]: the ranks' average
    return {grad_shard.to(shard_dtype), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

struct ShardedLinearCrossEntropyFunction
    : torch::autograd::Function<ShardedLinearCrossEntropyFunction> {
  // hidden (N, E); weight shard (R, E); bias shard (R) or (0); target (N) int64.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight_shard, const at::Tensor& bias_shard,
                            const at::Tensor& target, const ProcessGroupPtr& group_ptr,
                            int64_t row_begin, int64_t real_rows, int64_t ignore_index,
                            int64_t chunk_policy, int64_t compute_dtype, bool bias_replicated) {
    ProcessGroup& group = *group_ptr;
    const int64_t n = hidden.size(0);
    const int64_t shard_rows = weight_shard.size(0);
    const int64_t rows = largest_count(n, group);
    const at::Tensor all_hidden = all_gather_rows(hidden, rows, group);  // (T, E), T = W rows
    const at::Tensor all_target =
        all_gather_rows(target, rows, group, static_cast<double>(ignore_index));  // (T)
    const int64_t tokens = all_hidden.size(0);
    const at::Tensor weight = in_compute_dtype(weight_shard, compute_dtype);
    // A replicated bias (V) takes part with this rank's rows (Note [Computing on shards]).
    const at::Tensor bias_rows =
        bias_replicated ? rows_of_whole(bias_shard, row_begin, shard_rows) : bias_shard;
    const at::Tensor bias =
        bias_shard.numel() > 0 ? in_compute_dtype(bias_rows, compute_dtype) : at::Tensor();
    VocabLossPolicy policy;
    policy.chunk_tokens = chunk_policy;
    const int64_t chunk = chunk_tokens_for(policy, tokens, shard_rows, hidden.size(1));

    const auto [mine, safe] = rows_in_shard(all_target, row_begin, real_rows);  // target in my rows
    const auto acc = hidden.options().dtype(accumulate_dtype(hidden));
    at::Tensor max = at::full({tokens}, -std::numeric_limits<double>::infinity(), acc);
    at::Tensor sums = at::zeros({2, tokens}, acc);  // row 0: sum exp(logit - max); 1: target's
    if (real_rows > 0) {
      for (int64_t begin = 0; begin < tokens; begin += chunk) {
        const int64_t len = std::min(chunk, tokens - begin);
        at::Tensor logits = at::linear(all_hidden.narrow(0, begin, len), weight, bias);
        logits = logits.to(acc.dtype());  // (c, R)
        if (real_rows < shard_rows) {
          logits.narrow(1, real_rows, shard_rows - real_rows)
              .fill_(-std::numeric_limits<double>::infinity());
        }
        const at::Tensor m = std::get<0>(logits.max(1));  // (c)
        sums[1].narrow(0, begin, len).copy_(
            logits.gather(1, safe.narrow(0, begin, len).unsqueeze(1))
                .squeeze(1)
                .masked_fill_(mine.narrow(0, begin, len).logical_not(), 0));
        sums[0].narrow(0, begin, len).copy_(logits.sub_(m.unsqueeze(1)).exp_().sum(1));
        max.narrow(0, begin, len).copy_(m);
      }
    }
    at::Tensor global_max = max.clone();
    group.all_reduce(global_max, ReduceOp::kMax);
    sums[0].mul_((max - global_max).exp_());  // a rank without rows: 0 * exp(-inf) = 0
    group.all_reduce(sums, ReduceOp::kSum);
    const at::Tensor lse = sums[0].log() + global_max;  // (T)
    const at::Tensor valid = all_target.ne(ignore_index);
    const at::Tensor per_token = (lse - sums[1]).masked_fill_(valid.logical_not(), 0);
    const int64_t offset = group.rank() * rows;
    const int64_t count = valid.narrow(0, offset, n).sum().item<int64_t>();
    at::Tensor loss = per_token.narrow(0, offset, n).sum() / static_cast<double>(count);

    ctx->save_for_backward({all_hidden, weight_shard, bias_shard, all_target, lse});
    ctx->saved_data["autocast_dtype"] = detail::autocast_dtype_code(all_hidden);
    ctx->saved_data["group"] = detail::group_capsule(group_ptr);
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["n"] = n;
    ctx->saved_data["count"] = count;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["row_begin"] = row_begin;
    ctx->saved_data["real_rows"] = real_rows;
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["compute_dtype"] = compute_dtype;
    ctx->saved_data["bias_replicated"] = bias_replicated;
    return loss;  // NaN when this rank's targets are all ignored, as at::cross_entropy_loss
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& all_hidden = saved[0];    // (T, E)
    const at::Tensor& weight_shard = saved[1];  // (R, E)
    const at::Tensor& bias_shard = saved[2];    // (R), (V) when replicated, or (0)
    const at::Tensor& all_target = saved[3];    // (T)
    const at::Tensor& lse = saved[4];           // (T)
    ProcessGroup& group = group_of(ctx);
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const int64_t n = ctx->saved_data["n"].toInt();
    const int64_t count = ctx->saved_data["count"].toInt();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const int64_t row_begin = ctx->saved_data["row_begin"].toInt();
    const int64_t real_rows = ctx->saved_data["real_rows"].toInt();
    const int64_t ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t compute_dtype = ctx->saved_data["compute_dtype"].toInt();
    const auto autocast = static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt());
    const bool has_bias = bias_shard.numel() > 0;
    const bool bias_replicated = ctx->saved_data["bias_replicated"].toBool();
    const bool want_hidden = ctx->needs_input_grad(0);
    const bool want_weight = ctx->needs_input_grad(1);
    const bool want_bias = has_bias && ctx->needs_input_grad(2);

    const int64_t shard_rows = weight_shard.size(0);
    const int64_t tokens = all_hidden.size(0);
    const auto acc = all_hidden.options().dtype(accumulate_dtype(all_hidden));
    // Each rank's d(its loss) / d(its mean), per token: the ranks' scales, all-gathered.
    const at::Tensor my_scale = (grads[0].to(acc.dtype()) / static_cast<double>(count)).reshape({1});
    const at::Tensor valid = all_target.ne(ignore_index);
    const at::Tensor token_scale = all_gather_rows(my_scale, 1, group)
                                       .repeat_interleave(rows)
                                       .masked_fill_(valid.logical_not(), 0);  // (T)
    const auto [mine, safe] = rows_in_shard(all_target, row_begin, real_rows);

    const at::Tensor weight = in_compute_dtype(weight_shard, compute_dtype);
    const at::Tensor bias =
        has_bias ? in_compute_dtype(bias_replicated ? rows_of_whole(bias_shard, row_begin, shard_rows)
                                                    : bias_shard,
                                    compute_dtype)
                 : at::Tensor();
    const bool cast = autocast != at::ScalarType::Undefined;
    const at::Tensor w_logits = cast ? weight.to(autocast) : weight;
    const at::Tensor b_logits = cast && bias.defined() ? bias.to(autocast) : bias;
    at::Tensor grad_hidden_all = want_hidden ? at::zeros(all_hidden.sizes(), acc) : at::Tensor();
    at::Tensor grad_weight = want_weight ? at::zeros({shard_rows, weight.size(1)}, acc) : at::Tensor();
    // A replicated bias needs each rank's own tokens' gradient over all rows: here, per owner
    // rank of the tokens, for this rank's rows (W, R); an all-to-all then hands each rank its
    // tokens' part from every rank's rows.
    at::Tensor grad_bias =
        want_bias ? at::zeros(bias_replicated ? at::IntArrayRef{group.size(), shard_rows}
                                              : at::IntArrayRef{shard_rows},
                              acc)
                  : at::Tensor();
    if (real_rows > 0) {
      for (int64_t begin = 0; begin < tokens; begin += chunk) {
        const int64_t len = std::min(chunk, tokens - begin);
        const at::Tensor h = all_hidden.narrow(0, begin, len);  // (c, E)
        at::Tensor g = at::linear(cast ? h.to(autocast) : h, w_logits, b_logits);
        g = g.to(acc.dtype());  // (c, R): the logits, then (in place) their gradient
        if (real_rows < shard_rows) {
          g.narrow(1, real_rows, shard_rows - real_rows)
              .fill_(-std::numeric_limits<double>::infinity());
        }
        g.sub_(lse.narrow(0, begin, len).unsqueeze(1)).exp_();  // softmax, this shard's part
        g.scatter_add_(1, safe.narrow(0, begin, len).unsqueeze(1),
                       -mine.narrow(0, begin, len).to(acc.dtype()).unsqueeze(1));
        g.mul_(token_scale.narrow(0, begin, len).unsqueeze(1));
        if (want_hidden) {
          const at::Tensor gc = g.scalar_type() == weight.scalar_type() ? g : g.to(weight.scalar_type());
          grad_hidden_all.narrow(0, begin, len).copy_(at::mm(gc, weight));
        }
        if (want_weight) grad_weight.addmm_(g.t(), h.to(acc.dtype()));
        if (want_bias && bias_replicated) {
          const at::Tensor owner =
              at::arange(begin, begin + len, at::TensorOptions(at::kLong).device(g.device()))
                  .div_(rows, "floor");
          grad_bias.index_add_(0, owner, g);
        } else if (want_bias) {
          grad_bias.add_(g.sum(0));
        }
      }
    }
    at::Tensor grad_hidden;
    if (want_hidden) {
      grad_hidden = reduce_scatter_rows(grad_hidden_all, rows, n, group).to(all_hidden.scalar_type());
    }
    // Note [Computing on shards]: the shard's gradient is the ranks' average.
    if (want_weight) grad_weight = grad_weight.div_(group.size()).to(weight_shard.scalar_type());
    if (want_bias && bias_replicated) {
      // This rank's tokens' gradient for the whole bias, not averaged: the bias is replicated
      // and its strategy reduces it as any replicated parameter.
      at::Tensor mine_all = at::empty_like(grad_bias);
      group.all_to_all(mine_all, grad_bias.contiguous());
      grad_bias = mine_all.reshape({-1}).narrow(0, 0, bias_shard.size(0)).to(bias_shard.scalar_type());
    } else if (want_bias) {
      grad_bias = grad_bias.div_(group.size()).to(bias_shard.scalar_type());
    }
    return {grad_hidden, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct GatherParamFunction : torch::autograd::Function<GatherParamFunction> {
  // shard (R, ...) -> (W R, ...), the whole parameter with its padding rows.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& shard,
                            const ProcessGroupPtr& group_ptr) {
    ProcessGroup& group = *group_ptr;
    ctx->saved_data["group"] = detail::group_capsule(group_ptr);
    ctx->saved_data["shard_dtype"] = static_cast<int64_t>(shard.scalar_type());
    return all_gather_rows(shard, shard.size(0), group);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    ProcessGroup& group = group_of(ctx);
    const auto shard_dtype = static_cast<at::ScalarType>(ctx->saved_data["shard_dtype"].toInt());
    const at::Tensor grad = grads[0].to(accumulate_dtype(grads[0])).contiguous();
    auto sizes = grad.sizes().vec();
    sizes[0] /= group.size();
    at::Tensor out = at::empty(sizes, grad.options());
    group.reduce_scatter_tensor(out, grad, ReduceOp::kAvg);
    return {out.to(shard_dtype), at::Tensor()};
  }
};

void check_context(const ShardContext& context, const char* api) {
  TORCH_CHECK(context.group && context.group->size() >= 2, "[", api,
              "] needs a shard group of two or more ranks");
}

}  // namespace

at::Tensor sharded_embedding(const at::Tensor& ids, const ParamShard& weight,
                             const ShardContext& context) {
  check_context(context, "sharded_embedding");
  TORCH_CHECK(weight.shard.dim() == 2, "[sharded_embedding] the weight shard must be (rows, dim), got ",
              weight.shard.sizes());
  TORCH_CHECK(!ids.is_floating_point() && !ids.is_complex(),
              "[sharded_embedding] ids must be integers, got ", ids.scalar_type());
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong);
  at::Tensor out = ShardedEmbeddingFunction::apply(weight.shard, flat, context.group,
                                                   weight.row_begin(), weight.real_rows(),
                                                   dtype_code(context.compute_dtype));
  auto sizes = ids.sizes().vec();
  sizes.push_back(weight.shard.size(1));
  return out.reshape(sizes);
}

at::Tensor sharded_linear_cross_entropy(const at::Tensor& hidden, const ParamShard& weight,
                                        const ParamShard* bias, const at::Tensor& target,
                                        const ShardContext& context,
                                        const VocabLossPolicy& policy,
                                        const at::Tensor& replicated_bias) {
  check_context(context, "sharded_linear_cross_entropy");
  TORCH_CHECK(!(bias && replicated_bias.defined()),
              "[sharded_linear_cross_entropy] give the bias as a shard or whole, not both");
  TORCH_CHECK(!replicated_bias.defined() ||
                  (replicated_bias.dim() == 1 && replicated_bias.size(0) == weight.dim0),
              "[sharded_linear_cross_entropy] a whole bias must be (", weight.dim0, "), got ",
              replicated_bias.defined() ? replicated_bias.sizes() : at::IntArrayRef{});
  const at::Tensor& w = weight.shard;
  TORCH_CHECK(hidden.dim() == 2 && w.dim() == 2 && target.dim() == 1 &&
                  hidden.size(1) == w.size(1) && hidden.size(0) == target.size(0) &&
                  (!bias || (bias->shard.dim() == 1 && bias->dim0 == weight.dim0 &&
                             bias->rows_per_rank == weight.rows_per_rank)),
              "[sharded_linear_cross_entropy] expects hidden (N, E), a weight shard (R, E), a "
              "bias shard (R) of the same rows or none, target (N); got hidden ", hidden.sizes(),
              ", weight shard ", w.sizes(), ", target ", target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kLong,
              "[sharded_linear_cross_entropy] target must be int64, got ", target.scalar_type());
  // Validated here so every rank fails alike, before any collective.
  (void)chunk_tokens_for(policy, 1, 1, 1);
  const at::Tensor bias_or_empty = bias ? bias->shard
                                  : replicated_bias.defined() ? replicated_bias
                                                              : at::empty({0}, w.options());
  return ShardedLinearCrossEntropyFunction::apply(
      hidden, w, bias_or_empty, target, context.group, weight.row_begin(), weight.real_rows(),
      policy.ignore_index, policy.chunk_tokens, dtype_code(context.compute_dtype),
      replicated_bias.defined());
}

at::Tensor gathered_param(const ParamShard& param, const ShardContext& context) {
  check_context(context, "gathered_param");
  at::Tensor whole = GatherParamFunction::apply(param.shard, context.group).narrow(0, 0, param.dim0);
  return in_compute_dtype(whole, dtype_code(context.compute_dtype));
}

}  // namespace fsdp
