// Initialization: deferred (sharded-as-built) init under FSDP, empty init, meta shapes and
// fsdp-train --dry-run. See include/fsdp/init.h and Note [Deferred initialization] in
// src/shard/deferred_init.cpp.
#include "fsdp/checkpoint.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/init.h"
#include "fsdp/lightning.h"
#include "fsdp/memory.h"
#include "fsdp/models.h"
#include "fsdp/trainer.h"
#include "shard/fsdp_strategy_impl.h"
#include "fully_shard_common.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace {

constexpr int64_t kVocab = 64;

// Builds one demo model (or a custom Transformer) in configure_model from a fixed seed.
struct InitLM : fsdp::LightningModule {
  std::string model_name = "transformer-tiny";
  std::optional<fsdp::demos::TransformerOptions> custom;
  std::shared_ptr<fsdp::nn::Module> model;

  void configure_model() override {
    if (model) return;
    torch::manual_seed(4321);
    if (custom) {
      model = register_module("model", std::make_shared<fsdp::demos::Transformer>(*custom));
    } else {
      model = register_module("model", fsdp::demos::make_model(model_name, kVocab, 0.0));
    }
  }
  at::Tensor training_step(const fsdp::Batch& batch, int64_t) override {
    return at::nll_loss((*model)(batch.input, batch.target), batch.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override {
    fsdp::OptimizerConfig c;
    c.optimizer = std::make_shared<torch::optim::Adam>(parameters(), torch::optim::AdamOptions(1e-3));
    return c;
  }
};

// The single-process (world 1, eager) parameters by FQN.
std::map<std::string, at::Tensor> eager_params(const std::string& model_name) {
  InitLM lm;
  lm.model_name = model_name;
  lm.configure_model();
  std::map<std::string, at::Tensor> out;
  for (const auto& p : lm.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

std::shared_ptr<fsdp::FSDPStrategy> fsdp_strategy(const std::string& model_name,
                                                  fsdp::ShardingStrategy ss, bool deferred) {
  fsdp::FSDPOptions o;
  o.sharding_strategy = ss;
  o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types(model_name));
  o.deferred_init = deferred;
  return fsdp::testing::connect_to_world(std::make_shared<fsdp::FSDPStrategy>(o));
}

int64_t expected_units(const std::string& model_name) {
  // transformer-tiny: 2 encoder + 2 decoder layers; gpt2-tiny: 2 blocks.
  return model_name == "gpt2-tiny" ? 2 : 4;
}

// Parity at `world`: deferred units exist, and every gathered parameter equals the eager one
// bit for bit.
void check_parity(const std::string& model_name, fsdp::ShardingStrategy ss) {
  const auto reference = eager_params(model_name);
  InitLM lm;
  lm.model_name = model_name;
  auto strategy = fsdp_strategy(model_name, ss, /*deferred=*/true);
  fsdp::configure_model_with(*strategy, lm);
  strategy->setup_module(lm);
  EXPECT_EQ(strategy->num_deferred_units(), expected_units(model_name))
      << model_name << " " << fsdp::to_string(ss);
  auto gathered = strategy->gather_full_params();
  ASSERT_EQ(gathered.size(), reference.size());
  for (const auto& [name, value] : gathered) {
    auto it = reference.find(name);
    ASSERT_NE(it, reference.end()) << "unexpected parameter " << name;
    ASSERT_EQ(value.sizes(), it->second.sizes()) << name;
    EXPECT_TRUE(at::equal(value, it->second)) << name << " differs from the eager init";
  }
}

TEST(DeferredInit, GatheredParametersEqualSingleProcessAtWorlds2And3) {
  for (int world : {2, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup&) {
      check_parity("transformer-tiny", fsdp::ShardingStrategy::kFullShard);
      check_parity("gpt2-tiny", fsdp::ShardingStrategy::kFullShard);
      check_parity("transformer-tiny", fsdp::ShardingStrategy::kShardGradOp);
    });
  }
}

TEST(DeferredInit, SizeAndPredicatePoliciesPickTheEagerUnits) {
  // The size-based and predicate policies decide inside each built layer; setup keeps those
  // choices (it would otherwise count shards). Same units and bitwise the same values as eager.
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    const std::vector<std::pair<std::string, fsdp::AutoWrapPolicy>> cases = {
        {"transformer-tiny", fsdp::AutoWrapPolicy::size_based(4000)},
        {"transformer-tiny", fsdp::AutoWrapPolicy::size_based(9000)},
        {"gpt2-tiny", fsdp::AutoWrapPolicy::of_predicate([](const torch::nn::Module& m, int64_t) {
           return dynamic_cast<const fsdp::demos::GPTBlock*>(&m) != nullptr;
         })}};
    for (const auto& [model_name, policy] : cases) {
      const auto reference = eager_params(model_name);
      std::vector<std::string> names[2];
      for (int deferred = 0; deferred < 2; ++deferred) {
        InitLM lm;
        lm.model_name = model_name;
        auto strategy = fsdp_strategy(model_name, fsdp::ShardingStrategy::kFullShard,
                                      deferred == 1);
        fsdp::FSDPOptions o = strategy->options();
        o.auto_wrap_policy = policy;
        auto s = std::make_shared<fsdp::FSDPStrategy>(o);
        s->connect(fsdp::world_group(), strategy->launch_info());
        fsdp::configure_model_with(*s, lm);
        s->setup_module(lm);
        for (auto& unit : fsdp::detail::state_of(*s).units()) names[deferred].push_back(unit->name());
        if (deferred) {
          // Every unit inside the layers is deferred; only modules above them (e.g. the whole
          // model, chosen for its leftover embedding/output elements) are sharded in setup.
          int inside_layers = 0;
          for (const auto& n : names[1]) inside_layers += n.find("layers.") != std::string::npos ||
                                                          n.find(".h.") != std::string::npos;
          EXPECT_EQ(s->num_deferred_units(), inside_layers) << model_name;
          EXPECT_GT(s->num_deferred_units(), 0) << model_name;
        }
        for (const auto& [name, value] : s->gather_full_params()) {
          EXPECT_TRUE(at::equal(value, reference.at(name))) << model_name << " " << name;
        }
      }
      EXPECT_EQ(names[0], names[1]) << model_name;
      if (fsdp::world_group()->rank() == 0) {
        std::printf("[policy] %s: %zu units incl. root\n", model_name.c_str(), names[1].size());
      }
    }
  });
}

TEST(DeferredInit, TrainsLikeEagerInit) {
  // Same losses with and without deferred init (the engine sees the same shards).
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    std::vector<double> losses[2];
    for (int deferred = 0; deferred < 2; ++deferred) {
      InitLM lm;
      auto strategy = fsdp_strategy("transformer-tiny", fsdp::ShardingStrategy::kFullShard,
                                    deferred == 1);
      fsdp::configure_model_with(*strategy, lm);
      strategy->setup_module(lm);
      EXPECT_EQ(strategy->num_deferred_units(), deferred ? 4 : 0);
      auto opt = lm.configure_optimizers().optimizer;
      torch::manual_seed(7);
      at::Tensor input = at::randint(kVocab, {2, 8}, at::kLong);
      at::Tensor target = at::randint(kVocab, {2, 8}, at::kLong);
      for (int step = 0; step < 3; ++step) {
        strategy->pre_forward(lm, true);
        at::Tensor loss = lm.training_step(fsdp::Batch{input, target}, step);
        strategy->backward(loss);
        strategy->post_backward(lm, true);
        opt->step();
        strategy->zero_grad(*opt);
        losses[deferred].push_back(loss.item<double>());
      }
    }
    EXPECT_EQ(losses[0], losses[1]);
  });
}

TEST(DeferredInit, PolicyUnitsRestoredWhenTheModelWrapsManually) {
  // The policy shards the layers as they are built; a later fsdp::wrap switches to manual
  // units, so setup gathers the other layers back: the result equals eager, bitwise.
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    const auto reference = eager_params("transformer-tiny");
    struct WrapLM : InitLM {
      void configure_model() override {
        InitLM::configure_model();
        auto* tf = dynamic_cast<fsdp::demos::Transformer*>(model.get());
        fsdp::wrap(tf->encoder_layers[1]);
      }
    } lm;
    auto strategy = fsdp_strategy("transformer-tiny", fsdp::ShardingStrategy::kFullShard, true);
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    ASSERT_EQ(fsdp::detail::state_of(*strategy).units().size(), 2u);  // root + encoder.layers.1
    EXPECT_EQ(strategy->num_deferred_units(), 1);
    for (const auto& [name, value] : strategy->gather_full_params()) {
      EXPECT_TRUE(at::equal(value, reference.at(name))) << name;
    }
  });
}

TEST(DeferredInit, ModuleBuiltAndDroppedInConfigureModelIsRestoredSafely) {
  // Layers of a throwaway model are sharded as they are built too; setup gathers them back
  // (they are not under the root) while they are kept alive, and the real model is unaffected.
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    const auto reference = eager_params("gpt2-tiny");
    struct DropLM : InitLM {
      void configure_model() override {
        { auto scratch = fsdp::demos::make_model("gpt2-tiny", kVocab, 0.0); }
        InitLM::configure_model();
      }
    } lm;
    lm.model_name = "gpt2-tiny";
    auto strategy = fsdp_strategy("gpt2-tiny", fsdp::ShardingStrategy::kFullShard, true);
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    EXPECT_EQ(strategy->num_deferred_units(), 2);
    for (const auto& [name, value] : strategy->gather_full_params()) {
      EXPECT_TRUE(at::equal(value, reference.at(name))) << name;
    }
  });
}

TEST(DeferredInit, FreezingAShardedLayerAfterItWasBuiltIsHonoured) {
  // configure_model freezes encoder layer 0 after the model (and so that layer's unit) was
  // built: setup rebuilds that unit with frozen parameters; the other units stay deferred.
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup&) {
    const auto reference = eager_params("transformer-tiny");
    struct FreezeLM : InitLM {
      void configure_model() override {
        InitLM::configure_model();
        auto* tf = dynamic_cast<fsdp::demos::Transformer*>(model.get());
        for (auto& p : tf->encoder_layers[0]->parameters()) p.set_requires_grad(false);
      }
    } lm;
    auto strategy = fsdp_strategy("transformer-tiny", fsdp::ShardingStrategy::kFullShard, true);
    fsdp::configure_model_with(*strategy, lm);
    strategy->setup_module(lm);
    EXPECT_EQ(strategy->num_deferred_units(), 3);
    int frozen = 0;
    for (auto* p : fsdp::detail::state_of(*strategy).all_params()) {
      const bool in_layer0 = p->fqn().find("encoder.layers.0.") != std::string::npos;
      EXPECT_EQ(p->requires_grad(), !in_layer0) << p->fqn();
      EXPECT_EQ(p->sharded().requires_grad(), !in_layer0) << p->fqn();
      frozen += in_layer0;
    }
    EXPECT_GT(frozen, 0);
    for (const auto& [name, value] : strategy->gather_full_params()) {
      EXPECT_TRUE(at::equal(value, reference.at(name))) << name;
    }
  });
}

// Setup peak for a mid-size custom Transformer (E=256, F=1024, 4+4 layers, vocab 1024: ~7.5M
// parameters, 3.1-4.2 MB per layer, 2 MB of root parameters) at world 2:
//   deferred: peak tensor bytes <= this rank's sharded state + the largest unit (full) + 64 KiB;
//   eager:    peak tensor bytes >= the whole model (what deferred init avoids).
TEST(DeferredInit, SetupPeakIsShardedStatePlusLargestUnit) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup& pg) {
    fsdp::install_tracking_allocator();
    fsdp::demos::TransformerOptions o;
    o.vocab_size = 1024, o.ninp = 256, o.nhead = 4, o.nhid = 1024, o.nlayers = 4, o.dropout = 0;
    int64_t peaks[2] = {0, 0};
    int64_t sharded = 0, largest = 0, full = 0;
    for (int deferred = 0; deferred < 2; ++deferred) {
      const int64_t base = fsdp::memory_stats().current_bytes;
      fsdp::reset_peak_memory_stats();
      {
        InitLM lm;
        lm.custom = o;
        auto strategy = fsdp_strategy("transformer-tiny", fsdp::ShardingStrategy::kFullShard,
                                      deferred == 1);
        fsdp::configure_model_with(*strategy, lm);
        strategy->setup_module(lm);
        peaks[deferred] = fsdp::memory_stats().peak_bytes - base;
        sharded = largest = full = 0;
        for (auto& unit : fsdp::detail::state_of(*strategy).units()) {
          int64_t unit_bytes = 0;
          for (auto& p : unit->params()) {
            sharded += p->shard_nbytes();
            unit_bytes += p->full_nbytes();
          }
          largest = std::max(largest, unit_bytes);
          full += unit_bytes;
        }
        EXPECT_EQ(strategy->num_deferred_units(), deferred ? 8 : 0);
      }
    }
    const int64_t slack = 64 * 1024;
    if (pg.rank() == 0) {
      std::printf("[setup peak] world 2: eager %.2f MiB, deferred %.2f MiB; model %.2f MiB, "
                  "sharded state %.2f MiB, largest unit %.2f MiB, bound %.2f MiB\n",
                  peaks[0] / 1048576.0, peaks[1] / 1048576.0, full / 1048576.0,
                  sharded / 1048576.0, largest / 1048576.0,
                  (sharded + largest + slack) / 1048576.0);
    }
    EXPECT_LE(peaks[1], sharded + largest + slack);
    EXPECT_GE(peaks[0], full);
  });
}

TEST(EmptyInit, SkipsInitOpsAndTheGenerator) {
  at::Tensor t = at::full({4}, 7.0);
  {
    fsdp::EmptyInitGuard guard;
    EXPECT_TRUE(fsdp::empty_init_enabled());
    t.uniform_();
    t.normal_();
    t.random_(0, 5);
    EXPECT_TRUE(at::equal(t, at::full({4}, 7.0)));
    // Everything else runs: deterministic fills, arithmetic with scalars.
    at::Tensor u = t + 1;
    EXPECT_TRUE(at::equal(u, at::full({4}, 8.0)));
    EXPECT_TRUE(at::equal(at::zeros({3}).add_(2.0), at::full({3}, 2.0)));
  }
  EXPECT_FALSE(fsdp::empty_init_enabled());
  t.uniform_(0.0, 1.0);  // the guard is gone: random ops work again
  EXPECT_TRUE(t.lt(1.0).all().item<bool>());

  // Building a model under the guard draws no random numbers.
  torch::manual_seed(99);
  at::Tensor expected = at::rand({8});
  torch::manual_seed(99);
  {
    auto guard = fsdp::init_module(/*empty_init=*/true);
    auto model = fsdp::demos::make_model("transformer-tiny", kVocab);
  }
  EXPECT_TRUE(at::equal(at::rand({8}), expected));
  EXPECT_EQ(fsdp::init_module(false), nullptr);
}

TEST(EmptyInit, LoadingACheckpointGivesItsValues) {
  fsdp::testing::run_ranks(1, "gloo", [](fsdp::ProcessGroup&) {
    const std::string dir = std::filesystem::temp_directory_path() /
                            ("fsdp_empty_init_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    // A mid-size model (~36M parameters, 137 MiB) so the timing means something.
    fsdp::demos::TransformerOptions o;
    o.vocab_size = 8192, o.ninp = 512, o.nhead = 8, o.nhid = 2048, o.nlayers = 4, o.dropout = 0;
    using Clock = std::chrono::steady_clock;

    InitLM saved;
    saved.custom = o;
    auto t0 = Clock::now();
    const int64_t rss0 = fsdp::current_rss_bytes();
    saved.configure_model();
    const double init_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t init_rss = fsdp::current_rss_bytes() - rss0;
    auto strategy = fsdp::make_strategy("single");
    strategy->connect(fsdp::world_group(), {});
    fsdp::save_checkpoint(dir, *strategy, saved, nullptr, {}, fsdp::StateDictType::kFull);

    InitLM loaded;
    loaded.custom = o;
    t0 = Clock::now();
    const int64_t rss1 = fsdp::current_rss_bytes();
    {
      auto guard = fsdp::init_module(/*empty_init=*/true);
      loaded.configure_model();
    }
    const double empty_s = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t empty_rss = fsdp::current_rss_bytes() - rss1;
    fsdp::load_weights(loaded, dir);
    auto a = saved.named_parameters(), b = loaded.named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].key(), b[i].key());
      EXPECT_TRUE(at::equal(a[i].value(), b[i].value())) << a[i].key();
    }
    std::printf("[empty init] %.1fM params: init %.3f s (+%.1f MiB RSS), empty_init %.3f s "
                "(+%.1f MiB RSS) before loading\n",
                fsdp::demos::parameter_count(o) / 1e6, init_s, init_rss / 1048576.0, empty_s,
                empty_rss / 1048576.0);
    std::filesystem::remove_all(dir);
  });
}

TEST(MetaInit, BuildsShapesWithoutStorage) {
  const int64_t rss0 = fsdp::current_rss_bytes();
  std::shared_ptr<fsdp::nn::Module> model;
  {
    fsdp::MetaInitGuard meta;
    model = fsdp::demos::make_model("transformer-1b");
  }
  int64_t n = 0;
  for (const auto& p : model->parameters()) {
    EXPECT_TRUE(p.is_meta());
    n += p.numel();
  }
  EXPECT_EQ(n, 1008763390);
  EXPECT_EQ(n, fsdp::demos::model_parameter_count("transformer-1b"));
  EXPECT_LT(fsdp::current_rss_bytes() - rss0, 64 << 20);  // 3.8 GiB if it were allocated
  // After the guard, tensors are real again.
  EXPECT_FALSE(at::ones({2}).is_meta());

  // The FSDP estimate of a meta model equals the one of the set-up model (world 1 here).
  fsdp::FSDPOptions o;
  o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types("transformer-1b"));
  auto est = fsdp::estimate_fsdp_memory(*model, o, 2);
  EXPECT_EQ(est.sharded_param_bytes, [&] {
    int64_t b = 0;  // per-parameter padded halves
    for (const auto& p : model->parameters()) {
      const int64_t rows = p.dim() <= 1 ? p.numel() : p.size(0);
      b += (rows + 1) / 2 * (p.numel() / std::max<int64_t>(rows, 1)) * 4;
    }
    return b;
  }());
}

// fsdp-train --dry-run: JSON estimate per strategy.
nlohmann::json dry_run(const std::vector<std::string>& extra, double* seconds = nullptr,
                       std::string* out = nullptr) {
  const std::string json = std::filesystem::temp_directory_path() /
                           ("fsdp_dry_run_" + std::to_string(::getpid()) + ".json");
  std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--dry-run",
                                   "--summary-json", json};
  argv.insert(argv.end(), extra.begin(), extra.end());
  auto r = fsdp::testing::run_process(argv, {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  if (seconds) *seconds = r.seconds;
  if (out) *out = r.out;
  std::ifstream f(json);
  nlohmann::json j = nlohmann::json::parse(f);
  std::filesystem::remove(json);
  return j;
}

TEST(DryRun, Transformer1bPrintsCountAndEstimatesQuickly) {
  double seconds = 0;
  std::string out;
  auto j = dry_run({"--model", "transformer-1b", "--devices", "2"}, &seconds, &out);
  EXPECT_NE(out.find("1,008,763,390"), std::string::npos) << out;
  EXPECT_EQ(j["params"].get<int64_t>(), 1008763390);
  // Every strategy row, and FULL_SHARD at world 2 needs about half of DDP's state.
  std::map<std::string, int64_t> total;
  for (const auto& row : j["strategies"]) total[row["name"]] = row["total_bytes"].get<int64_t>();
  for (const char* s : {"ddp", "fsdp NO_SHARD", "fsdp SHARD_GRAD_OP", "fsdp FULL_SHARD"}) {
    EXPECT_TRUE(total.count(s)) << s << "\n" << out;
  }
  EXPECT_LT(total["fsdp FULL_SHARD"], total["ddp"] * 0.6);
  EXPECT_LT(j["peak_rss_bytes"].get<int64_t>(), int64_t(512) << 20) << "dry run allocated?";
  std::printf("[dry run] transformer-1b world 2: %.2f s, peak RSS %.1f MiB\n", seconds,
              j["peak_rss_bytes"].get<int64_t>() / 1048576.0);
}

// Every row says whether it fits the budget setup checks it against (Note [Model-state budget]
// in src/memory/state_budget.cpp): here FSDP_MEMORY_BUDGET, on a GPU the device's memory.
TEST(DryRun, EveryRowSaysWhetherItFitsTheBudget) {
  const std::string json = std::filesystem::temp_directory_path() /
                           ("fsdp_dry_budget_" + std::to_string(::getpid()) + ".json");
  auto r = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-train"), "--dry-run", "--model", "transformer-1b",
       "--devices", "2", "--summary-json", json},
      {{"FSDP_MEMORY_BUDGET", "10GiB"}}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(json);
  const auto j = nlohmann::json::parse(f);
  std::filesystem::remove(json);
  EXPECT_EQ(j["budget"]["bytes"].get<int64_t>(), int64_t(10) << 30);
  EXPECT_EQ(j["budget"]["what"], "the memory budget (FSDP_MEMORY_BUDGET)");
  std::map<std::string, bool> fits;
  for (const auto& row : j["strategies"]) {
    // A row fits exactly when its total is within the budget.
    EXPECT_EQ(row["fits"].get<bool>(), row["total_bytes"].get<int64_t>() <= (int64_t(10) << 30))
        << row.dump();
    fits[row["name"]] = row["fits"].get<bool>();
  }
  // transformer-1b at world 2: DDP and NO_SHARD hold ~16 GB per rank, FULL_SHARD ~8 GB.
  EXPECT_FALSE(fits.at("ddp"));
  EXPECT_FALSE(fits.at("fsdp NO_SHARD"));
  EXPECT_TRUE(fits.at("fsdp FULL_SHARD"));
  EXPECT_NE(r.out.find("NO (setup refuses it)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("budget: 10.00 GiB per rank, the memory budget (FSDP_MEMORY_BUDGET)"),
            std::string::npos)
      << r.out;
}

TEST(DryRun, EstimateWithinTenPercentOfMeasuredModelState) {
  // A small model whose state dwarfs its activations (batch 1, 8 tokens).
  const std::vector<std::string> model = {"--model", "custom", "--ninp", "256", "--nhead", "4",
                                          "--nhid", "1024", "--nlayers", "2",
                                          "--vocab-size", "1024", "--devices", "2",
                                          "--strategy", "fsdp", "--batch-size", "1",
                                          "--block-size", "8"};
  auto j = dry_run(model);
  int64_t estimate = 0;
  for (const auto& row : j["strategies"]) {
    if (row["name"] == "fsdp FULL_SHARD") estimate = row["total_bytes"].get<int64_t>();
  }
  ASSERT_GT(estimate, 0);

  const std::string json = std::filesystem::temp_directory_path() /
                           ("fsdp_dry_real_" + std::to_string(::getpid()) + ".json");
  std::vector<std::string> argv = {fsdp::testing::bin_path("fsdp-train"), "--max-steps", "3",
                                   "--no-progress-bar", "--summary-json", json, "--dropout", "0",
                                   "--limit-val-batches", "0"};
  argv.insert(argv.end(), model.begin(), model.end());
  auto r = fsdp::testing::run_process(argv, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(json);
  auto real = nlohmann::json::parse(f);
  std::filesystem::remove(json);
  const double measured = real["peak_alloc_mb"][0].get<double>() * 1048576.0;
  std::printf("[dry run] estimate %.2f MiB vs measured training peak %.2f MiB (%.1f%%)\n",
              estimate / 1048576.0, measured / 1048576.0, 100.0 * (estimate - measured) / measured);
  EXPECT_NEAR(static_cast<double>(estimate), measured, 0.10 * measured);
}

}  // namespace
