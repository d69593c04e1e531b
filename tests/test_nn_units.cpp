// Plain torch::nn models under FSDP (fsdp/unit.h): unit holders keep names and forward, wrap
// policies select them (by the wrapped type, by size), the engine shards through them, setup
// warns when no unit is found below the root, and a model written only with torch::nn modules
// trains under FULL_SHARD at worlds 2 and 3 with the losses of one process and a lower peak
// than the same model as one root unit.
#include "fully_shard_common.h"
#include "fsdp/memory.h"
#include "fsdp/unit.h"
#include "shard/fsdp_strategy_impl.h"
#include "testing.h"
#include "unit_names.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdio>
#include <string>
#include <vector>

using fsdp::testing::kVocab;
using fsdp::testing::LoopConfig;

namespace {

constexpr int64_t kDim = 32;
constexpr int64_t kHidden = 512;

// A user's own block, written with torch::nn only.
struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl() {
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc1 = register_module("fc1", torch::nn::Linear(kDim, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kDim));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::gelu(fc1(norm(x)))); }
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MlpBlock);

// "blocks": embedding, 3 MlpBlocks, head. "linears": embedding, Linear/ReLU stack, head.
torch::nn::Sequential make_net(const std::string& kind) {
  torch::manual_seed(4321);
  torch::nn::Sequential net;
  net->push_back(torch::nn::Embedding(kVocab, kDim));
  for (int i = 0; i < 3; ++i) {
    if (kind == "blocks") {
      net->push_back(MlpBlock());
    } else {
      net->push_back(torch::nn::Linear(kDim, kDim));
      net->push_back(torch::nn::ReLU());
    }
  }
  net->push_back(torch::nn::Linear(kDim, kVocab));
  net->push_back(torch::nn::LogSoftmax(torch::nn::LogSoftmaxOptions(-1)));
  return net;
}

// A LightningModule around a plain Sequential; `units` puts its children in unit holders.
struct PlainNet : fsdp::LightningModule {
  std::string kind = "blocks";
  bool units = true;
  torch::nn::Sequential net{nullptr};

  void configure_model() override {
    if (net) return;
    net = register_module("net", make_net(kind));
    if (units) fsdp::nn::unit_children(*net);
  }
  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    at::Tensor out = net->forward(batch.input);  // (B, T, vocab) log-probabilities
    return at::nll_loss(out.reshape({-1, kVocab}), batch.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    fsdp::OptimizerConfig config;
    config.optimizer =
        std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-3).eps(1e-3));
    return config;
  }
};

std::vector<std::string> names_of(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

// Units of `lm` under `policy` (one rank, no process group), by name.
std::vector<std::string> units_of(PlainNet& lm, fsdp::AutoWrapPolicy policy) {
  return fsdp::testing::unit_names(lm, std::move(policy));
}

// Collects the c10 warnings issued while it lives.
struct WarningCollector : c10::WarningHandler {
  std::vector<std::string> messages;
  void process(const c10::Warning& warning) override { messages.push_back(warning.msg()); }
};

int count_containing(const std::vector<std::string>& messages, const std::string& text) {
  int n = 0;
  for (const auto& m : messages) n += m.find(text) != std::string::npos;
  return n;
}

}  // namespace

TEST(NnUnits, HoldersKeepNamesForwardAndTrainingFlag) {
  torch::nn::Sequential plain = make_net("blocks");
  torch::nn::Sequential held = make_net("blocks");
  EXPECT_EQ(fsdp::nn::unit_children(*held), 5);  // embedding, 3 blocks, head; not LogSoftmax
  EXPECT_EQ(fsdp::nn::unit_children(*held), 0);  // holders are fsdp::nn::Modules already
  EXPECT_EQ(names_of(*held), names_of(*plain));   // "0.weight", "1.fc1.weight", ...
  EXPECT_NE(dynamic_cast<fsdp::nn::UnitBase*>(held->ptr(1).get()), nullptr);
  EXPECT_EQ(dynamic_cast<fsdp::nn::UnitBase*>(held->ptr(5).get()), nullptr);  // LogSoftmax
  at::Tensor x = at::randint(kVocab, {2, 5}, at::kLong);
  EXPECT_TRUE(at::allclose(held->forward(x), plain->forward(x)));

  // One typed holder: the module's own call signature, its parameter names, its type.
  auto linear = torch::nn::Linear(4, 3);
  auto unit = fsdp::nn::unit(linear);
  EXPECT_EQ(names_of(*unit), (std::vector<std::string>{"weight", "bias"}));
  EXPECT_EQ(unit->module().get(), linear.ptr().get());
  at::Tensor v = at::randn({2, 4});
  EXPECT_TRUE(at::equal(unit->forward(v), linear(v)));
  EXPECT_TRUE(at::equal((*unit)(v), linear(v)));
  EXPECT_TRUE(fsdp::nn::is_instance_of(*unit, fsdp::nn::module_types<torch::nn::Linear>()));
  EXPECT_FALSE(fsdp::nn::is_instance_of(*unit, fsdp::nn::module_types<torch::nn::ReLU>()));
  // A torch::nn::Sequential block and a user's subclass.
  auto block = fsdp::nn::unit(torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::ReLU()));
  EXPECT_EQ(names_of(*block), (std::vector<std::string>{"0.weight", "0.bias"}));
  EXPECT_EQ(block->forward(v).sizes(), v.sizes());
  auto mine = fsdp::nn::unit(MlpBlock());
  EXPECT_EQ(names_of(*mine), names_of(*MlpBlock()));

  // eval() reaches the wrapped module's own flag.
  held->eval();
  auto* holder = dynamic_cast<fsdp::nn::UnitBase*>(held->ptr(1).get());
  ASSERT_NE(holder, nullptr);
  EXPECT_FALSE(holder->wrapped()->is_training());
  held->train();
  EXPECT_TRUE(holder->wrapped()->is_training());

  // More inputs than the module's forward takes: an error naming the module.
  EXPECT_NE(fsdp::testing::error_of([&] { unit->call({v, v}); }).find("takes 1 tensor"),
            std::string::npos);
}

TEST(NnUnits, PoliciesSelectHoldersByWrappedTypeAndSize) {
  {
    PlainNet lm;
    lm.kind = "linears";
    auto units = units_of(lm, fsdp::AutoWrapPolicy::of_types(
                                  fsdp::nn::module_types<torch::nn::Linear>()));
    // root + 3 Linear layers + head; the embedding is not a Linear.
    EXPECT_EQ(units, (std::vector<std::string>{"<root>", "net.1", "net.3", "net.5", "net.7"}));
  }
  {
    PlainNet lm;
    auto units = units_of(lm, fsdp::AutoWrapPolicy::of_types(fsdp::nn::module_types<MlpBlock>()));
    EXPECT_EQ(units, (std::vector<std::string>{"<root>", "net.1", "net.2", "net.3"}));
  }
  {
    PlainNet lm;
    auto units = units_of(lm, fsdp::AutoWrapPolicy::size_based(1));
    EXPECT_EQ(units, (std::vector<std::string>{"<root>", "net.0", "net.1", "net.2", "net.3", "net.4"}));
  }
  {
    // Without holders a plain Sequential has no unit candidates.
    PlainNet lm;
    lm.units = false;
    EXPECT_EQ(units_of(lm, fsdp::AutoWrapPolicy::size_based(1)),
              (std::vector<std::string>{"<root>"}));
  }
  {
    // A type policy that names a plain module outside a holder says how to give it hooks.
    PlainNet lm;
    lm.units = false;
    const std::string error = fsdp::testing::error_of([&] {
      units_of(lm, fsdp::AutoWrapPolicy::of_types(fsdp::nn::module_types<torch::nn::Linear>()));
    });
    EXPECT_NE(error.find("fsdp::nn::unit_children"), std::string::npos) << error;
  }
}

// Manual wrapping of a holder, and the engine registering the sharded parameter in the wrapped
// module as well (Note [Unit holders] in src/nn/unit.cpp).
TEST(NnUnits, ManualWrapOfHolderShardsBothRegistrations) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    struct Manual : PlainNet {
      std::shared_ptr<fsdp::nn::Unit<torch::nn::LinearImpl>> head;
      void configure_model() override {
        if (net) return;
        PlainNet::configure_model();  // holders of every child
        head = fsdp::wrap(fsdp::nn::unit(torch::nn::Linear(kVocab, kVocab)));
        register_module("extra", head);
      }
    } lm;
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>());
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    const auto& units = fsdp::detail::state_of(*strategy).units();
    ASSERT_EQ(units.size(), 2u);
    EXPECT_EQ(units[1]->name(), "extra");
    // The wrapped Linear's own dict holds the shard too, not the freed unsharded parameter.
    const auto& holder = *lm.head;
    for (const auto& p : holder.module()->named_parameters(/*recurse=*/false)) {
      const at::Tensor& mine = holder.named_parameters(/*recurse=*/false)[p.key()];
      EXPECT_EQ(p.value().unsafeGetTensorImpl(), mine.unsafeGetTensorImpl()) << p.key();
      EXPECT_EQ(p.value().size(0), kVocab / 2) << p.key();
    }
  });
}

TEST(NnUnits, SetupWarnsOnceOnRankZeroWhenNoUnitBelowTheRoot) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup& world) {
    auto warnings_of_setup = [](bool units, fsdp::AutoWrapPolicy policy) {
      WarningCollector collector;
      c10::WarningUtils::WarningHandlerGuard guard(&collector);
      PlainNet lm;
      lm.units = units;
      fsdp::FSDPOptions opts;
      opts.auto_wrap_policy = std::move(policy);
      auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(opts));
      fsdp::configure_model_with(*strategy, lm);
      strategy->setup_module(lm);
      return count_containing(collector.messages, "no unit below the root");
    };
    const int expected = world.rank() == 0 ? 1 : 0;
    // A plain Sequential: size_based(1) finds no candidate; no policy at all.
    EXPECT_EQ(warnings_of_setup(false, fsdp::AutoWrapPolicy::size_based(1)), expected);
    EXPECT_EQ(warnings_of_setup(true, fsdp::AutoWrapPolicy::none()), expected);
    // Holders and a policy: units, no warning.
    EXPECT_EQ(warnings_of_setup(true, fsdp::AutoWrapPolicy::size_based(1)), 0);
  });
}

namespace {

struct Run {
  std::vector<double> losses;
  int64_t peak_bytes = 0;  // tracking allocator: peak during training minus before the model
};

Run train_fsdp(bool units, fsdp::AutoWrapPolicy policy, const LoopConfig& cfg,
               PlainNet* reference_for_params = nullptr) {
  Run run;
  const int64_t base = fsdp::memory_stats().current_bytes;
  fsdp::reset_peak_memory_stats();
  {
    PlainNet lm;
    lm.units = units;
    fsdp::FSDPOptions opts;
    opts.sharding_strategy = fsdp::ShardingStrategy::kFullShard;
    opts.auto_wrap_policy = std::move(policy);
    auto strategy = fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(opts));
    run.losses = fsdp::testing::train_with(*strategy, lm, cfg);
    run.peak_bytes = fsdp::memory_stats().peak_bytes - base;
    if (reference_for_params) {
      fsdp::testing::expect_params_close(strategy->gather_full_params(), *reference_for_params);
    }
  }
  return run;
}

void parity_and_peak(int world_size) {
  fsdp::testing::run_ranks(world_size, "gloo", [](fsdp::ProcessGroup& world) {
    fsdp::install_tracking_allocator();
    LoopConfig cfg;  // 10 steps, global batch 12
    PlainNet ref;
    ref.units = false;  // the plain model, one process, whole batch
    const auto want = fsdp::testing::train_reference(ref, cfg);

    const auto by_type = train_fsdp(
        true, fsdp::AutoWrapPolicy::of_types(fsdp::nn::module_types<MlpBlock, torch::nn::Embedding>()),
        cfg, &ref);
    fsdp::testing::expect_losses_close(by_type.losses, want);
    const auto by_size = train_fsdp(true, fsdp::AutoWrapPolicy::size_based(1000), cfg);
    fsdp::testing::expect_losses_close(by_size.losses, want);
    const auto root_only = train_fsdp(false, fsdp::AutoWrapPolicy::none(), cfg);
    fsdp::testing::expect_losses_close(root_only.losses, want);

    EXPECT_LT(by_type.peak_bytes, root_only.peak_bytes);
    EXPECT_LT(by_size.peak_bytes, root_only.peak_bytes);
    if (world.rank() == 0) {
      std::printf("[nn units] world %d peak tensor bytes: units by type %lld, by size %lld, one "
                  "root unit %lld\n", world.size(), (long long)by_type.peak_bytes,
                  (long long)by_size.peak_bytes, (long long)root_only.peak_bytes);
    }
  });
}

}  // namespace

TEST(NnUnits, PlainTorchModelFullShardParityAndPeakWorld2) { parity_and_peak(2); }
TEST(NnUnits, PlainTorchModelFullShardParityAndPeakWorld3) { parity_and_peak(3); }
