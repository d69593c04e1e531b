// The sharding engine without a multi-rank world: shard layout (uneven sizes, padding), the
// state machine, wrap policies, tied parameters, option and name parsing, world-1 training.
#include "fully_shard_common.h"
#include "shard/fsdp_param.h"
#include "shard/fsdp_param_group.h"
#include "shard/fsdp_strategy_impl.h"
#include "comm/local_groups.h"
#include "shard/collectives.h"
#include "unit_names.h"

#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <algorithm>

using fsdp::testing::LoopConfig;
using fsdp::testing::TinyLM;

namespace {

// Shards P over a simulated world of W ranks (one FsdpParam per rank), concatenates the shards
// as the all-gather would and copies out into a fresh parameter.
void check_round_trip(std::vector<int64_t> shape, int world) {
  at::Tensor original = at::randn(shape);
  std::vector<at::Tensor> shards;
  torch::nn::Module owner;
  for (int r = 0; r < world; ++r) {
    at::Tensor p = original.clone().set_requires_grad(true);
    torch::nn::Module m;
    m.register_parameter("w", p);
    fsdp::detail::FsdpParam fp(p, {&m, "w", "w"}, r, world);
    fp.shard();
    // The module now exposes the sharded parameter.
    EXPECT_EQ(m.named_parameters()["w"].unsafeGetTensorImpl(), fp.sharded().unsafeGetTensorImpl());
    // World 1: the shard is the parameter itself (nothing freed); else P's storage is freed.
    EXPECT_EQ(p.storage().nbytes(), world == 1 ? p.numel() * 4u : 0u) << "world " << world;
    EXPECT_EQ(fp.sharded().size(0), (fp.dim0() + world - 1) / world);
    shards.push_back(fp.sharded().detach().reshape({-1}));
    if (r == world - 1) {
      // Padding rows (past dim0) are zero.
      const int64_t real = fp.dim0() - r * fp.shard_rows();
      at::Tensor rows = fp.sharded().detach().reshape({fp.shard_rows(), fp.row_numel()});
      if (real < fp.shard_rows()) {
        EXPECT_EQ(rows.narrow(0, std::max<int64_t>(real, 0), fp.shard_rows() - std::max<int64_t>(real, 0)).abs().sum().item<double>(), 0.0);
      }
      // Copy-out from the concatenation restores the full value through P.
      at::Tensor output = at::cat(shards);
      fp.alloc_unsharded();
      fsdp::detail::copy_out(fp, output.view({world, fp.shard_numel()}));
      EXPECT_TRUE(at::equal(p.detach(), original)) << "shape " << original.sizes() << " world " << world;
    }
  }
}

// Names of the FSDP profiler ranges started on this thread, in order.
std::vector<std::string>* g_fsdp_ranges = nullptr;
std::unique_ptr<at::ObserverContext> record_fsdp_range(const at::RecordFunction& fn) {
  const std::string name = fn.name();
  if (g_fsdp_ranges && name.rfind("FSDP::", 0) == 0) g_fsdp_ranges->push_back(name);
  return nullptr;
}

}  // namespace

TEST(FullyShardEngine, ShardLayoutRoundTripsUnevenShapes) {
  for (int world : {1, 2, 3, 4}) {
    check_round_trip({5, 3}, world);
    check_round_trip({7}, world);
    check_round_trip({2, 3, 4}, world);
    check_round_trip({1, 6}, world);  // fewer rows than ranks: some shards are all padding
  }
  check_round_trip({}, 3);  // 0-d parameter viewed as (1,)
}

TEST(FullyShardEngine, GradCopyInIsRankMajorAndPadded) {
  at::Tensor p = at::randn({5, 2}).set_requires_grad(true);
  torch::nn::Module m;
  m.register_parameter("w", p);
  fsdp::detail::FsdpParam fp(p, {&m, "w", "w"}, 0, 3);
  p.mutable_grad() = at::arange(10, at::kFloat).view({5, 2});
  // Not pre-zeroed: copy_grad_in writes every element, padding rows as zeros.
  at::Tensor buf = at::full({3, fp.shard_numel()}, 7.f);
  fsdp::detail::copy_grad_in(fp, buf);
  // R = 2 rows per rank: rank 0 rows 0-1, rank 1 rows 2-3, rank 2 row 4 + one zero row.
  EXPECT_TRUE(at::equal(buf[0], at::tensor({0.f, 1.f, 2.f, 3.f})));
  EXPECT_TRUE(at::equal(buf[1], at::tensor({4.f, 5.f, 6.f, 7.f})));
  EXPECT_TRUE(at::equal(buf[2], at::tensor({8.f, 9.f, 0.f, 0.f})));
}

TEST(FullyShardEngine, WrongStateTransitionTripsInternalAssert) {
  auto lin = torch::nn::Linear(4, 4);
  fsdp::detail::FsdpState state({}, fsdp::detail::make_single_rank_group(0), nullptr);
  state.build(*lin, {});
  state.materialize();
  auto& root = state.root_unit();
  EXPECT_EQ(root.sharded_state(), fsdp::detail::ShardedState::kSharded);
  // kSharded -> kSharded (reshard twice) is not a transition.
  EXPECT_THROW(root.reshard(fsdp::detail::ShardedState::kSharded), c10::Error);
  root.unshard();
  EXPECT_EQ(root.sharded_state(), fsdp::detail::ShardedState::kUnsharded);
  // kUnsharded -> kUnsharded
  EXPECT_THROW(root.transition(fsdp::detail::ShardedState::kUnsharded), c10::Error);
  root.reshard(fsdp::detail::ShardedState::kReshardedAfterForward);
  // kReshardedAfterForward -> kReshardedAfterForward
  EXPECT_THROW(root.transition(fsdp::detail::ShardedState::kReshardedAfterForward), c10::Error);
  root.mark_at_rest();
  EXPECT_EQ(root.sharded_state(), fsdp::detail::ShardedState::kSharded);
}

TEST(FullyShardEngine, TiedParametersAcrossUnitsAreAClearError) {
  TinyLM lm;
  lm.configure_model();
  auto* tf = dynamic_cast<fsdp::demos::Transformer*>(lm.model.get());
  ASSERT_NE(tf, nullptr);
  // Tie encoder layer 0's linear1 weight to decoder layer 0's linear1 weight (same shape).
  auto& dec_params = fsdp::detail::registered_parameters(*tf->decoder_layers[0]->linear1);
  dec_params["weight"] = tf->encoder_layers[0]->linear1->weight;
  tf->decoder_layers[0]->linear1->weight = tf->encoder_layers[0]->linear1->weight;

  fsdp::FSDPOptions opts;
  opts.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  fsdp::FSDPStrategy strategy(opts);
  strategy.connect(nullptr, {});
  try {
    strategy.setup_module(lm);
    FAIL() << "tied parameters across units were accepted";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("encoder.layers.0.linear1.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("decoder.layers.0.linear1.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("one unit"), std::string::npos) << msg;
  }
}

TEST(FullyShardEngine, TiedParametersInsideOneUnitShareOneShard) {
  // gpt2-tiny ties the lm head to wte (registered once); add a second registration by hand in
  // the root unit: both names must expose the same sharded parameter.
  TinyLM lm;
  lm.model_name = "gpt2-tiny";
  lm.configure_model();
  auto* gpt = dynamic_cast<fsdp::demos::GPT*>(lm.model.get());
  ASSERT_NE(gpt, nullptr);
  fsdp::detail::registered_parameters(*gpt->wpe).insert("alias", gpt->wte->weight);
  fsdp::FSDPStrategy strategy;
  strategy.connect(nullptr, {});
  strategy.setup_module(lm);
  auto params = lm.named_parameters();
  EXPECT_EQ(params["model.wte.weight"].unsafeGetTensorImpl(),
            params["model.wpe.alias"].unsafeGetTensorImpl());
}

TEST(FullyShardEngine, WrapPoliciesSelectUnits) {
  auto count_units = [](fsdp::AutoWrapPolicy policy, const std::string& model) {
    TinyLM lm;
    lm.model_name = model;
    return fsdp::testing::unit_names(lm, std::move(policy));
  };
  auto types = count_units(fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny")),
                           "transformer-tiny");
  ASSERT_EQ(types.size(), 5u);  // root + 2 encoder + 2 decoder layers
  EXPECT_EQ(types[0], "<root>");
  EXPECT_NE(types[1].find("encoder.layers.0"), std::string::npos) << types[1];
  EXPECT_EQ(count_units(fsdp::AutoWrapPolicy::none(), "transformer-tiny").size(), 1u);
  // Size-based: every attention block (3*32*32 + ... > 4000 elements) and then layers with
  // enough left over.
  auto sized = count_units(fsdp::AutoWrapPolicy::size_based(4000), "transformer-tiny");
  EXPECT_GT(sized.size(), 1u);
  auto gpt = count_units(
      fsdp::AutoWrapPolicy::of_predicate([](const torch::nn::Module& m, int64_t) {
        return dynamic_cast<const fsdp::demos::GPTBlock*>(&m) != nullptr;
      }),
      "gpt2-tiny");
  EXPECT_EQ(gpt.size(), 3u);  // root + 2 blocks
}

TEST(FullyShardEngine, ManualWrapIsUsedAndPolicyIgnored) {
  TinyLM lm;
  lm.after_build = [](TinyLM& m) {
    auto* tf = dynamic_cast<fsdp::demos::Transformer*>(m.model.get());
    fsdp::wrap(tf->encoder_layers[1]);
  };
  fsdp::FSDPOptions opts;
  opts.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  fsdp::FSDPStrategy strategy(opts);
  strategy.connect(nullptr, {});
  fsdp::configure_model_with(strategy, lm);
  strategy.setup_module(lm);
  ASSERT_EQ(fsdp::detail::state_of(strategy).units().size(), 2u);
  EXPECT_NE(fsdp::detail::state_of(strategy).units()[1]->name().find("encoder.layers.1"), std::string::npos);

  // Outside an FSDP strategy, wrap is a no-op.
  TinyLM other;
  other.after_build = lm.after_build;
  EXPECT_NO_THROW(other.configure_model());
}

TEST(FullyShardEngine, NamesAndOptionsParseInOnePlace) {
  EXPECT_EQ(fsdp::parse_sharding_strategy("FULL_SHARD"), fsdp::ShardingStrategy::kFullShard);
  EXPECT_EQ(fsdp::parse_sharding_strategy("shard_grad_op"), fsdp::ShardingStrategy::kShardGradOp);
  EXPECT_EQ(fsdp::parse_sharding_strategy("HYBRID_SHARD_ZERO2"),
            fsdp::ShardingStrategy::kHybridShardZero2);
  try {
    fsdp::parse_sharding_strategy("FULLSHARD");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("SHARD_GRAD_OP"), std::string::npos);
  }
  EXPECT_EQ(fsdp::make_fsdp_strategy("fsdp")->options().sharding_strategy,
            fsdp::ShardingStrategy::kFullShard);
  EXPECT_EQ(fsdp::make_fsdp_strategy("fsdp_no_shard")->options().sharding_strategy,
            fsdp::ShardingStrategy::kNoShard);
  EXPECT_EQ(fsdp::make_fsdp_strategy("fsdp_hybrid_shard_zero2")->options().sharding_strategy,
            fsdp::ShardingStrategy::kHybridShardZero2);
  try {
    fsdp::make_fsdp_strategy("fsdp_zero3");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp_shard_grad_op"), std::string::npos);
  }
  EXPECT_EQ(fsdp::parse_backward_prefetch("post"), fsdp::BackwardPrefetch::kPost);
  EXPECT_THROW(fsdp::parse_backward_prefetch("later"), c10::Error);

  fsdp::FSDPOptions mp;  // a MixedPrecisionPolicy dtype must be floating
  mp.mixed_precision = fsdp::MixedPrecisionPolicy{};
  mp.mixed_precision->param_dtype = at::kInt;
  try {
    fsdp::FSDPStrategy s(mp);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("param_dtype must be a floating dtype"), std::string::npos);
  }
  fsdp::FSDPOptions off;  // the identity on a CPU device (said at setup)
  off.offload_policy = fsdp::OffloadPolicy::cpu();
  EXPECT_NO_THROW(fsdp::FSDPStrategy{off});
  fsdp::FSDPOptions sd;  // not implemented here: the error names where sharded checkpoints are
  sd.state_dict_type = "sharded";
  try {
    fsdp::FSDPStrategy s(sd);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not implemented"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("TrainerOptions::state_dict_type"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("--state-dict-type sharded"), std::string::npos)
        << e.what();
  }
}

// World 1 with `opts` (wrapped by transformer-tiny's layers) trains `steps` steps exactly as
// plain libtorch does: the same losses and final parameters.
namespace {

void expect_world_one_matches_plain(fsdp::FSDPOptions opts, int steps) {
  LoopConfig cfg;
  cfg.steps = steps;
  TinyLM ref;
  auto want = fsdp::testing::train_reference(ref, cfg);
  TinyLM lm;
  opts.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  fsdp::FSDPStrategy strategy(opts);
  strategy.connect(nullptr, {});
  auto got = fsdp::testing::train_with(strategy, lm, cfg);
  fsdp::testing::expect_losses_close(got, want, 1e-6);
  fsdp::testing::expect_params_close(strategy.gather_full_params(), ref, 1e-6);
  for (const auto& p : lm.parameters()) EXPECT_TRUE(p.device().is_cpu());
}

}  // namespace

// World 1: the shard is the whole parameter; training must match plain libtorch exactly.
TEST(FullyShardEngine, WorldOneMatchesPlainTraining) {
  for (auto ss : {fsdp::ShardingStrategy::kFullShard, fsdp::ShardingStrategy::kShardGradOp,
                  fsdp::ShardingStrategy::kNoShard}) {
    fsdp::FSDPOptions opts;
    opts.sharding_strategy = ss;
    expect_world_one_matches_plain(opts, 4);
  }
}

// offload_policy cpu on a CPU device is the identity: the same losses and parameters as
// without it.
TEST(FullyShardEngine, CpuOffloadIsTheIdentityOnCpu) {
  fsdp::FSDPOptions opts;
  opts.offload_policy = fsdp::OffloadPolicy::cpu();
  expect_world_one_matches_plain(opts, 3);
}

// A trace of one step shows the hooks and collectives as profiler ranges (RECORD_FUNCTION), in
// the order of docs/design.md "One FULL_SHARD step".
TEST(FullyShardEngine, StepShowsAsProfilerRanges) {
  TinyLM lm;
  fsdp::FSDPOptions opts;
  opts.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-tiny"));
  // World 1 with a bf16 param_dtype: P is not S, so the units really gather (a local cast
  // through the one-rank group) and reduce-scatter.
  opts.mixed_precision = fsdp::MixedPrecisionPolicy{at::kBFloat16, at::kFloat, std::nullopt};
  fsdp::FSDPStrategy strategy(opts);
  strategy.connect(nullptr, {});
  LoopConfig cfg;
  cfg.steps = 1;
  std::vector<std::string> ranges;
  g_fsdp_ranges = &ranges;
  const auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(record_fsdp_range).scopes({at::RecordScope::FUNCTION}));
  fsdp::testing::train_with(strategy, lm, cfg);
  at::removeCallback(handle);
  g_fsdp_ranges = nullptr;

  auto first = [&](const std::string& name) {
    return std::find(ranges.begin(), ranges.end(), name) - ranges.begin();
  };
  auto last = [&](const std::string& name) {
    return ranges.rend() - std::find(ranges.rbegin(), ranges.rend(), name) - 1;
  };
  auto count = [&](const std::string& name) { return std::count(ranges.begin(), ranges.end(), name); };
  const int64_t n = static_cast<int64_t>(ranges.size());
  for (const char* name : {"FSDP::root_pre_forward", "FSDP::pre_forward", "FSDP::post_forward",
                           "FSDP::backward", "FSDP::pre_backward", "FSDP::post_backward",
                           "FSDP::root_post_backward", "FSDP::finish_step", "FSDP::all_gather",
                           "FSDP::all_gather_copy_out", "FSDP::reduce_scatter",
                           "FSDP::reduce_scatter_copy_out"}) {
    EXPECT_LT(first(name), n) << name << " missing from the trace";
  }
  ASSERT_FALSE(ranges.empty());
  EXPECT_EQ(ranges.front(), "FSDP::root_pre_forward");
  // Four units (2 encoder + 2 decoder layers): each runs its forward and backward hooks once.
  EXPECT_EQ(count("FSDP::pre_forward"), 4);
  EXPECT_EQ(count("FSDP::post_forward"), 4);
  EXPECT_EQ(count("FSDP::pre_backward"), 4);
  EXPECT_LT(first("FSDP::pre_forward"), first("FSDP::post_forward"));
  EXPECT_LT(last("FSDP::post_forward"), first("FSDP::backward"));
  EXPECT_LT(first("FSDP::backward"), first("FSDP::pre_backward"));
  EXPECT_LT(first("FSDP::pre_backward"), first("FSDP::post_backward"));
  EXPECT_LT(first("FSDP::post_backward"), first("FSDP::reduce_scatter"));
  EXPECT_LT(last("FSDP::pre_backward"), first("FSDP::root_post_backward"));
  EXPECT_LT(first("FSDP::root_post_backward"), first("FSDP::finish_step"));
}
