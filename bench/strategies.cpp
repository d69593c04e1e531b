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
//
// Beside each measured peak it prints the arithmetic peak that strategy should reach and the
// measured ÷ arithmetic ratio (Note [Arithmetic peak] below).
#include "bench.h"
#include "../apps/cli.h"
#include "runs.h"
#include "shard/wrap_policy.h"

#include <fsdp/init.h>
#include <fsdp/models.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>


#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <functional>
#include <set>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using fsdp::bench::max_of;

struct StrategiesConfig {
  std::string model = "transformer-small";
  int devices = 2;
  int64_t steps = 6;  // the first is warm-up (not timed by fsdp-train)
  int64_t batch_size = 4;
  int64_t block_size = 35;
  std::string wrap_policy = "layers";
  int64_t vocab_size = 0;  // 0: fsdp-train's default for synthetic data (the preset's, capped at 1024)
  int64_t loss_chunk_tokens = 0;  // fsdp-train --loss-chunk-tokens: 0 auto, -1 whole logits
  bool vocab_parallel = true;     // fsdp-train --vocab-parallel / --no-vocab-parallel
  std::string fsdp_train;
  std::string work_dir;
  bool json_only = false;
  std::string only;  // comma list of column labels to run (empty: all)
  double timeout_s = 7200;  // per fsdp-train run (transformer-1b steps take ~45 s)
};

struct Entry {
  std::string label;     // table column
  std::string strategy;  // --strategy
  std::vector<std::string> extra;
};

// Note [Arithmetic peak]
// ----------------------
// What a strategy's peak tensor bytes per rank should be, with fp32 parameters and Adam (4 B of
// parameter, gradient, exp_avg and exp_avg_sq each), P parameters, world W, the model's units as
// the strategy's wrap policy selects them (root: what no unit took), and A the activations the
// run's tracker charged to the forward at its peak (peak_breakdown_mb "activations"):
//   DDP            16 P + A                          (everything replicated)
//   FULL_SHARD,    16 P / W                          sharded state
//   ZeRO-3         + 8 root                          the root unit, unsharded all step, and its gradient
//                  + 8 largest unit                  the largest unit unsharded and its gradient
//                  + A
//   SHARD_GRAD_OP  16 P / W + 4 (P - root) + 8 root + 4 largest unit + A  (units stay gathered
//                  from forward until their backward)
// Vocabulary units that compute on their shards (--vocab-parallel, 2+ ranks) are never
// gathered: they count in the sharded state only, not as the largest unit nor in P - root.
// The measured peak above it is what the engine holds beyond the arithmetic (all-gather and
// reduce-scatter buffers, a second unit in flight, the loss's logits).
struct UnitSizes {
  int64_t params = 0;   // P
  int64_t root = 0;     // elements no unit took
  int64_t largest = 0;  // elements of the largest unit that is gathered
  int64_t on_shards = 0;  // elements of the vocabulary units that compute on their shards
};

UnitSizes unit_sizes(const StrategiesConfig& c, const fsdp::AutoWrapPolicy& policy) {
  const bool vocab_on_shards = c.vocab_parallel && c.devices >= 2;
  std::shared_ptr<fsdp::nn::Module> model;
  {
    fsdp::MetaInitGuard meta;  // shapes only
    // fsdp-train's synthetic vocabulary: --vocab-size, else the preset's capped at 1024.
    const int64_t preset = fsdp::demos::is_transformer_model(c.model)
                               ? fsdp::demos::transformer_preset(c.model).vocab_size
                               : fsdp::demos::gpt_preset(c.model).vocab_size;
    model = fsdp::demos::make_model(
        c.model, c.vocab_size > 0 ? c.vocab_size : std::min<int64_t>(preset, 1024));
  }
  UnitSizes u;
  std::set<const c10::TensorImpl*> counted;
  auto count = [&](torch::nn::Module& m, const std::set<const torch::nn::Module*>& stop) {
    int64_t n = 0;
    std::function<void(torch::nn::Module&, bool)> walk = [&](torch::nn::Module& x, bool top) {
      if (!top && stop.count(&x)) return;
      for (auto& p : x.parameters(/*recurse=*/false)) {
        if (counted.insert(p.unsafeGetTensorImpl()).second) n += p.numel();
      }
      for (auto& child : x.children()) walk(*child, false);
    };
    walk(m, true);
    return n;
  };
  const auto units = fsdp::detail::select_units(*model, policy, {});
  std::set<const torch::nn::Module*> unit_modules;
  for (const auto& spec : units) unit_modules.insert(spec.module);
  // Innermost units first, so that a unit nested in another counts in the inner one.
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    std::set<const torch::nn::Module*> inner = unit_modules;
    inner.erase(it->module);
    const int64_t n = count(*it->module, inner);
    if (vocab_on_shards && dynamic_cast<const fsdp::demos::Vocabulary*>(it->module)) {
      u.on_shards += n;
    } else {
      u.largest = std::max(u.largest, n);
    }
  }
  u.root = count(*model, unit_modules);
  for (auto& p : model->parameters()) u.params += p.numel();
  return u;
}

// Bytes: see Note [Arithmetic peak]; `activation_bytes` is A.
double arithmetic_peak(const std::string& label, const UnitSizes& u, int world,
                       double activation_bytes) {
  const double P = static_cast<double>(u.params), W = world;
  if (label == "DDP") return 16 * P + activation_bytes;
  const double state = 16 * P / W + 8.0 * u.root;
  if (label == "SHARD_GRAD_OP") {
    return state + 4.0 * (u.params - u.root - u.on_shards) + 4.0 * u.largest + activation_bytes;
  }
  return state + 8.0 * u.largest + activation_bytes;
}

json run_one(const StrategiesConfig& c, const Entry& e) {
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
  argv.insert(argv.end(), {"--loss-chunk-tokens", std::to_string(c.loss_chunk_tokens)});
  argv.push_back(c.vocab_parallel ? "--vocab-parallel" : "--no-vocab-parallel");
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
  // The breakdown of the rank with the highest peak (Note [Memory categories] in fsdp/memory.h).
  size_t top = 0;
  for (size_t i = 0; i < s["peak_alloc_mb"].size(); ++i) {
    if (s["peak_alloc_mb"][i].get<double>() > s["peak_alloc_mb"][top].get<double>()) top = i;
  }
  if (s.contains("peak_breakdown_mb") && top < s["peak_breakdown_mb"].size()) {
    r["peak_breakdown_mb"] = s["peak_breakdown_mb"][top];
  }
  r["params"] = s["params"];
  r["final_loss"] = s["final_loss"];
  return r;
}

int run_strategies(const std::vector<std::string>& args) {
  StrategiesConfig c;
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
  app.add_option("--loss-chunk-tokens", c.loss_chunk_tokens,
                 "the head's loss in chunks of N tokens (0: fsdp-train's rule, -1: whole logits)")
      ->check(fsdp::cli::at_least(int64_t{-1}))
      ->capture_default_str();
  app.add_flag("--vocab-parallel,!--no-vocab-parallel", c.vocab_parallel,
               "on (default): the vocabulary units compute on their shards (fsdp-train "
               "--vocab-parallel); off: they are gathered as any unit");
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
                   {"loss_chunk_tokens", c.loss_chunk_tokens},
                   {"vocab_parallel", c.vocab_parallel},
                   {"steps", c.steps},           {"timed_steps", c.steps - 1},
                   {"batch_size_per_rank", c.batch_size}, {"block_size", c.block_size},
                   {"wrap_policy", c.wrap_policy}, {"optimizer", "adam"},
                   {"dropout", 0},               {"data", "synthetic"}};
  json results = json::array();
  for (const auto& e : entries) results.push_back(run_one(c, e));
  // The arithmetic peaks (Note [Arithmetic peak]): units as fsdp-train's --wrap-policy selects
  // them (the model's unit types for "layers"), ZeRO-3's units as its engine selects them.
  const UnitSizes fsdp_units = unit_sizes(
      c, fsdp::parse_wrap_policy(c.wrap_policy, fsdp::demos::unit_types(c.model)));
  const UnitSizes zero3_units = unit_sizes(
      c, fsdp::AutoWrapPolicy::of_predicate([](const torch::nn::Module&, int64_t n) { return n > 0; }));
  for (auto& r : results) {
    if (!r.contains("peak_alloc_mb")) continue;
    const std::string label = r["strategy"].get<std::string>();
    if (label != "DDP" && label != "FULL_SHARD" && label != "SHARD_GRAD_OP" && label != "ZeRO-3") {
      continue;  // the arithmetic covers fp32 Adam without recomputation or replication groups
    }
    const UnitSizes& u = label == "ZeRO-3" ? zero3_units : fsdp_units;
    const double act_mb = r.contains("peak_breakdown_mb")
                              ? r["peak_breakdown_mb"].value("activations", 0.0)
                              : 0.0;
    const double mb = arithmetic_peak(label, u, c.devices, act_mb * 1048576.0) / 1048576.0;
    r["arithmetic_peak_mb"] = mb;
    r["peak_ratio_to_arithmetic"] = r["peak_alloc_mb"].get<double>() / mb;
    r["arithmetic_units"] = {{"params", u.params}, {"root", u.root}, {"largest_unit", u.largest},
                              {"vocab_on_shards", u.on_shards}};
  }
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
  // The goals against DDP in the same run: peak tensor bytes <= 0.45 x DDP's at world 2 and
  // <= 0.30 x at world 4 or more (FULL_SHARD and ZeRO-3), FULL_SHARD it/s >= 0.95 x DDP's.
  // They are set for a full vocabulary (transformer-small at 33,278 words, GPT-2 at 50,257).
  json goals = json::array();
  const double peak_goal = c.devices >= 4 ? 0.30 : 0.45;
  for (const auto& r : results) {
    if (!r.contains("peak_alloc_ratio_to_ddp")) continue;
    const std::string label = r["strategy"].get<std::string>();
    if (label != "FULL_SHARD" && label != "ZeRO-3") continue;
    if (c.devices >= 2) {
      const double v = r["peak_alloc_ratio_to_ddp"].get<double>();
      goals.push_back({{"what", label + " peak / DDP peak"}, {"measured", v},
                       {"goal", "<= " + fsdp::bench::fixed(peak_goal, 2)}, {"met", v <= peak_goal}});
    }
    if (label == "FULL_SHARD") {
      const double v = r["it_per_s_ratio_to_ddp"].get<double>();
      goals.push_back({{"what", "FULL_SHARD it/s / DDP it/s"}, {"measured", v}, {"goal", ">= 0.95"},
                       {"met", v >= 0.95}});
    }
  }
  out["goals"] = goals;
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
  auto row = [&](const std::string& name, const std::string& key, const std::string& ratio, int prec,
                 const char* missing = "error") {
    t << "\n| " << name << " |";
    for (const auto& r : results) {
      if (!r.contains(key)) {
        t << " " << (r.contains("error") ? "error" : missing) << " |";
        continue;
      }
      t << " " << fsdp::bench::fixed(r[key].get<double>(), prec);
      if (r.contains(ratio)) t << " (" << fsdp::bench::fixed(r[ratio].get<double>(), 2) << "x)";
      t << " |";
    }
  };
  row("Peak tensor memory per rank (MB)", "peak_alloc_mb", "peak_alloc_ratio_to_ddp", 1);
  row("Arithmetic peak (MB) (measured / arithmetic)", "arithmetic_peak_mb",
      "peak_ratio_to_arithmetic", 1, "-");
  row("Peak RSS per rank (MB)", "peak_rss_mb", "peak_rss_ratio_to_ddp", 1);
  row("Iterations per second", "it_per_s", "it_per_s_ratio_to_ddp", 3);
  t << "\n\n(ratios to DDP measured in the same run; the arithmetic peak is 16 B x params / "
       "world + the root unit and the largest unit unsharded with their gradients + the "
       "activations at the peak, see bench/strategies.cpp)\n";
  if (!goals.empty()) {
    t << "\nGoals (set for a full vocabulary):";
    for (const auto& g : goals) {
      t << "\n- " << g["what"].get<std::string>() << " = "
        << fsdp::bench::fixed(g["measured"].get<double>(), 2) << " (goal " << g["goal"].get<std::string>()
        << "): " << (g["met"].get<bool>() ? "met" : "not met");
    }
    t << "\n";
  }
  std::cerr << t.str();
  for (const auto& r : results) {
    if (r.contains("error")) return 1;
  }
  return 0;
}

const fsdp::bench::Registrar reg_strategies(
    "strategies", "DDP vs NO_SHARD / SHARD_GRAD_OP / FULL_SHARD: peak memory and it/s (JSON)",
    run_strategies);

}  // namespace
