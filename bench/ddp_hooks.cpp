// fsdp-bench ddp-hooks: DDP communication hooks in fsdp.cpp and in PyTorch 2.x DDP, in one run,
// on one model, one data order and the same initial weights, at several world sizes (Gloo):
//
//   fsdp-bench ddp-hooks [--model transformer-small --worlds 2,4 --warmup 3 --steps 5]
//
// hooks      allreduce (the baseline: DDP without a hook), fp16_compress, bf16_compress,
//            powersgd, batched_powersgd, powersgd + fp16_compress_wrapper, post_local_sgd
//            (+ PeriodicModelAverager), with the same settings on both sides
// systems    fsdp.cpp (fsdp-train --strategy ddp --ddp-comm-hook ...), PyTorch DDP with its own
//            register_comm_hook (bench/peers/ddp_hooks_peer.py)
// per run    bytes sent per step per rank, counted where the collectives are called (fsdp.cpp:
//            the process group's counters; PyTorch: every dist.all_reduce call), in the last
//            step (steady state: PowerSGD and local SGD have started) and their ratio to the
//            same system's allreduce; it/s over the timed steps (runs.h it_per_s) and its
//            ratio to allreduce; the loss after all steps.
// Both systems start from fsdp-train's initial weights (--save-initial-weights; the peer loads
// them with --weights) and train on fsdp-train's batches (--save-batches), so their losses are
// comparable step by step. Prints JSON on stdout and a markdown table on stderr. A run that fails
// stays in the table as its error (PyTorch 2.13's batched_powerSGD_hook does, at its first
// compressing step).
#include "bench.h"
#include "../apps/cli.h"
#include "runs.h"

#include "fsdp/models.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct DdpHooksOptions {
  fsdp::bench::TrainRun run;  // run.devices is set per world
  std::vector<int> worlds = {2, 4};
  int64_t steps = 5;   // timed optimizer steps
  int64_t warmup = 3;  // untimed steps first (>= start_powersgd_iter: timed steps compress)
  int64_t powersgd_rank = 1;
  int64_t start_powersgd_iter = 2;
  int64_t start_local_sgd_iter = 2;
  int64_t model_averaging_period = 2;
  int subgroup_size = 1;
  std::vector<std::string> hooks;
  std::vector<std::string> systems;
  std::string python = fsdp::bench::default_python();
  std::string peers = fsdp::bench::peers_dir();
  std::string fsdp_train;
  std::string markdown;
};

struct Hook {
  std::string name;     // --hooks name
  std::string hook;     // --ddp-comm-hook / --hook
  std::string wrapper;  // --ddp-comm-wrapper / --wrapper
};

const std::vector<Hook>& all_hooks() {
  static const std::vector<Hook> hooks = {
      {"allreduce", "allreduce", "none"},
      {"fp16_compress", "fp16_compress", "none"},
      {"bf16_compress", "bf16_compress", "none"},
      {"powersgd", "powersgd", "none"},
      {"batched_powersgd", "batched_powersgd", "none"},
      {"powersgd_fp16", "powersgd", "fp16"},
      {"post_local_sgd", "post_local_sgd", "none"},
  };
  return hooks;
}

// The hook's settings, as fsdp-train flags and as the peer's (the same names but two).
std::vector<std::string> hook_flags(const DdpHooksOptions& o, const Hook& h, bool peer) {
  std::vector<std::string> f = {peer ? "--hook" : "--ddp-comm-hook", h.hook,
                                peer ? "--wrapper" : "--ddp-comm-wrapper", h.wrapper};
  if (h.hook == "powersgd" || h.hook == "batched_powersgd") {
    f.insert(f.end(), {"--powersgd-rank", std::to_string(o.powersgd_rank), "--start-powersgd-iter",
                       std::to_string(o.start_powersgd_iter)});
  } else if (h.hook == "post_local_sgd") {
    f.insert(f.end(), {"--start-local-sgd-iter", std::to_string(o.start_local_sgd_iter),
                       peer ? "--subgroup-size" : "--post-local-sgd-subgroup-size",
                       std::to_string(o.subgroup_size), "--model-averaging-period",
                       std::to_string(o.model_averaging_period)});
  }
  return f;
}

json finish(json r, const DdpHooksOptions& o) {
  if (r.contains("error")) return r;
  const auto ends = r.value("step_end_seconds", std::vector<double>{});
  r["it_per_s"] = fsdp::bench::it_per_s(ends, static_cast<int>(o.warmup));
  const auto bytes = r.value("comm_bytes_per_step", std::vector<int64_t>{});
  if (r["it_per_s"].is_null() || bytes.empty()) {
    r["error"] = "reported " + std::to_string(ends.size()) + " step times and " +
                 std::to_string(bytes.size()) + " byte counts; needs more than --warmup " +
                 std::to_string(o.warmup) + " of each";
    return r;
  }
  r["bytes_per_step"] = bytes.back();
  const auto& losses = r["losses"];
  r["final_loss"] = losses.empty() ? json(nullptr) : losses.back();
  return r;
}

json run_one(const DdpHooksOptions& o, const Hook& h, const std::string& system,
             const fs::path& weights, bool save_weights) {
  const std::string name = system + "-" + h.name;
  json r;
  if (system == "fsdp.cpp") {
    std::vector<std::string> flags = {"--strategy", "ddp", "--backend", "gloo"};
    for (const auto& f : hook_flags(o, h, false)) flags.push_back(f);
    if (save_weights) flags.insert(flags.end(), {"--save-initial-weights", weights.string()});
    r = fsdp::bench::run_fsdp_train(o.fsdp_train, o.run, flags, name);
  } else {
    std::vector<std::string> flags = {"--strategy", "ddp", "--weights", weights.string()};
    for (const auto& f : hook_flags(o, h, true)) flags.push_back(f);
    r = fsdp::bench::run_peer(o.python, (fs::path(o.peers) / "ddp_hooks_peer.py").string(), o.run,
                              flags, name);
    r["system"] = "pytorch-ddp";
  }
  r["hook"] = h.name;
  r["world_size"] = o.run.devices;
  return r;
}

// Ratios to the same system's allreduce at the same world, and fsdp.cpp vs PyTorch per hook.
void add_ratios(json& runs) {
  auto find = [&](const std::string& system, const std::string& hook, int world) -> const json* {
    for (const auto& r : runs) {
      if (r["system"] == system && r["hook"] == hook && r["world_size"] == world &&
          !r.contains("error")) {
        return &r;
      }
    }
    return nullptr;
  };
  for (auto& r : runs) {
    if (r.contains("error")) continue;
    const int world = r["world_size"];
    if (const json* base = find(r["system"], "allreduce", world)) {
      r["bytes_vs_allreduce"] =
          r["bytes_per_step"].get<double>() / (*base)["bytes_per_step"].get<double>();
      r["it_per_s_vs_allreduce"] = r["it_per_s"].get<double>() / (*base)["it_per_s"].get<double>();
    }
    if (r["system"] == "fsdp.cpp") {
      if (const json* peer = find("pytorch-ddp", r["hook"], world)) {
        r["it_per_s_vs_pytorch"] = r["it_per_s"].get<double>() / (*peer)["it_per_s"].get<double>();
        if (r["final_loss"].is_number() && (*peer)["final_loss"].is_number()) {
          r["final_loss_minus_pytorch"] =
              r["final_loss"].get<double>() - (*peer)["final_loss"].get<double>();
        }
      }
    }
  }
}

std::string hooks_markdown_table(const json& out) {
  std::ostringstream md;
  const int64_t n = out["config"]["warmup"].get<int64_t>() + out["config"]["steps"].get<int64_t>();
  md << "| world | hook | system | bytes/step/rank | vs allreduce | it/s | vs allreduce "
        "| fsdp.cpp / PyTorch it/s | loss at step " << n << " |\n"
     << "|---:|---|---|---:|---:|---:|---:|---:|---:|\n";
  using fsdp::bench::fixed;
  for (const auto& r : out["runs"]) {
    md << "| " << r["world_size"].get<int>() << " | " << r["hook"].get<std::string>() << " | "
       << r["system"].get<std::string>() << " | ";
    if (r.contains("error")) {
      std::string e = r["error"].get<std::string>();
      std::replace(e.begin(), e.end(), '\n', ' ');
      std::replace(e.begin(), e.end(), '|', '/');
      if (e.size() > 160) e = e.substr(0, 157) + "...";
      md << "error: " << e << " | | | | | |\n";
      continue;
    }
    auto ratio = [&](const char* key) {
      return r.contains(key) ? fixed(r[key].get<double>(), 3) + "x" : std::string();
    };
    md << r["bytes_per_step"].get<int64_t>() << " | " << ratio("bytes_vs_allreduce") << " | "
       << fixed(r["it_per_s"].get<double>(), 3) << " | " << ratio("it_per_s_vs_allreduce")
       << " | " << ratio("it_per_s_vs_pytorch") << " | "
       << (r["final_loss"].is_number() ? fixed(r["final_loss"].get<double>(), 4) : "") << " |\n";
  }
  return md.str();
}

int run_ddp_hooks(const std::vector<std::string>& args) {
  DdpHooksOptions o;
  fsdp::bench::TrainRun& run = o.run;
  run.dropout = 0;  // the two systems draw dropout masks from different generators
  run.vocab_size = 1024;
  std::string worlds_arg = "2,4", hooks_arg, systems_arg = "fsdp.cpp,pytorch", work_dir;
  for (const auto& h : all_hooks()) hooks_arg += (hooks_arg.empty() ? "" : ",") + h.name;
  CLI::App app{"fsdp-bench ddp-hooks: DDP comm hooks, fsdp.cpp vs PyTorch DDP: bytes/step, it/s, "
               "loss (JSON + table)"};
  app.add_option("--model", run.model, "transformer-tiny | transformer-small")
      ->check(fsdp::cli::one_of({"transformer-tiny", "transformer-small"}))
      ->capture_default_str();
  app.add_option("--vocab-size", run.vocab_size, "synthetic vocabulary (0: the preset's)")
      ->check(fsdp::cli::at_least(int64_t{0}))
      ->capture_default_str();
  app.add_option("--worlds", worlds_arg, "comma list of world sizes (ranks, Gloo on loopback)")
      ->capture_default_str();
  app.add_option("--steps", o.steps, "timed optimizer steps")->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed optimizer steps first")
      ->check(fsdp::cli::between(int64_t{1}, int64_t{1000}))
      ->capture_default_str();
  app.add_option("--hooks", hooks_arg, "comma list of hooks")->capture_default_str();
  app.add_option("--systems", systems_arg, "comma list of fsdp.cpp, pytorch")
      ->capture_default_str();
  app.add_option("--powersgd-rank", o.powersgd_rank)->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--start-powersgd-iter", o.start_powersgd_iter)->check(fsdp::cli::between(int64_t{2}, int64_t{100000}))
      ->capture_default_str();
  app.add_option("--start-local-sgd-iter", o.start_local_sgd_iter)->check(fsdp::cli::at_least(int64_t{0}))
      ->capture_default_str();
  app.add_option("--model-averaging-period", o.model_averaging_period)
      ->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--subgroup-size", o.subgroup_size, "post_local_sgd: ranks per subgroup")
      ->check(fsdp::cli::at_least(1))
      ->capture_default_str();
  app.add_option("--batch-size", run.batch_size, "per rank")->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--block-size", run.block_size)->check(fsdp::cli::at_least(int64_t{1}))->capture_default_str();
  app.add_option("--lr", run.lr)->check(fsdp::cli::greater_than(0.0))->capture_default_str();
  app.add_option("--seed", run.seed)->capture_default_str();
  app.add_option("--python", o.python, "interpreter with torch 2.x")->capture_default_str();
  app.add_option("--peers-dir", o.peers, "folder of ddp_hooks_peer.py")->capture_default_str();
  app.add_option("--fsdp-train", o.fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "logs, batches, summaries (default: a fresh /tmp dir)");
  app.add_option("--markdown", o.markdown, "also write the markdown table to this file");
  app.add_option("--timeout", run.timeout_s, "seconds per run before it is killed")
      ->capture_default_str();
  if (auto status = fsdp::bench::parse_args(app, "ddp-hooks", args)) return *status;

  o.worlds.clear();
  for (const auto& w : fsdp::bench::split_list(worlds_arg)) {
    const int world = std::atoi(w.c_str());
    if (world < 2) {
      std::cerr << "fsdp-bench ddp-hooks: error: --worlds needs sizes >= 2, got '" << w << "'\n";
      return 2;
    }
    o.worlds.push_back(world);
  }
  o.systems = fsdp::bench::split_list(systems_arg);
  for (const auto& s : o.systems) {
    if (s != "fsdp.cpp" && s != "pytorch") {
      std::cerr << "fsdp-bench ddp-hooks: error: unknown system '" << s
                << "' in --systems; valid: fsdp.cpp, pytorch\n";
      return 2;
    }
  }
  auto picked = fsdp::bench::pick_by_name(all_hooks(), &Hook::name, hooks_arg, "ddp-hooks",
                                          "hook", "--hooks");
  if (!picked) return 2;
  const std::vector<Hook> hooks = std::move(*picked);
  run.steps = o.warmup + o.steps;
  run.vocab_size = fsdp::demos::transformer_preset(run.model, run.vocab_size).vocab_size;
  if (o.fsdp_train.empty()) o.fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  const fs::path root = work_dir.empty() ? fs::temp_directory_path() /
                                               ("fsdp-bench-ddp-hooks-" + std::to_string(getpid()))
                                         : fs::path(work_dir);
  if (!fs::exists(o.fsdp_train)) {
    std::cerr << "fsdp-bench ddp-hooks: error: " << o.fsdp_train
              << " not found; build it (cmake --build build --target fsdp-train) or pass "
                 "--fsdp-train PATH\n";
    return 1;
  }
  const bool with_peer =
      std::find(o.systems.begin(), o.systems.end(), "pytorch") != o.systems.end();
  const bool with_ours =
      std::find(o.systems.begin(), o.systems.end(), "fsdp.cpp") != o.systems.end();

  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  json out;
  out["bench"] = "ddp-hooks";
  out["config"] = {{"model", run.model}, {"vocab_size", run.vocab_size}, {"backend", "gloo"},
                   {"worlds", o.worlds}, {"batch_size_per_rank", run.batch_size},
                   {"block_size", run.block_size}, {"warmup", o.warmup}, {"steps", o.steps},
                   {"dropout", run.dropout}, {"optimizer", "adam"}, {"lr", run.lr},
                   {"seed", run.seed}, {"powersgd_rank", o.powersgd_rank},
                   {"start_powersgd_iter", o.start_powersgd_iter},
                   {"start_local_sgd_iter", o.start_local_sgd_iter},
                   {"model_averaging_period", o.model_averaging_period},
                   {"post_local_sgd_subgroup_size", o.subgroup_size},
                   {"bucket_cap_mb", 25}, {"cores", cores},
                   {"bytes_note", "per rank, in the last step, as passed to the collectives "
                                  "(including the loss/metric all-reduce: 8 B per step in fsdp.cpp's Trainer, "
                                  "4 B in the PyTorch peer)"}};
  out["load_average_start"] = fsdp::bench::load_average();
  json runs = json::array();
  for (int world : o.worlds) {
    run.devices = world;
    run.dir = root / ("world-" + std::to_string(world));
    fs::create_directories(run.dir);
    json batches = fsdp::bench::write_batches(o.fsdp_train, run);
    if (batches.contains("error")) {
      std::cerr << "fsdp-bench ddp-hooks: error: " << batches["error"].get<std::string>() << "\n";
      return 1;
    }
    const fs::path weights = run.dir / "initial_weights.safetensors";
    fs::remove(weights);
    for (const auto& h : hooks) {
      // fsdp.cpp first: its first run writes the initial weights the peer starts from.
      for (const std::string system : {"fsdp.cpp", "pytorch"}) {
        if (system == "fsdp.cpp" ? !with_ours : !with_peer) continue;
        if (system == "pytorch" && !fs::exists(weights)) {
          // fsdp.cpp not run (or failed): one fsdp-train run only to write the weights.
          run_one(o, all_hooks().front(), "fsdp.cpp", weights, true);
        }
        std::fprintf(stderr, "[bench ddp-hooks] world %d, %s, %s ...\n", world, h.name.c_str(),
                     system.c_str());
        json r = run_one(o, h, system, weights, system == "fsdp.cpp" && !fs::exists(weights));
        runs.push_back(finish(std::move(r), o));
      }
    }
  }
  add_ratios(runs);
  out["runs"] = runs;
  out["work_dir"] = root.string();
  return fsdp::bench::print_report(out, o.markdown, hooks_markdown_table);
}

fsdp::bench::Registrar reg_ddp_hooks("ddp-hooks",
                           "DDP comm hooks, fsdp.cpp vs PyTorch DDP: bytes/step, it/s, loss (JSON)",
                           run_ddp_hooks);

}  // namespace
