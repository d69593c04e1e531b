// fsdp-bench init: FSDP setup time and peak memory per rank, deferred vs eager initialization
// (and deferred + empty_init), for one demo model at one world size. Prints one JSON object on
// stdout (rank 0).
//
//   fsdp-bench init [--model transformer-1b] [--world 2] [--modes deferred,empty,eager]
//
// Setup = configure_model (the model is built from seed 42) + FSDPStrategy::setup_module with
// the model's layer types as units, FULL_SHARD. Per rank: wall time, peak tensor bytes
// (tracking allocator) and peak RSS during setup, beside the bytes the rank holds afterwards
// (its shards) and the largest unit (full). The modes run one after the other in the same
// processes, each on a fresh model (the previous one is freed first); no training step runs.
//   deferred  units sharded as they are built (the default; see Note [Deferred initialization])
//   empty     deferred, under fsdp::init_module(empty_init=true) (as before loading weights)
//   eager     FSDPOptions::deferred_init = false: the whole model is built, then sharded
#include "bench.h"

#include <fsdp/fsdp.h>
#include <shard/fsdp_strategy_impl.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <iostream>
#include <sstream>

namespace {

using nlohmann::json;

struct InitBenchLM : fsdp::LightningModule {
  std::string name;
  std::shared_ptr<fsdp::nn::Module> model;
  explicit InitBenchLM(std::string n) : name(std::move(n)) {}
  void configure_model() override {
    if (!model) model = register_module("model", fsdp::demos::make_model(name, 0, 0.0));
  }
  at::Tensor training_step(const fsdp::Batch& b, int64_t) override {
    return at::nll_loss((*model)(b.input, b.target), b.target.reshape(-1));
  }
  fsdp::OptimizerConfig configure_optimizers() override { return {}; }
};

int run_init(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench init"};
  std::string model = "transformer-1b";
  int world = 2;
  std::string modes = "deferred,empty,eager";
  app.add_option("--model", model, "demo model preset");
  app.add_option("--world", world, "ranks");
  app.add_option("--modes", modes, "comma-separated: deferred, empty, eager");
  if (auto status = fsdp::bench::parse_args(app, "init", args)) return *status;

  fsdp::LaunchOptions lo;
  lo.devices = world;
  const fsdp::LaunchInfo launch = fsdp::launch(lo);
  fsdp::install_tracking_allocator();
  auto pg = fsdp::init_process_group();

  json out = {{"bench", "init"}, {"model", model}, {"world", world},
              {"params", fsdp::demos::model_parameter_count(model)},
              {"sharding", "FULL_SHARD"}, {"units", "layer types"}};
  std::stringstream list(modes);
  for (std::string mode; std::getline(list, mode, ',');) {
    TORCH_CHECK(mode == "deferred" || mode == "empty" || mode == "eager",
                "[fsdp-bench init] unknown mode '", mode, "'; valid: deferred, empty, eager");
    pg->barrier();
    const int64_t base = fsdp::memory_stats().current_bytes;
    fsdp::reset_peak_memory_stats();
    fsdp::reset_peak_rss();
    const auto t0 = std::chrono::steady_clock::now();
    int64_t held = 0, largest = 0, deferred_units = 0;
    {
      fsdp::FSDPOptions o;
      o.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types(model));
      o.deferred_init = mode != "eager";
      fsdp::FSDPStrategy strategy(o);
      strategy.connect(pg, launch);
      InitBenchLM lm(model);
      torch::manual_seed(42);
      {
        auto empty = fsdp::init_module(mode == "empty");
        fsdp::configure_model_with(strategy, lm);
      }
      strategy.setup_module(lm);
      pg->barrier();
      held = fsdp::memory_stats().current_bytes - base;
      for (auto& unit : fsdp::detail::state_of(strategy).units()) largest = std::max(largest, unit->unsharded_bytes());
      deferred_units = strategy.num_deferred_units();
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    at::Tensor mine = at::tensor({fsdp::memory_stats().peak_bytes - base, fsdp::peak_rss_bytes(),
                                  held, largest},
                                 at::kLong);
    at::Tensor all = at::empty({4 * world}, at::kLong);
    pg->all_gather_into_tensor(all, mine);
    json peak = json::array(), rss = json::array(), state = json::array();
    for (int r = 0; r < world; ++r) {
      peak.push_back(all[4 * r].item<int64_t>() / 1048576.0);
      rss.push_back(all[4 * r + 1].item<int64_t>() / 1048576.0);
      state.push_back(all[4 * r + 2].item<int64_t>() / 1048576.0);
    }
    out[mode] = {{"setup_seconds", secs},
                 {"deferred_units", deferred_units},
                 {"peak_tensor_mb_per_rank", peak},
                 {"peak_rss_mb_per_rank", rss},
                 {"sharded_state_mb_per_rank", state},
                 {"largest_unit_mb", largest / 1048576.0}};
    if (launch.rank == 0) std::cerr << "[init] " << mode << ": " << out[mode].dump() << std::endl;
  }
  if (launch.rank == 0) {
    out["note"] = "setup = configure_model + setup_module; peak_tensor_mb = tracking-allocator "
                  "peak during setup; sharded_state_mb = tensor bytes held after setup; "
                  "bound for deferred = sharded state + largest unit";
    std::cout << out.dump(1) << std::endl;
  }
  fsdp::finalize_ranks();
  return 0;
}

fsdp::bench::Registrar reg_init("init",
                           "FSDP setup time and peak memory: deferred vs eager init (and "
                           "empty_init)",
                           run_init);

}  // namespace
