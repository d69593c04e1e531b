// The vocabulary-parallel operations (fsdp/sharded_compute.h) against the same computation in
// one process: every rank builds every rank's data from its seed, so the reference (the whole
// matrix, each rank's tokens, the gradients averaged over ranks as FSDP's reduce-scatter leaves
// them) needs no communication. Ranks hold different numbers of tokens, some targets are
// ignored, the vocabulary does not divide by the world (padding rows), and with a vocabulary
// smaller than the world one rank holds no row at all.
#include "fsdp/comm.h"
#include "fsdp/linear_cross_entropy.h"
#include "fsdp/sharded_compute.h"
#include "testing.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

constexpr int64_t kWidth = 6;

struct RankData {
  at::Tensor hidden;    // (n, E)
  at::Tensor target;    // (n), some ignored
  at::Tensor ids;       // (2, n)
  at::Tensor grad_out;  // (2, n, E): the embedding's upstream gradient
  double loss_scale;    // d(what rank q backpropagates) / d(its loss)
};

RankData data_of(int q, int64_t vocab) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + q);
  const int64_t n = 5 + 2 * q;  // uneven token counts
  RankData d;
  d.hidden = at::randn({n, kWidth}, gen, at::kFloat);
  d.target = at::randint(vocab, {n}, gen, at::kLong);
  if (q == 1) d.target[0] = -100;  // ignored
  d.ids = at::randint(vocab, {2, n}, gen, at::kLong);
  d.grad_out = at::randn({2, n, kWidth}, gen, at::kFloat);
  d.loss_scale = 1.0 + q;
  return d;
}

// Rows [r R, (r+1) R) of `full` (dim0 V) zero-padded to W R rows: rank r's shard, a leaf.
at::Tensor shard_of(const at::Tensor& full, int rank, int world) {
  const int64_t V = full.size(0);
  const int64_t R = (V + world - 1) / world;
  auto sizes = full.sizes().vec();
  sizes[0] = R * world;
  at::Tensor padded = at::zeros(sizes, full.options());
  padded.narrow(0, 0, V).copy_(full);
  return padded.narrow(0, rank * R, R).clone().set_requires_grad(true);
}

at::Tensor rows_of(const at::Tensor& full_grad, int rank, int world) {
  return shard_of(full_grad, rank, world).detach();
}

fsdp::ParamShard param_shard(const at::Tensor& shard, int64_t dim0, int rank) {
  fsdp::ParamShard p;
  p.shard = shard;
  p.dim0 = dim0;
  p.rows_per_rank = shard.size(0);
  p.rank = rank;
  return p;
}

void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_TRUE(got.defined()) << what << ": no gradient";
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double diff = (got - want).abs().max().item<double>();
  const double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LE(diff, tol * scale) << what;
}

void check_ops(int64_t vocab) {
  auto group = fsdp::world_group();
  const int world = group->size();
  const int rank = group->rank();
  SCOPED_TRACE("vocab " + std::to_string(vocab) + ", world " + std::to_string(world));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor weight = at::randn({vocab, kWidth}, gen, at::kFloat);
  const at::Tensor bias = at::randn({vocab}, gen, at::kFloat);
  std::vector<RankData> data;
  for (int q = 0; q < world; ++q) data.push_back(data_of(q, vocab));
  const RankData& mine = data[static_cast<size_t>(rank)];
  fsdp::ShardContext ctx;
  ctx.group = group;

  // --- the loss, for several chunkings.
  for (int64_t chunk : {fsdp::VocabLossPolicy::kWholeLogits, int64_t{3}, fsdp::VocabLossPolicy::kAuto}) {
    SCOPED_TRACE("chunk_tokens " + std::to_string(chunk));
    fsdp::VocabLossPolicy policy;
    policy.chunk_tokens = chunk;
    // Reference: each rank's loss on the whole matrix, the matrix gradients averaged.
    at::Tensor want_loss, want_hidden_grad, want_own_bias_grad;
    at::Tensor w_grad = at::zeros_like(weight), b_grad = at::zeros_like(bias);
    for (int q = 0; q < world; ++q) {
      at::Tensor w = weight.clone().set_requires_grad(true);
      at::Tensor b = bias.clone().set_requires_grad(true);
      at::Tensor h = data[q].hidden.clone().set_requires_grad(true);
      fsdp::VocabLossPolicy whole;
      whole.chunk_tokens = fsdp::VocabLossPolicy::kWholeLogits;
      at::Tensor loss = fsdp::linear_cross_entropy(h, w, b, data[q].target, whole);
      (loss * data[q].loss_scale).backward();
      w_grad += w.grad() / world;
      b_grad += b.grad() / world;
      if (q == rank) {
        want_loss = loss.detach();
        want_hidden_grad = h.grad();
        want_own_bias_grad = b.grad();
      }
    }
    at::Tensor ws = shard_of(weight, rank, world), bs = shard_of(bias, rank, world);
    const fsdp::ParamShard wp = param_shard(ws, vocab, rank), bp = param_shard(bs, vocab, rank);
    at::Tensor h = mine.hidden.clone().set_requires_grad(true);
    at::Tensor loss = fsdp::sharded_linear_cross_entropy(h, wp, &bp, mine.target, ctx, policy);
    (loss * mine.loss_scale).backward();
    expect_close(loss.detach(), want_loss, 1e-6, "loss");
    expect_close(h.grad(), want_hidden_grad, 1e-5, "hidden gradient");
    expect_close(ws.grad(), rows_of(w_grad, rank, world), 1e-5, "weight shard gradient");
    expect_close(bs.grad(), rows_of(b_grad, rank, world), 1e-5, "bias shard gradient");

    // A bias every rank holds whole (ZeRO-3's persistent parameters): the same loss, and the
    // bias's gradient is this rank's own, for the strategy to reduce.
    at::Tensor ws2 = shard_of(weight, rank, world);
    at::Tensor whole_bias = bias.clone().set_requires_grad(true);
    at::Tensor h2 = mine.hidden.clone().set_requires_grad(true);
    at::Tensor loss2 = fsdp::sharded_linear_cross_entropy(
        h2, param_shard(ws2, vocab, rank), nullptr, mine.target, ctx, policy, whole_bias);
    (loss2 * mine.loss_scale).backward();
    expect_close(loss2.detach(), want_loss, 1e-6, "loss, whole bias");
    expect_close(h2.grad(), want_hidden_grad, 1e-5, "hidden gradient, whole bias");
    expect_close(ws2.grad(), rows_of(w_grad, rank, world), 1e-5, "weight shard gradient, whole bias");
    expect_close(whole_bias.grad(), want_own_bias_grad, 1e-5, "this rank's whole-bias gradient");
  }

  // --- the embedding: exact forward, averaged gradient.
  {
    at::Tensor w_grad = at::zeros_like(weight);
    for (int q = 0; q < world; ++q) {
      at::Tensor w = weight.clone().set_requires_grad(true);
      (at::embedding(w, data[q].ids) * data[q].grad_out).sum().backward();
      w_grad += w.grad() / world;
    }
    at::Tensor ws = shard_of(weight, rank, world);
    at::Tensor out = fsdp::sharded_embedding(mine.ids, param_shard(ws, vocab, rank), ctx);
    EXPECT_TRUE(at::equal(out.detach(), at::embedding(weight, mine.ids))) << "embedding forward";
    (out * mine.grad_out).sum().backward();
    expect_close(ws.grad(), rows_of(w_grad, rank, world), 1e-6, "embedding shard gradient");
  }

  // --- the whole matrix, gathered: its gradient averaged into the shard.
  {
    at::Tensor ws = shard_of(weight, rank, world);
    at::Tensor whole = fsdp::gathered_param(param_shard(ws, vocab, rank), ctx);
    EXPECT_TRUE(at::equal(whole.detach(), weight)) << "gathered matrix";
    const at::Tensor g = at::full({vocab, kWidth}, 1.0 + rank);
    (whole * g).sum().backward();
    double mean = 0;
    for (int q = 0; q < world; ++q) mean += (1.0 + q) / world;
    expect_close(ws.grad(), rows_of(at::full({vocab, kWidth}, mean), rank, world), 1e-6,
                 "gathered matrix's shard gradient");
  }
}

}  // namespace

TEST(VocabParallel, ShardedOpsMatchOneProcessGloo2And3) {
  for (int world : {2, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup&) {
      check_ops(37);  // 19 + 18 rows at world 2, 13 + 13 + 11 at world 3
      check_ops(2);   // world 3: one row each for two ranks, none for the third
    });
  }
}

TEST(VocabParallel, ShardedOpsMatchOneProcessMpi2) {
  fsdp::testing::run_ranks(2, "mpi", [](fsdp::ProcessGroup&) { check_ops(37); });
}

TEST(VocabParallel, NeedsAShardGroupOfTwoRanks) {
  fsdp::ShardContext ctx;  // no group
  at::Tensor ws = at::zeros({4, kWidth});
  const std::string err = fsdp::testing::error_of([&] {
    fsdp::sharded_embedding(at::zeros({3}, at::kLong), param_shard(ws, 4, 0), ctx);
  });
  EXPECT_NE(err.find("needs a shard group of two or more ranks"), std::string::npos) << err;
  fsdp::ShardContext named;
  named.params["weight"] = param_shard(ws, 4, 0);
  const std::string missing = fsdp::testing::error_of([&] { (void)named.param("bias"); });
  EXPECT_NE(missing.find("no parameter 'bias' among the module's shards (weight)"),
            std::string::npos)
      << missing;
}
