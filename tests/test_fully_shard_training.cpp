// Multi-rank parity: every sharding strategy at world 1-4 on Gloo and MPI against a single
// process on the same global batch (dropout 0). Per-step losses within 1e-5 relative, gathered
// parameters within 1e-5 after 10 steps. Plus the cases that break naive versions: clipping,
// accumulation, frozen parameters / inputs without grad, a unit called twice, prefetch modes.
#include "fully_shard_common.h"
#include "shard/fsdp_strategy_impl.h"
#include "testing.h"

#include <gtest/gtest.h>

using fsdp::testing::LoopConfig;
using fsdp::testing::TinyLM;

namespace {

fsdp::FSDPOptions layer_wrapped(fsdp::ShardingStrategy ss, const std::string& model = "transformer-tiny") {
  fsdp::FSDPOptions o;
  o.sharding_strategy = ss;
  o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types(model));
  return o;
}

// Trains TinyLM (as configured by `setup`) with FSDP on this rank and the reference in-process,
// then compares losses and gathered parameters.
void check_parity(const fsdp::FSDPOptions& options, const LoopConfig& cfg,
                  const std::function<void(TinyLM&)>& setup = {}, double tol = 1e-5) {
  SCOPED_TRACE(std::string("sharding ") + fsdp::to_string(options.sharding_strategy));
  TinyLM ref;
  if (setup) setup(ref);
  auto want = fsdp::testing::train_reference(ref, cfg);

  auto world = fsdp::world_group();
  ASSERT_TRUE(world);
  TinyLM lm;
  if (setup) setup(lm);
  fsdp::FSDPStrategy strategy(options);
  fsdp::LaunchInfo launch;
  launch.rank = world->rank();
  launch.world_size = world->size();
  launch.local_world_size = world->size();
  strategy.connect(world, launch);
  auto got = fsdp::testing::train_with(strategy, lm, cfg);
  fsdp::testing::expect_losses_close(got, want, tol);
  fsdp::testing::expect_params_close(strategy.gather_full_params(), ref, tol);
  // Sharded representation: module.parameters() are this rank's shards.
  const int shard = options.sharding_strategy == fsdp::ShardingStrategy::kNoShard ? 1
                    : (options.hybrid_shard_size > 0 ? options.hybrid_shard_size : world->size());
  int64_t local = 0, full = 0;
  for (auto& p : lm.parameters()) local += p.numel();
  for (auto& p : ref.parameters()) full += p.numel();
  EXPECT_LE(local, full / shard + 64 * 64) << "parameters() are not sharded";
}

void parity_all_strategies(int world_size, const std::string& backend) {
  fsdp::testing::run_ranks(world_size, backend, [&](fsdp::ProcessGroup&) {
    LoopConfig cfg;  // 10 steps, global batch 12
    for (auto ss : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                    fsdp::ShardingStrategy::kNoShard}) {
      check_parity(layer_wrapped(ss), cfg);
    }
    if (world_size == 4) {
      for (auto ss : {fsdp::ShardingStrategy::kHybridShard, fsdp::ShardingStrategy::kHybridShardZero2}) {
        auto o = layer_wrapped(ss);
        o.hybrid_shard_size = 2;  // 2 x 2
        check_parity(o, cfg);
      }
    }
  });
}

}  // namespace

TEST(FullyShardTraining, ParityGlooWorld1) { parity_all_strategies(1, "gloo"); }
TEST(FullyShardTraining, ParityGlooWorld2) { parity_all_strategies(2, "gloo"); }
TEST(FullyShardTraining, ParityGlooWorld3) { parity_all_strategies(3, "gloo"); }
TEST(FullyShardTraining, ParityGlooWorld4) { parity_all_strategies(4, "gloo"); }
TEST(FullyShardTraining, ParityMpiWorld2) { parity_all_strategies(2, "mpi"); }
TEST(FullyShardTraining, ParityMpiWorld3) { parity_all_strategies(3, "mpi"); }
TEST(FullyShardTraining, ParityMpiWorld4) { parity_all_strategies(4, "mpi"); }

TEST(FullyShardTraining, ClippingAndParameterGroupsWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup&) {
    LoopConfig cfg;
    cfg.clip = 0.05;  // small enough that every step clips
    check_parity(layer_wrapped(fsdp::ShardingStrategy::kFullShard), cfg,
                 [](TinyLM& m) { m.optimizer = "adamw"; });
    check_parity(layer_wrapped(fsdp::ShardingStrategy::kShardGradOp), cfg,
                 [](TinyLM& m) { m.optimizer = "sgd"; m.lr = 0.05; });
  });
}

TEST(FullyShardTraining, GradientAccumulationWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    LoopConfig cfg;
    cfg.accumulate = 3;
    cfg.steps = 6;
    for (auto ss : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                    fsdp::ShardingStrategy::kNoShard}) {
      check_parity(layer_wrapped(ss), cfg);
    }
  });
}

// Frozen embedding: the first encoder and decoder layers get inputs that need no grad (their
// post-backward runs from the end-of-backward callback) and the frozen parameters get no
// gradient traffic.
TEST(FullyShardTraining, FrozenParametersAndInputsWithoutGradWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup&) {
    LoopConfig cfg;
    cfg.steps = 5;
    auto frozen = [](TinyLM& m) { m.freeze_embedding = true; };
    check_parity(layer_wrapped(fsdp::ShardingStrategy::kFullShard), cfg, frozen);
    // The frozen embedding lives in the root unit: wrap it alone so a whole unit is frozen.
    auto o = layer_wrapped(fsdp::ShardingStrategy::kFullShard);
    TinyLM probe;
    frozen(probe);
    fsdp::FSDPStrategy strategy(o);
    strategy.connect(fsdp::world_group(), {});
    fsdp::configure_model_with(strategy, probe);
    strategy.setup_module(probe);
    auto reduce_bytes_before = fsdp::detail::state_of(strategy).shard_group()->counters().reduce_scatter_bytes;
    int64_t trainable_shard = 0, frozen_shard = 0;
    for (auto* p : fsdp::detail::state_of(strategy).all_params()) {
      (p->requires_grad() ? trainable_shard : frozen_shard) += p->padded_numel();
      EXPECT_EQ(p->sharded().requires_grad(), p->requires_grad()) << p->fqn();
    }
    ASSERT_GT(frozen_shard, 0);
    // One step: the reduce-scatter moves exactly the trainable parameters (padded), fp32.
    auto opt = probe.configure_optimizers().optimizer;
    strategy.pre_forward(probe, true);
    auto loss = probe.training_step(fsdp::testing::global_batch(0, 3), 0);
    strategy.backward(loss);
    strategy.post_backward(probe, true);
    EXPECT_EQ(fsdp::detail::state_of(strategy).shard_group()->counters().reduce_scatter_bytes - reduce_bytes_before,
              trainable_shard * 4);
    for (auto* p : fsdp::detail::state_of(strategy).all_params()) {
      EXPECT_EQ(p->sharded().grad().defined(), p->requires_grad()) << p->fqn();
    }
  });
}

TEST(FullyShardTraining, PrefetchModesKeepParityWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup&) {
    LoopConfig cfg;
    cfg.steps = 4;
    auto o = layer_wrapped(fsdp::ShardingStrategy::kFullShard);
    o.forward_prefetch = true;
    o.backward_prefetch = fsdp::BackwardPrefetch::kPost;
    check_parity(o, cfg);
    o.backward_prefetch = fsdp::BackwardPrefetch::kNone;
    o.limit_all_gathers = true;
    check_parity(o, cfg);
    o.backward_prefetch = fsdp::BackwardPrefetch::kPre;
    o.sharding_strategy = fsdp::ShardingStrategy::kShardGradOp;
    check_parity(o, cfg);
  });
}

// Prefetches really are issued from the recorded order, and limit_all_gathers really skips
// them when two units are already unsharded (SHARD_GRAD_OP keeps every unit unsharded).
TEST(FullyShardTraining, PrefetchIsIssuedAndLimitedWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    auto count = [](fsdp::FSDPOptions o) {
      TinyLM lm;
      fsdp::FSDPStrategy strategy(o);
      strategy.connect(fsdp::world_group(), {});
      LoopConfig cfg;
      cfg.steps = 3;
      fsdp::testing::train_with(strategy, lm, cfg);
      EXPECT_EQ(fsdp::detail::state_of(strategy).forward_order().size(), 4u);  // 2 encoder + 2 decoder layers
      return std::make_pair(fsdp::detail::state_of(strategy).num_prefetches(),
                            fsdp::detail::state_of(strategy).num_prefetches_limited());
    };
    auto o = layer_wrapped(fsdp::ShardingStrategy::kFullShard);
    o.backward_prefetch = fsdp::BackwardPrefetch::kNone;
    EXPECT_EQ(count(o).first, 0);
    o.forward_prefetch = true;
    // From step 2 on: 3 forward prefetches per step (units 2..4).
    EXPECT_EQ(count(o).first, 2 * 3);
    o.forward_prefetch = false;
    o.backward_prefetch = fsdp::BackwardPrefetch::kPre;
    EXPECT_GT(count(o).first, 0);
    auto sgo = layer_wrapped(fsdp::ShardingStrategy::kShardGradOp);
    sgo.forward_prefetch = true;
    sgo.limit_all_gathers = true;
    auto [issued, limited] = count(sgo);
    EXPECT_GT(limited, 0);
  });
}

TEST(FullyShardTraining, SizeBasedWrapAndRootOnlyWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    LoopConfig cfg;
    cfg.steps = 4;
    fsdp::FSDPOptions o;
    o.auto_wrap_policy = fsdp::AutoWrapPolicy::size_based(3000);
    check_parity(o, cfg);
    check_parity(fsdp::FSDPOptions{}, cfg);  // no policy: everything in the root unit
    check_parity(layer_wrapped(fsdp::ShardingStrategy::kFullShard, "gpt2-tiny"), cfg,
                 [](TinyLM& m) { m.model_name = "gpt2-tiny"; });
  });
}

// --- the vocabulary as units, the loss in chunks ----------------------------------------------

// The embedding and the head are units of their own (the tied gpt2-tiny wte one unit called
// twice, as is transformer-tiny's embedding), trained with the chunked loss, against the
// single-process reference on the plain path (whole logits, nll_loss): computing on their
// shards (the default, fsdp/sharded_compute.h) and gathered as any unit. kVocab 64 over 3 ranks
// leaves the last rank 20 real rows of 22 (padding). One more run takes all logits through the
// head (forward, the gathered-matrix path) instead of the loss.
void vocab_units_parity(int world_size, const std::string& backend) {
  fsdp::testing::run_ranks(world_size, backend, [&](fsdp::ProcessGroup&) {
    struct Run {
      fsdp::ShardingStrategy ss;
      bool on_shards;
      bool vocab_loss;
    };
    const std::vector<Run> runs = {{fsdp::ShardingStrategy::kFullShard, true, true},
                                   {fsdp::ShardingStrategy::kFullShard, false, true},
                                   {fsdp::ShardingStrategy::kShardGradOp, true, true},
                                   {fsdp::ShardingStrategy::kShardGradOp, false, true},
                                   {fsdp::ShardingStrategy::kFullShard, true, false}};
    for (const std::string model : {"transformer-tiny", "gpt2-tiny"}) {
      std::map<bool, int64_t> gathered_bytes;  // FULL_SHARD with the loss: on shards or not
      for (const Run& run : runs) {
        SCOPED_TRACE(model + " " + fsdp::to_string(run.ss) + (run.on_shards ? " on shards" : " gathered") +
                     (run.vocab_loss ? "" : ", all logits"));
        LoopConfig cfg;
        cfg.steps = 6;
        TinyLM ref;
        ref.model_name = model;
        auto want = fsdp::testing::train_reference(ref, cfg);

        TinyLM lm;
        lm.model_name = model;
        lm.vocab_loss = run.vocab_loss;  // kVocab 64 > width 32: two chunks per rank's tokens
        lm.after_build = [&](TinyLM& m) {
          fsdp::demos::set_vocab_compute_on_shards(*m.model, run.on_shards);
        };
        fsdp::FSDPOptions o;
        o.sharding_strategy = run.ss;
        o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::unit_types(model));
        fsdp::FSDPStrategy strategy(o);
        auto world = fsdp::world_group();
        strategy.connect(world, {});
        world->reset_counters();
        auto got = fsdp::testing::train_with(strategy, lm, cfg);
        if (run.ss == fsdp::ShardingStrategy::kFullShard && run.vocab_loss) {
          gathered_bytes[run.on_shards] = world->counters().all_gather_bytes;
        }
        fsdp::testing::expect_losses_close(got, want, 1e-5);
        fsdp::testing::expect_params_close(strategy.gather_full_params(), ref, 1e-5);

        std::vector<std::string> units, on_shards;
        auto& state = fsdp::detail::state_of(strategy);
        for (auto& u : state.units()) {
          units.push_back(u->name());
          if (state.units_on_shards().count(u.get())) on_shards.push_back(u->name());
        }
        auto has = [&](const std::string& n) {
          return std::find(units.begin(), units.end(), n) != units.end();
        };
        std::vector<std::string> vocab_units = {"model.wte"};
        if (model != "gpt2-tiny") vocab_units = {"model.embedding", "model.decoder"};
        for (const auto& v : vocab_units) EXPECT_TRUE(has(v)) << v;
        EXPECT_EQ(on_shards, run.on_shards ? vocab_units : std::vector<std::string>{});
        // The root unit keeps only what no unit took (norms, position table): no parameter of
        // the vocabulary.
        for (auto& p : state.root_unit().params()) {
          for (const char* vocab : {"model.embedding.", "model.decoder.", "model.wte.", "model.lm_head."}) {
            EXPECT_NE(p->fqn().rfind(vocab, 0), 0u) << p->fqn() << " is in the root unit";
          }
        }
      }
      // On shards the vocabulary matrices are never all-gathered: only the hidden states, ids
      // and the other units' parameters are (64 x 32 matrices, gathered twice a step, against
      // 8 x 12 / world tokens of width 32 a step).
      EXPECT_LT(gathered_bytes[true], gathered_bytes[false]) << model;
    }
  });
}

TEST(FullyShardTraining, VocabUnitsChunkedLossParityGlooWorld2) { vocab_units_parity(2, "gloo"); }
TEST(FullyShardTraining, VocabUnitsChunkedLossParityGlooWorld3) { vocab_units_parity(3, "gloo"); }
TEST(FullyShardTraining, VocabUnitsChunkedLossParityMpiWorld3) { vocab_units_parity(3, "mpi"); }

// --- a unit called twice in one step ---------------------------------------------------------

namespace {

struct Block : fsdp::nn::Module {
  torch::nn::Linear fc{nullptr};
  explicit Block(int64_t d) : fsdp::nn::Module("Block") { fc = register_module("fc", torch::nn::Linear(d, d)); }
  at::Tensor forward(const fsdp::nn::Inputs& in) override { return in[0] + at::tanh(fc(in[0])); }
};

struct TwiceNet : fsdp::LightningModule {
  torch::nn::Embedding emb{nullptr};
  std::shared_ptr<Block> a, b;
  torch::nn::Linear head{nullptr};
  void configure_model() override {
    if (a) return;
    torch::manual_seed(7);
    emb = register_module("emb", torch::nn::Embedding(fsdp::testing::kVocab, 10));
    a = register_module("a", std::make_shared<Block>(10));
    b = register_module("b", std::make_shared<Block>(10));
    head = register_module("head", torch::nn::Linear(10, fsdp::testing::kVocab));
  }
  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor h = emb(batch.input);
    h = (*a)(h);
    h = (*b)(h);
    h = (*a)(h);  // a again: two backward passes through unit a in one step
    at::Tensor logp = at::log_softmax(head(h), -1).reshape({-1, fsdp::testing::kVocab});
    return at::nll_loss(logp, batch.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-2))};
  }
};

}  // namespace

TEST(FullyShardTraining, UnitCalledTwiceWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup&) {
    for (auto ss : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                    fsdp::ShardingStrategy::kNoShard}) {
      SCOPED_TRACE(fsdp::to_string(ss));
      LoopConfig cfg;
      cfg.steps = 5;
      TwiceNet ref;
      auto want = fsdp::testing::train_reference(ref, cfg);
      TwiceNet net;
      fsdp::FSDPOptions o;
      o.sharding_strategy = ss;
      o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::nn::module_types<Block>());
      fsdp::FSDPStrategy strategy(o);
      strategy.connect(fsdp::world_group(), {});
      auto got = fsdp::testing::train_with(strategy, net, cfg);
      fsdp::testing::expect_losses_close(got, want);
      fsdp::testing::expect_params_close(strategy.gather_full_params(), ref);
    }
  });
}
