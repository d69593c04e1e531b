// fsdp-bench overlap-run: one run of `fsdp-bench overlap` (bench/step_costs.cpp), trained in this
// process: a FULL_SHARD fit of a demo transformer (its layers as units) whose FSDP all-gathers
// and reduce-scatters run as --collectives says (real | local | serial; Note [Benchmark
// collectives] in src/shard/collectives.cpp). The mode reaches the library through the injected
// hook this program installs (Note [Injected hooks] in src/common/injected_hooks.h); the ranks
// the Trainer launches run this same command line and install it too. Rank 0 writes the summary
// to --summary: losses, step end times, and per rank the training peak of tensor bytes and the
// lifetime peak RSS (the fields `fsdp-train --summary-json` has under the same names).
#include "../apps/cli.h"
#include "bench.h"
#include "demo_lm.h"

#include "common/injected_hooks.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>

namespace {

using nlohmann::json;

int run_overlap_run(const std::vector<std::string>& args) {
  using fsdp::detail::BenchCollectives;
  std::string model = "transformer-small", backend = "auto", summary;
  int64_t vocab_size = 0, batch_size = 4, block_size = 35, steps = 8, seed = 42;
  int devices = 2;
  double dropout = 0.2, lr = 1e-3;
  bool forward_prefetch = false;
  BenchCollectives collectives = BenchCollectives::kReal;
  CLI::App app{"fsdp-bench overlap-run: one run of `fsdp-bench overlap` (it runs this)"};
  app.add_option("--model", model, "a transformer-* preset")->capture_default_str();
  app.add_option("--vocab-size", vocab_size, "synthetic vocabulary (0: the preset's, at most 1024)")
      ->capture_default_str();
  app.add_option("--devices", devices, "ranks")->capture_default_str();
  app.add_option("--batch-size", batch_size, "per rank")->capture_default_str();
  app.add_option("--block-size", block_size, "tokens per sample")->capture_default_str();
  app.add_option("--steps", steps, "optimizer steps")->capture_default_str();
  app.add_option("--dropout", dropout)->capture_default_str();
  app.add_option("--lr", lr, "AdamW's learning rate")->capture_default_str();
  app.add_option("--seed", seed)->capture_default_str();
  app.add_option("--backend", backend, "auto | gloo | mpi")
      ->check(fsdp::cli::one_of({"auto", "gloo", "mpi"}))
      ->capture_default_str();
  app.add_flag("--forward-prefetch", forward_prefetch, "all-gather the next unit during forward");
  const std::map<std::string, BenchCollectives> modes = {{"real", BenchCollectives::kReal},
                                                         {"local", BenchCollectives::kLocal},
                                                         {"serial", BenchCollectives::kSerial}};
  app.add_option("--collectives", collectives, "real | local | serial")
      ->transform(CLI::CheckedTransformer(modes));
  app.add_option("--summary", summary, "where rank 0 writes the summary (JSON)")->required();
  if (auto status = fsdp::bench::parse_args(app, "overlap-run", args)) return *status;

  fsdp::detail::InjectedHooks hooks;
  hooks.collectives = collectives;
  fsdp::detail::install_injected_hooks(hooks);

  const int64_t vocab = vocab_size > 0 ? vocab_size
                                       : std::min<int64_t>(
                                             fsdp::demos::transformer_preset(model).vocab_size, 1024);
  fsdp::TrainerOptions t;
  t.devices = devices;
  t.process_group_backend = backend;
  fsdp::FSDPOptions fo;
  fo.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types(model));
  fo.forward_prefetch = forward_prefetch;
  t.strategy = std::make_shared<fsdp::FSDPStrategy>(fo);
  t.max_steps = steps;
  t.seed = seed;
  t.enable_progress_bar = false;
  t.enable_summary = false;
  t.logger = false;
  fsdp::Trainer trainer(t);
  const int64_t tokens = std::max<int64_t>(100000, (steps * batch_size * devices + 2) * block_size);
  auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(vocab, tokens, seed, block_size);
  fsdp::DataLoader loader(data, batch_size, fsdp::DistributedSampler(data->size()));
  fsdp::bench::DemoLM lm(model, vocab, dropout, lr);
  trainer.fit(lm, loader);

  const fsdp::FitResults& r = trainer.results();
  if (trainer.is_global_zero()) {
    auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
    json peak_alloc = json::array(), peak_rss = json::array();
    for (size_t i = 0; i < r.peak_alloc_bytes.size(); ++i) {
      peak_alloc.push_back(mib(r.peak_alloc_bytes[i]));
      peak_rss.push_back(mib(std::max(r.peak_rss_bytes[i], r.setup_peak_rss_bytes[i])));
    }
    std::ofstream(summary) << json{{"losses", r.losses},
                                   {"step_end_seconds", r.step_end_seconds},
                                   {"peak_alloc_mb", peak_alloc},
                                   {"peak_rss_mb", peak_rss}}
                                  .dump();
  }
  fsdp::finalize_ranks();
  return 0;
}

fsdp::bench::Registrar reg_overlap_run("overlap-run",
                           "one run of `overlap` with real, local or serial collectives (run by "
                           "overlap)",
                           run_overlap_run);

}  // namespace
