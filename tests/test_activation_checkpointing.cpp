// Activation checkpointing (fsdp/activation_checkpointing.h): gradients and RNG stream equal to
// the plain model with dropout on, non-tensor/undefined inputs and inputs without grad, peak
// activation memory, idempotence, and FULL_SHARD / DDP parity at world 2 and 3 on Gloo.
#include "fully_shard_common.h"
#include "testing.h"

#include "fsdp/activation_checkpointing.h"
#include "fsdp/ddp.h"
#include "fsdp/memory.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>

using fsdp::testing::LoopConfig;
using fsdp::testing::TinyLM;

namespace {

at::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

std::shared_ptr<fsdp::nn::Module> tiny_model(double dropout, uint64_t seed = 1234) {
  torch::manual_seed(seed);
  return fsdp::demos::make_model("transformer-tiny", fsdp::testing::kVocab, dropout);
}

// One forward+backward on a fixed batch with the RNG seeded to `seed` before the forward.
// Returns the loss; gradients are left in the parameters.
double step(fsdp::nn::Module& model, uint64_t seed) {
  fsdp::Batch b = fsdp::testing::global_batch(0, 6);
  torch::manual_seed(seed);
  at::Tensor loss = at::nll_loss(model(b.input, b.target), b.target.reshape(-1));
  loss.backward();
  return loss.item<double>();
}

// Max |a.grad - b.grad| over same-named parameters, and whether every gradient is bitwise
// equal. Fails when a gradient is missing on one side only.
std::pair<double, bool> grad_diff(torch::nn::Module& a, torch::nn::Module& b) {
  auto pb = b.named_parameters();
  double max_diff = 0;
  bool bitwise = true;
  for (auto& p : a.named_parameters()) {
    const at::Tensor& ga = p.value().grad();
    const at::Tensor& gb = pb[p.key()].grad();
    EXPECT_EQ(ga.defined(), gb.defined()) << p.key();
    if (!ga.defined() || !gb.defined()) continue;
    max_diff = std::max(max_diff, (ga - gb).abs().max().item<double>());
    bitwise = bitwise && at::equal(ga, gb);
  }
  return {max_diff, bitwise};
}

TEST(ActivationCheckpointing, GradientsAndRngMatchThePlainModelWithDropout) {
  auto plain = tiny_model(0.2);
  auto ckpt = tiny_model(0.2);
  const auto types = fsdp::demos::layer_types("transformer-tiny");
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*ckpt, types), 4);  // 2 encoder + 2 decoder

  const double want = step(*plain, 7);
  const at::Tensor rng_plain = cpu_rng_state();
  const double got = step(*ckpt, 7);
  const at::Tensor rng_ckpt = cpu_rng_state();
  EXPECT_EQ(got, want) << "forward with the same seed must be bitwise equal";
  // The recompute swaps the saved RNG state in and the current one back: the stream continues
  // exactly where the plain model leaves it.
  EXPECT_TRUE(at::equal(rng_plain, rng_ckpt)) << "RNG state after the step differs";

  auto [max_diff, bitwise] = grad_diff(*ckpt, *plain);
  std::printf("[activation checkpointing] tiny transformer, dropout 0.2: max |grad diff| %.3g "
              "(bitwise %s)\n",
              max_diff, bitwise ? "equal" : "not equal");
  EXPECT_LE(max_diff, 1e-6);

  // Dropout really is on: another seed gives another loss (so equal masks were not luck).
  plain->zero_grad();
  EXPECT_NE(step(*plain, 8), want);
}

// Dropout inside at::scaled_dot_product_attention (the SDPA kernel pinned in every attention
// module; kAuto never picks it with dropout, see Note [Attention kernel]) draws from the same
// CPU generator, so the recompute reproduces it: gradients bitwise equal to the plain model's.
TEST(ActivationCheckpointing, SdpaDropoutIsReproducedBitwiseByTheRecompute) {
  auto pin_sdpa = [](torch::nn::Module& model) {
    int pinned = 0;
    for (auto& m : model.modules()) {
      if (auto* mha = dynamic_cast<fsdp::demos::MultiheadAttention*>(m.get())) {
        mha->kernel = fsdp::demos::AttentionKernel::kSdpa;
        ++pinned;
      }
    }
    return pinned;
  };
  auto plain = tiny_model(0.2);
  auto ckpt = tiny_model(0.2);
  EXPECT_EQ(pin_sdpa(*plain), 6);  // 2 encoder self, 2 decoder self, 2 decoder cross
  pin_sdpa(*ckpt);
  fsdp::apply_activation_checkpointing(*ckpt, fsdp::demos::layer_types("transformer-tiny"));
  const double want = step(*plain, 7);
  const double got = step(*ckpt, 7);
  EXPECT_EQ(got, want);
  auto [max_diff, bitwise] = grad_diff(*ckpt, *plain);
  EXPECT_TRUE(bitwise) << "max |grad diff| " << max_diff;
  plain->zero_grad();
  EXPECT_NE(step(*plain, 8), want) << "dropout must be on";
}

TEST(ActivationCheckpointing, RecomputeUsesTheSavedRngEvenWhenTheStreamMovedOn) {
  auto plain = tiny_model(0.5);
  auto ckpt = tiny_model(0.5);
  fsdp::apply_activation_checkpointing(*ckpt, fsdp::demos::layer_types("transformer-tiny"));
  fsdp::Batch b = fsdp::testing::global_batch(1, 4);
  torch::manual_seed(3);
  at::Tensor lp = at::nll_loss((*plain)(b.input, b.target), b.target.reshape(-1));
  torch::manual_seed(3);
  at::Tensor lc = at::nll_loss((*ckpt)(b.input, b.target), b.target.reshape(-1));
  // Draw between forward and backward: without the saved state the masks would differ.
  torch::manual_seed(99);
  (void)at::rand({1000});
  const at::Tensor before_backward = cpu_rng_state();
  lp.backward();
  lc.backward();
  EXPECT_TRUE(at::equal(before_backward, cpu_rng_state())) << "backward moved the RNG stream";
  EXPECT_LE(grad_diff(*ckpt, *plain).first, 1e-6);
}

// bf16-mixed outside FSDP is CPU autocast around forward; backward runs outside it. The
// recompute must run under the autocast state of the original forward.
TEST(ActivationCheckpointing, RecomputeRunsUnderTheForwardsAutocastState) {
  auto plain = tiny_model(0.1);
  auto ckpt = tiny_model(0.1);
  fsdp::apply_activation_checkpointing(*ckpt, fsdp::demos::layer_types("transformer-tiny"));
  fsdp::Batch b = fsdp::testing::global_batch(2, 4);
  auto forward_autocast = [&](fsdp::nn::Module& m) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    at::autocast::increment_nesting();
    torch::manual_seed(21);
    at::Tensor loss = at::nll_loss(m(b.input, b.target), b.target.reshape(-1));
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(at::kCPU, false);
    return loss;
  };
  at::Tensor lp = forward_autocast(*plain);
  at::Tensor lc = forward_autocast(*ckpt);
  EXPECT_EQ(lp.item<double>(), lc.item<double>());
  lp.backward();
  lc.backward();
  EXPECT_FALSE(at::autocast::is_autocast_enabled(at::kCPU)) << "the recompute left autocast on";
  EXPECT_LE(grad_diff(*ckpt, *plain).first, 1e-6);
}

// A block whose inputs need no grad and whose optional inputs are undefined tensors.
TEST(ActivationCheckpointing, InputsWithoutGradUndefinedMasksAndEval) {
  torch::manual_seed(5);
  auto plain = std::make_shared<fsdp::demos::EncoderLayer>(16, 2, 32, 0.1);
  torch::manual_seed(5);
  auto ckpt = std::make_shared<fsdp::demos::EncoderLayer>(16, 2, 32, 0.1);
  fsdp::checkpoint_module(*ckpt);
  ASSERT_TRUE(fsdp::is_activation_checkpointed(*ckpt));
  const at::Tensor x = at::randn({3, 5, 16});  // requires_grad false
  for (bool with_mask : {false, true}) {
    SCOPED_TRACE(with_mask ? "causal mask" : "no mask (undefined tensor)");
    const at::Tensor mask = with_mask ? fsdp::demos::causal_mask(5) : at::Tensor();
    plain->zero_grad();
    ckpt->zero_grad();
    torch::manual_seed(11);
    at::Tensor yp = (*plain)(x, mask);
    torch::manual_seed(11);
    at::Tensor yc = (*ckpt)(x, mask);
    ASSERT_TRUE(yc.requires_grad()) << "parameters must still get gradients";
    EXPECT_TRUE(at::equal(yp, yc));
    yp.pow(2).sum().backward();
    yc.pow(2).sum().backward();
    auto [max_diff, bitwise] = grad_diff(*ckpt, *plain);
    EXPECT_LE(max_diff, 1e-6);
    (void)bitwise;
  }
  // Input gradients flow through the checkpointed block.
  at::Tensor xp = x.clone().requires_grad_(true), xc = x.clone().requires_grad_(true);
  torch::manual_seed(12);
  (*plain)(xp, at::Tensor()).sum().backward();
  torch::manual_seed(12);
  (*ckpt)(xc, at::Tensor()).sum().backward();
  ASSERT_TRUE(xc.grad().defined());
  EXPECT_LE((xp.grad() - xc.grad()).abs().max().item<double>(), 1e-6);
  // Under no-grad (evaluation) the wrapper just runs forward.
  at::NoGradGuard no_grad;
  ckpt->eval();
  plain->eval();
  EXPECT_TRUE(at::equal((*plain)(x, at::Tensor()), (*ckpt)(x, at::Tensor())));
}

TEST(ActivationCheckpointing, NotAppliedTwiceAndOtherWrappersAreRefused) {
  auto model = tiny_model(0.0);
  const auto types = fsdp::demos::layer_types("transformer-tiny");
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*model, types), 4);
  EXPECT_EQ(fsdp::apply_activation_checkpointing(*model, types), 0);
  EXPECT_EQ(fsdp::count_activation_checkpointed(*model), 4);
  // Predicate form.
  auto other = tiny_model(0.0);
  EXPECT_EQ(fsdp::apply_activation_checkpointing(
                *other, [](const fsdp::nn::Module& m) {
                  return dynamic_cast<const fsdp::demos::MultiheadAttention*>(&m) != nullptr;
                }),
            6);  // 2 encoder self-attn, 2 x (self + cross) decoder
  // A module with a forward wrapper that is not ours.
  auto layer = std::make_shared<fsdp::demos::EncoderLayer>(8, 2, 16, 0.0);
  layer->set_forward_wrapper(
      [](fsdp::nn::Module& m, const fsdp::nn::Inputs& in) { return m.forward(in); });
  EXPECT_FALSE(fsdp::is_activation_checkpointed(*layer));
  try {
    fsdp::checkpoint_module(*layer);
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("already has a forward wrapper"), std::string::npos)
        << e.what();
  }
}

// Peak tensor bytes of one forward+backward above what was allocated before it.
int64_t step_peak(bool checkpointed) {
  fsdp::demos::TransformerOptions o;
  o.vocab_size = 64;
  o.ninp = 64;
  o.nhead = 4;
  o.nhid = 256;
  o.nlayers = 4;
  o.dropout = 0.1;
  torch::manual_seed(1);
  auto model = std::make_shared<fsdp::demos::Transformer>(o);
  if (checkpointed) {
    fsdp::apply_activation_checkpointing(*model,
                                         fsdp::nn::module_types<fsdp::demos::EncoderLayer,
                                                                fsdp::demos::DecoderLayer>());
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor input = at::randint(64, {16, 64}, gen, at::kLong);
  const at::Tensor target = at::randint(64, {16, 64}, gen, at::kLong);
  // Gradients are allocated by the step in both runs; count them in (same bytes either way).
  const int64_t before = fsdp::memory_stats().current_bytes;
  fsdp::reset_peak_memory_stats();
  {
    at::Tensor loss = at::nll_loss((*model)(input, target), target.reshape(-1));
    loss.backward();
  }
  return fsdp::memory_stats().peak_bytes - before;
}

TEST(ActivationCheckpointing, PeakActivationMemoryDrops) {
  fsdp::install_tracking_allocator();
  ASSERT_TRUE(fsdp::tracking_allocator_installed());
  const int64_t plain = step_peak(false);
  const int64_t ckpt = step_peak(true);
  const double ratio = static_cast<double>(ckpt) / static_cast<double>(plain);
  std::printf("[activation checkpointing] peak bytes of forward+backward (4+4 layers, width 64, "
              "batch 16x64): plain %s, checkpointed %s, ratio %.3f\n",
              fsdp::format_bytes(plain).c_str(), fsdp::format_bytes(ckpt).c_str(), ratio);
  EXPECT_LT(ckpt, plain);
  EXPECT_LT(ratio, 0.75) << "checkpointing 8 of the model's blocks should save far more";
}

// --- multi-rank ------------------------------------------------------------------------------

fsdp::LaunchInfo launch_of(fsdp::ProcessGroup& world) {
  fsdp::LaunchInfo launch;
  launch.rank = world.rank();
  launch.world_size = world.size();
  launch.local_world_size = world.size();
  return launch;
}

struct FsdpRun {
  std::vector<double> losses;
  std::vector<std::pair<std::string, at::Tensor>> params;
  int checkpointed = 0;
};

FsdpRun run_fsdp(fsdp::FSDPOptions options, const LoopConfig& cfg,
                 const std::function<void(TinyLM&)>& after_build = {}) {
  auto world = fsdp::world_group();
  TinyLM lm;
  lm.after_build = after_build;
  fsdp::FSDPStrategy strategy(std::move(options));
  strategy.connect(world, launch_of(*world));
  FsdpRun r;
  r.losses = fsdp::testing::train_with(strategy, lm, cfg);
  r.params = strategy.gather_full_params();
  r.checkpointed = fsdp::count_activation_checkpointed(lm);
  return r;
}

void expect_same_params(const FsdpRun& got, const FsdpRun& want, double tol) {
  ASSERT_EQ(got.params.size(), want.params.size());
  for (size_t i = 0; i < got.params.size(); ++i) {
    ASSERT_EQ(got.params[i].first, want.params[i].first);
    EXPECT_LE((got.params[i].second - want.params[i].second).abs().max().item<double>(), tol)
        << got.params[i].first;
  }
}

void full_shard_parity(int world_size) {
  fsdp::testing::run_ranks(world_size, "gloo", [&](fsdp::ProcessGroup& pg) {
    LoopConfig cfg;  // 10 steps, global batch 12, dropout 0 (TinyLM)
    const auto layers = fsdp::demos::layer_types("transformer-tiny");
    fsdp::FSDPOptions plain;
    plain.sharding_strategy = fsdp::ShardingStrategy::kFullShard;
    plain.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(layers);
    const FsdpRun want = run_fsdp(plain, cfg);

    // Checkpointed units (the policy's types are the wrap policy's).
    fsdp::FSDPOptions ac = plain;
    ac.activation_checkpointing_policy = layers;
    const FsdpRun got = run_fsdp(ac, cfg);
    EXPECT_EQ(got.checkpointed, 4);
    fsdp::testing::expect_losses_close(got.losses, want.losses, 1e-5);
    expect_same_params(got, want, 1e-5);

    // Units inside checkpointed blocks (attention units, layers checkpointed), with both
    // prefetches: the recompute re-gathers them; they are not resharded before their backward.
    fsdp::FSDPOptions nested = plain;
    nested.auto_wrap_policy =
        fsdp::AutoWrapPolicy::of_types(fsdp::nn::module_types<fsdp::demos::MultiheadAttention>());
    nested.activation_checkpointing_policy = layers;
    nested.forward_prefetch = true;
    const FsdpRun want_nested = [&] {
      auto o = nested;
      o.activation_checkpointing_policy.clear();
      return run_fsdp(o, cfg);
    }();
    const FsdpRun got_nested = run_fsdp(nested, cfg);
    fsdp::testing::expect_losses_close(got_nested.losses, want_nested.losses, 1e-5);
    expect_same_params(got_nested, want_nested, 1e-5);

    // A model that checkpoints its own encoder layers in configure_model keeps its choice: the
    // strategy's policy (both layer types) is not applied on top.
    const FsdpRun own = run_fsdp(ac, cfg, [](TinyLM& m) {
      fsdp::apply_activation_checkpointing(
          *m.model, fsdp::nn::module_types<fsdp::demos::EncoderLayer>());
    });
    EXPECT_EQ(own.checkpointed, 2);
    fsdp::testing::expect_losses_close(own.losses, want.losses, 1e-5);
    if (pg.rank() == 0) {
      std::printf("[activation checkpointing] FULL_SHARD world %d: last loss %.6f vs %.6f "
                  "(nested units %.6f vs %.6f)\n",
                  world_size, got.losses.back(), want.losses.back(), got_nested.losses.back(),
                  want_nested.losses.back());
    }
  });
}

TEST(ActivationCheckpointing, FullShardGlooWorld2MatchesWithoutCheckpointing) {
  full_shard_parity(2);
}
TEST(ActivationCheckpointing, FullShardGlooWorld3MatchesWithoutCheckpointing) {
  full_shard_parity(3);
}

// DDP: the model applies checkpointing in configure_model (DDP has no policy option).
TEST(ActivationCheckpointing, DdpGlooWorld2MatchesWithoutCheckpointing) {
  fsdp::testing::run_ranks(2, "gloo", [&](fsdp::ProcessGroup&) {
    LoopConfig cfg;
    auto run = [&](bool checkpoint) {
      auto world = fsdp::world_group();
      TinyLM lm;
      if (checkpoint) {
        lm.after_build = [](TinyLM& m) {
          fsdp::apply_activation_checkpointing(*m.model,
                                               fsdp::demos::layer_types("transformer-tiny"));
        };
      }
      fsdp::DDPStrategy ddp;
      ddp.connect(world, launch_of(*world));
      auto losses = fsdp::testing::train_with(ddp, lm, cfg);
      EXPECT_EQ(fsdp::count_activation_checkpointed(lm), checkpoint ? 4 : 0);
      return losses;
    };
    const auto want = run(false);
    const auto got = run(true);
    fsdp::testing::expect_losses_close(got, want, 1e-5);
  });
}

// fsdp-train --activation-checkpointing: same losses as without it (dropout on), any strategy.
std::vector<double> cli_losses(const std::vector<std::string>& extra, const std::string& tag,
                               std::string* out = nullptr) {
  const std::string json = ::testing::TempDir() + "fsdp_ac_cli_" + tag + ".json";
  std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--model",
                                   "transformer-tiny", "--dropout", "0.2", "--seed", "7",
                                   "--max-steps", "6", "--no-progress-bar", "--default-root-dir",
                                   ::testing::TempDir() + "fsdp_ac_cli_logs", "--summary-json",
                                   json};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto r = fsdp::testing::run_process(argv, {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  if (out) *out = r.out;
  std::ifstream in(json);
  if (!in) {
    ADD_FAILURE() << "no summary " << json << "\n" << r.err;
    return {};
  }
  auto j = nlohmann::json::parse(in);
  std::remove(json.c_str());
  return j.at("losses").get<std::vector<double>>();
}

TEST(ActivationCheckpointing, FsdpTrainFlagKeepsTheLossesUnderFsdpAndSingle) {
  for (std::vector<std::string> strategy :
       {std::vector<std::string>{"--strategy", "fsdp", "--devices", "2"},
        std::vector<std::string>{"--strategy", "single", "--devices", "1"}}) {
    SCOPED_TRACE(strategy[1]);
    const auto plain = cli_losses(strategy, strategy[1] + "_plain");
    auto with = strategy;
    with.push_back("--activation-checkpointing");
    std::string out;
    const auto ckpt = cli_losses(with, strategy[1] + "_ac", &out);
    EXPECT_NE(out.find("activation checkpointing on"), std::string::npos) << out;
    ASSERT_EQ(plain.size(), 6u);
    ASSERT_EQ(ckpt.size(), plain.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_NEAR(ckpt[i], plain[i], 1e-6 * std::abs(plain[i])) << "step " << i;
    }
  }
}

}  // namespace
