// fsdp-bench strategies: the reference's memory/speed table (Lightning FSDP guide, "Optimize
// the sharding strategy") for fsdp.cpp on this machine.
//
//   fsdp-bench strategies --model transformer-small --devices 2 [--steps 6] --json
//
// Runs DDP, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, FULL_SHARD + bf16-mixed, DeepSpeed ZeRO stages
// 1/2/3 (fsdp.cpp's native deepspeed_stage_N) (and HYBRID_SHARD at
// world >= 4, shard group = half the ranks) on the same model, data and batch through build/bin/fsdp-train
// --summary-json, one after the other, and reports per strategy: peak tensor MB per rank
// (tracking allocator, max over ranks), peak RSS MB (max over ranks), it/s (first step
// excluded), each also as a ratio to DDP measured in the same run. JSON on stdout, a markdown
// table on stderr. FULL_SHARD+AC is FULL_SHARD with fsdp-train --activation-checkpointing (the
// layers recompute their activations in backward).
#include "bench.h"
#include "../apps/cli.h"
#include "runs.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>


#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Config {
  std::string model = "transformer-small";
  int devices = 2;
  int64_t steps = 6;  // the first is warm-up (not timed by fsdp-train)
  int64_t batch_size = 4;
  int64_t block_size = 35;
  std::string wrap_policy = "layers";
  int64_t vocab_size = 0;  // 0: fsdp-train's default for synthetic data (the preset's, capped at 1024)
  std::string fsdp_train;
  std::string work_dir;
  bool json_only = false;
  std::string only;  // comma list of column labels to run (empty: all)
  double timeout_s = 7200;  // per fsdp-train run (transformer-1b steps take ~45 s)
};

double max_of(const json& list) {
  double m = 0;
  for (const auto& v : list) m = std::max(m, v.get<double>());
  return m;
}

struct Entry {
  std::string label;     // table column
  std::string strategy;  // --strategy
  std::vector<std::string> extra;
};

json run_one(const Config& c, const Entry& e) {
  const fs::path dir = c.work_dir;
  const fs::path summary = dir / ("summary_" + e.label + ".json");
  std::vector<std::string> argv = {c.fsdp_train, "--model", c.model, "--data", "synthetic",
                                   "--strategy", e.strategy, "--devices", std::to_string(c.devices),
                                   "--batch-size", std::to_string(c.batch_size),
                                   "--block-size", std::to_string(c.block_size),
                                   "--max-steps", std::to_string(c.steps), "--dropout", "0",
                                   "--seed", "42", "--limit-val-batches", "0", "--no-progress-bar",
                                   "--default-root-dir", (dir / "logs").string(),
                                   "--summary-json", summary.string()};
  if (c.vocab_size > 0) argv.insert(argv.end(), {"--vocab-size", std::to_string(c.vocab_size)});
  argv.insert(argv.end(), e.extra.begin(), e.extra.end());
  std::fprintf(stderr, "[bench strategies] %s on %d rank(s) ...\n", e.label.c_str(), c.devices);
  const int code = fsdp::bench::run_program(argv, dir / (e.label + ".out"),
                                            dir / (e.label + ".err"), c.timeout_s);
  json r;
  r["strategy"] = e.label;
  r["command"] = fsdp::bench::command_line(argv);
  if (code != 0 || !fs::exists(summary)) {
    r["error"] = "fsdp-train exited with status " + std::to_string(code) + ": " +
                 fsdp::bench::tail(fsdp::bench::read_text(dir / (e.label + ".err")));
    return r;
  }
  json s = json::parse(fsdp::bench::read_text(summary));
  r["it_per_s"] = s["it_per_s"];
  r["peak_alloc_mb"] = max_of(s["peak_alloc_mb"]);
  r["peak_rss_mb"] = max_of(s["peak_rss_mb"]);
  r["peak_alloc_mb_per_rank"] = s["peak_alloc_mb"];
  r["params"] = s["params"];
  r["final_loss"] = s["final_loss"];
  return r;
}

int run_strategies(const std::vector<std::string>& args) {
  Config c;
  CLI::App app{"fsdp-bench strategies: DDP vs FSDP sharding strategies, memory and speed"};
  app.add_option("--model", c.model, "a demo model preset")->capture_default_str();
  app.add_option("--devices", c.devices, "ranks")->check(fsdp::cli::between(1, 64))->capture_default_str();
  app.add_option("--steps", c.steps, "optimizer steps per run (first one not timed)")
      ->check(fsdp::cli::between(2, 100000))
      ->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "per rank")->capture_default_str();
  app.add_option("--block-size", c.block_size, "tokens per sample")->capture_default_str();
  app.add_option("--wrap-policy", c.wrap_policy, "FSDP units: layers | size:N | none")
      ->capture_default_str();
  app.add_option("--vocab-size", c.vocab_size,
                 "synthetic vocabulary (0: fsdp-train's default, the preset's capped at 1024; "
                 "33278 is transformer-small's own, the seed table's)")
      ->capture_default_str();
  app.add_option("--fsdp-train", c.fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", c.work_dir, "logs and summaries (default: a fresh /tmp dir)");
  app.add_flag("--json", c.json_only, "JSON on stdout (always; the table goes to stderr)");
  app.add_option("--strategies", c.only,
                 "comma list of columns to run (DDP, NO_SHARD, SHARD_GRAD_OP, FULL_SHARD, "
                 "FULL_SHARD+AC, FULL_SHARD+bf16-mixed, ZeRO-1, ZeRO-2, ZeRO-3, HYBRID_SHARD; "
                 "default all); ratios are to DDP when it ran");
  if (auto status = fsdp::bench::parse_args(app, "strategies", args)) return *status;
  if (c.fsdp_train.empty()) c.fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  if (!fs::exists(c.fsdp_train)) {
    std::cerr << "fsdp-bench strategies: error: " << c.fsdp_train
              << " not found; build fsdp-train or pass --fsdp-train PATH\n";
    return 1;
  }
  if (c.work_dir.empty()) {
    c.work_dir = (fs::temp_directory_path() / ("fsdp-bench-strategies-" + std::to_string(getpid())))
                     .string();
  }
  fs::create_directories(c.work_dir);

  const std::vector<std::string> wrap = {"--wrap-policy", c.wrap_policy};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), wrap.begin(), wrap.end());
    return a;
  };
  std::vector<Entry> entries = {
      {"DDP", "ddp", {}},
      {"NO_SHARD", "fsdp", with({"--sharding-strategy", "NO_SHARD"})},
      {"SHARD_GRAD_OP", "fsdp", with({"--sharding-strategy", "SHARD_GRAD_OP"})},
      {"FULL_SHARD", "fsdp", with({"--sharding-strategy", "FULL_SHARD"})},
      // Activation checkpointing of the model's layers: less activation memory, more compute.
      {"FULL_SHARD+AC", "fsdp",
       with({"--sharding-strategy", "FULL_SHARD", "--activation-checkpointing"})},
      // fp32 master shards and Adam state, bf16 all-gather/compute/reduce-scatter.
      {"FULL_SHARD+bf16-mixed", "fsdp",
       with({"--sharding-strategy", "FULL_SHARD", "--precision", "bf16-mixed"})},
      // DeepSpeed ZeRO stages with Lightning's defaults (include/fsdp/deepspeed.h).
      {"ZeRO-1", "deepspeed_stage_1", {}},
      {"ZeRO-2", "deepspeed_stage_2", {}},
      {"ZeRO-3", "deepspeed_stage_3", {}},
  };
  if (c.devices >= 4 && c.devices % 2 == 0) {
    entries.push_back({"HYBRID_SHARD", "fsdp",
                       with({"--sharding-strategy", "HYBRID_SHARD", "--hybrid-shard-size",
                             std::to_string(c.devices / 2)})});
  }

  if (!c.only.empty()) {
    auto picked = fsdp::bench::pick_by_name(entries, &Entry::label, c.only, "strategies",
                                            "column", "--strategies (at " +
                                                std::to_string(c.devices) + " ranks)");
    if (!picked) return 2;
    entries = std::move(*picked);
  }

  json out;
  out["bench"] = "strategies";
  out["load_average_start"] = fsdp::bench::load_average();
  out["config"] = {{"model", c.model},           {"vocab_size", c.vocab_size}, {"devices", c.devices},
                   {"steps", c.steps},           {"timed_steps", c.steps - 1},
                   {"batch_size_per_rank", c.batch_size}, {"block_size", c.block_size},
                   {"wrap_policy", c.wrap_policy}, {"optimizer", "adam"},
                   {"dropout", 0},               {"data", "synthetic"}};
  json results = json::array();
  for (const auto& e : entries) results.push_back(run_one(c, e));
  auto ddp_it = std::find_if(results.begin(), results.end(),
                             [](const json& r) { return r["strategy"] == "DDP"; });
  const bool have_ddp = ddp_it != results.end() && ddp_it->contains("it_per_s");
  const json ddp = have_ddp ? *ddp_it : json::object();
  for (auto& r : results) {
    if (!r.contains("it_per_s") || !have_ddp) continue;
    r["peak_alloc_ratio_to_ddp"] = r["peak_alloc_mb"].get<double>() / ddp["peak_alloc_mb"].get<double>();
    r["peak_rss_ratio_to_ddp"] = r["peak_rss_mb"].get<double>() / ddp["peak_rss_mb"].get<double>();
    r["it_per_s_ratio_to_ddp"] = r["it_per_s"].get<double>() / ddp["it_per_s"].get<double>();
  }
  out["results"] = results;
  out["load_average_end"] = fsdp::bench::load_average();
  std::cout << out.dump(2) << std::endl;

  // Markdown table (stderr), laid out like the reference's.
  std::ostringstream t;
  t << "\n" << c.model << ", " << c.devices << " ranks, batch " << c.batch_size << "x"
    << c.block_size << " per rank, " << (c.steps - 1) << " timed steps, wrap " << c.wrap_policy
    << "\n\n|  |";
  for (const auto& r : results) t << " " << r["strategy"].get<std::string>() << " |";
  t << "\n|---|";
  for (size_t i = 0; i < results.size(); ++i) t << "---|";
  auto row = [&](const std::string& name, const std::string& key, const std::string& ratio, int prec) {
    t << "\n| " << name << " |";
    for (const auto& r : results) {
      if (!r.contains(key)) {
        t << " error |";
        continue;
      }
      t << " " << fsdp::bench::fixed(r[key].get<double>(), prec);
      if (r.contains(ratio)) t << " (" << fsdp::bench::fixed(r[ratio].get<double>(), 2) << "x)";
      t << " |";
    }
  };
  row("Peak tensor memory per rank (MB)", "peak_alloc_mb", "peak_alloc_ratio_to_ddp", 1);
  row("Peak RSS per rank (MB)", "peak_rss_mb", "peak_rss_ratio_to_ddp", 1);
  row("Iterations per second", "it_per_s", "it_per_s_ratio_to_ddp", 3);
  t << "\n\n(ratios to DDP measured in the same run)\n";
  std::cerr << t.str();
  for (const auto& r : results) {
    if (r.contains("error")) return 1;
  }
  return 0;
}

const fsdp::bench::Registrar kRegistrar(
    "strategies", "DDP vs NO_SHARD / SHARD_GRAD_OP / FULL_SHARD: peak memory and it/s (JSON)",
    run_strategies);

}  // namespace
