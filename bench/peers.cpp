// fsdp-bench peers: fsdp.cpp beside the systems it replaces, in one run, on one model, one data
// order, one global batch, one world size and one backend (Gloo):
//
//   fsdp-bench peers --model transformer-small --devices 2 [--steps 5 --warmup 2]
//
// configurations   DDP | FULL_SHARD | SHARD_GRAD_OP | FULL_SHARD + bf16-mixed
// systems          fsdp.cpp (build/bin/fsdp-train --summary-json)
//                  PyTorch 2.x (bench/peers/torch_peer.py: DDP, FSDP2 fully_shard per layer then
//                  the root, reshard_after_forward True/False, MixedPrecisionPolicy(bf16, bf16))
//                  Lightning (bench/peers/lightning_peer.py: Trainer(accelerator="cpu",
//                  strategy=DDPStrategy / FSDPStrategy))
//                  DeepSpeed (bench/peers/deepspeed_peer.py: deepspeed.initialize on the CPU
//                  accelerator over Gloo), for the ZeRO configurations zero1 | zero2 | zero3
//                  (not in the default --configs; e.g. --systems fsdp.cpp,deepspeed
//                  --configs zero1,zero2,zero3)
//
// Same for everyone, by construction:
//   model    fsdp::demos::transformer_preset(--model, vocab): fsdp-train builds it, the peers
//            build its mirror (bench/peers/mirror.py) from the same dimensions;
//   data     `fsdp-train --save-batches` writes the micro-batches fsdp-train trains on (every
//            rank's); the peers read that file, rank r its own rows;
//   threads  cores / ranks intra-op threads per rank;
//   it/s     every run reports the end time of each optimizer step (after the loss is
//            averaged over the ranks); it/s = timed steps / (end of last - end of warm-up),
//            one function (runs.h it_per_s) for all;
//   memory   peak RSS per rank = the rank process's VmHWM over its whole life (fsdp.cpp:
//            max of its setup and training peaks, which is the same thing); fsdp.cpp also
//            reports its peak tensor bytes (tracking allocator), which the peers cannot.
// Ratios are to PyTorch DDP measured in the same run. A run that fails (Lightning's FSDP on
// CPU, say) is reported with its error, not dropped. Prints JSON on stdout and the markdown
// table on stderr (and to --markdown FILE). Design and limits: docs/peers.md.
#include "bench.h"
#include "../apps/cli.h"
#include "runs.h"

#include "fsdp/models.h"
#include "fsdp/strategy_registry.h"

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
using fsdp::bench::fixed;
using nlohmann::json;
using fsdp::bench::max_of;

struct PeersOptions {
  fsdp::bench::TrainRun run;  // model, data, batch, devices; run.steps = warmup + steps
  int64_t steps = 5;          // timed optimizer steps
  int64_t warmup = 2;         // untimed optimizer steps before them
  std::vector<std::string> systems;
  std::vector<std::string> configs;
  std::string python = fsdp::bench::default_python();
  std::string peers = fsdp::bench::peers_dir();
  std::string fsdp_train;
  std::string markdown;
};

struct PeersConfig {
  std::string name;        // the --configs name
  std::string label;       // table column
  std::string fsdp_train;  // --strategy for fsdp-train
  std::string sharding;    // --sharding-strategy ("" for DDP)
  std::string peer;        // --strategy for the peers
  std::string precision;
};

const std::vector<PeersConfig>& all_configs() {
  static const std::vector<PeersConfig> configs = {
      {"ddp", "DDP", "ddp", "", "ddp", "32-true"},
      {"full_shard", "FULL_SHARD", "fsdp", "FULL_SHARD", "fsdp-full-shard", "32-true"},
      {"shard_grad_op", "SHARD_GRAD_OP", "fsdp", "SHARD_GRAD_OP", "fsdp-shard-grad-op", "32-true"},
      {"full_shard_bf16", "FULL_SHARD bf16-mixed", "fsdp", "FULL_SHARD", "fsdp-full-shard",
       "bf16-mixed"},
      // ZeRO stages: fsdp.cpp's native deepspeed_stage_N beside DeepSpeed's own on the CPU
      // accelerator (bench/peers/deepspeed_peer.py); PyTorch and Lightning have no such run
      // (Lightning's DeepSpeedStrategy needs CUDA).
      {"zero1", "ZeRO-1", "deepspeed_stage_1", "", "deepspeed-stage-1", "32-true"},
      {"zero2", "ZeRO-2", "deepspeed_stage_2", "", "deepspeed-stage-2", "32-true"},
      {"zero3", "ZeRO-3", "deepspeed_stage_3", "", "deepspeed-stage-3", "32-true"},
  };
  return configs;
}

// Fields every run reports; `r` has "error" instead when it failed.
json finish(json r, const PeersOptions& o) {
  if (r.contains("error")) return r;
  const auto ends = r.value("step_end_seconds", std::vector<double>{});
  r["it_per_s"] = fsdp::bench::it_per_s(ends, static_cast<int>(o.warmup));
  if (r["it_per_s"].is_null()) {
    r["error"] = "reported " + std::to_string(ends.size()) + " step times; needs more than " +
                 std::to_string(o.warmup) + " (--warmup)";
    return r;
  }
  r["peak_rss_mb_max"] = max_of(r["peak_rss_mb"]);
  const auto& losses = r["losses"];
  r["final_loss"] = losses.empty() ? json(nullptr) : losses.back();
  return r;
}

json run_one(const PeersOptions& o, const PeersConfig& c, const std::string& system) {
  const std::string name = system + "-" + c.name;
  json r;
  if (system == "fsdp.cpp") {
    std::vector<std::string> flags = {"--strategy", c.fsdp_train, "--backend", "gloo",
                                      "--precision", c.precision};
    if (!c.sharding.empty()) flags.insert(flags.end(), {"--sharding-strategy", c.sharding});
    r = fsdp::bench::run_fsdp_train(o.fsdp_train, o.run, flags, name);
  } else {
    const std::string script = system == "lightning"   ? "lightning_peer.py"
                               : system == "deepspeed" ? "deepspeed_peer.py"
                                                       : "torch_peer.py";
    r = fsdp::bench::run_peer(o.python, (fs::path(o.peers) / script).string(), o.run,
                              {"--strategy", c.peer, "--precision", c.precision}, name);
    if (!r.contains("system")) r["system"] = system;
  }
  r["config"] = c.label;
  return r;
}

std::string peers_markdown_table(const json& out) {
  std::ostringstream md;
  const auto& cfg = out["config"];
  md << "| configuration | system | it/s | vs PyTorch DDP | peak RSS/rank (MiB) | vs PyTorch DDP "
        "| fsdp.cpp peak tensors/rank (MiB) | loss at step "
     << cfg["warmup"].get<int64_t>() + cfg["steps"].get<int64_t>() << " |\n"
     << "|---|---|---:|---:|---:|---:|---:|---:|\n";
  for (const auto& r : out["runs"]) {
    md << "| " << r["config"].get<std::string>() << " | " << r["system"].get<std::string>() << " | ";
    if (r.contains("error")) {
      std::string e = r["error"].get<std::string>();
      std::replace(e.begin(), e.end(), '\n', ' ');
      std::replace(e.begin(), e.end(), '|', '/');
      if (e.size() > 160) e = e.substr(0, 157) + "...";
      md << "error: " << e << " | | | | | |\n";
      continue;
    }
    md << fixed(r["it_per_s"].get<double>(), 2) << " | "
       << (r.contains("it_per_s_vs_pytorch_ddp") ? fixed(r["it_per_s_vs_pytorch_ddp"].get<double>(), 2) + "x" : "")
       << " | " << fixed(r["peak_rss_mb_max"].get<double>(), 0) << " | "
       << (r.contains("peak_rss_vs_pytorch_ddp") ? fixed(r["peak_rss_vs_pytorch_ddp"].get<double>(), 2) + "x" : "")
       << " | " << (r.contains("peak_alloc_mb") ? fixed(max_of(r["peak_alloc_mb"]), 0) : "")
       << " | " << (r["final_loss"].is_number() ? fixed(r["final_loss"].get<double>(), 3) : "")
       << " |\n";
  }
  return md.str();
}

int run_peers(const std::vector<std::string>& args) {
  PeersOptions o;
  fsdp::bench::TrainRun& run = o.run;
  std::string systems_arg = "pytorch,fsdp.cpp,lightning";
  std::string configs_arg = "ddp,full_shard,shard_grad_op,full_shard_bf16";
  std::string work_dir;
  CLI::App app{"fsdp-bench peers: fsdp.cpp vs PyTorch DDP / FSDP2 and Lightning (JSON + table)"};
  app.add_option("--model", run.model, "transformer-tiny | transformer-small")
      ->check(fsdp::cli::one_of({"transformer-tiny", "transformer-small"}))
      ->capture_default_str();
  app.add_option("--devices", run.devices, "ranks (processes), Gloo on loopback")
      ->check(fsdp::cli::between(1, 64))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "timed optimizer steps")
      ->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "untimed optimizer steps first")
      ->check(fsdp::cli::between(int64_t{1}, int64_t{1000}))
      ->capture_default_str();
  app.add_option("--vocab-size", run.vocab_size, "synthetic vocabulary (0: the preset's)")
      ->check(fsdp::cli::at_least(int64_t{0}))
      ->capture_default_str();
  app.add_option("--batch-size", run.batch_size, "per rank")
      ->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--block-size", run.block_size, "tokens per sample")
      ->check(fsdp::cli::at_least(int64_t{1}))
      ->capture_default_str();
  app.add_option("--dropout", run.dropout)->check(fsdp::cli::between(0.0, 0.99))->capture_default_str();
  app.add_option("--lr", run.lr)->check(fsdp::cli::greater_than(0.0))->capture_default_str();
  app.add_option("--seed", run.seed)->capture_default_str();
  app.add_option("--systems", systems_arg, "comma list of pytorch, fsdp.cpp, lightning, deepspeed")
      ->capture_default_str();
  app.add_option("--configs", configs_arg,
                 "comma list of ddp, full_shard, shard_grad_op, full_shard_bf16, zero1, zero2, "
                 "zero3")
      ->capture_default_str();
  app.add_option("--python", o.python, "interpreter with torch 2.x and lightning")
      ->capture_default_str();
  app.add_option("--peers-dir", o.peers, "folder of torch_peer.py and lightning_peer.py")
      ->capture_default_str();
  app.add_option("--fsdp-train", o.fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "logs, batches, summaries (default: a fresh /tmp dir)");
  app.add_option("--markdown", o.markdown, "also write the markdown table to this file");
  app.add_option("--timeout", run.timeout_s, "seconds per run before it is killed")
      ->capture_default_str();
  if (auto status = fsdp::bench::parse_args(app, "peers", args)) return *status;

  o.systems = fsdp::bench::split_list(systems_arg);
  for (const auto& s : o.systems) {
    if (s != "pytorch" && s != "fsdp.cpp" && s != "lightning" && s != "deepspeed") {
      std::cerr << "fsdp-bench peers: error: unknown system '" << s
                << "' in --systems; valid: pytorch, fsdp.cpp, lightning, deepspeed\n";
      return 2;
    }
  }
  auto picked = fsdp::bench::pick_by_name(all_configs(), &PeersConfig::name, configs_arg, "peers",
                                          "configuration", "--configs");
  if (!picked) return 2;
  const std::vector<PeersConfig> configs = std::move(*picked);
  run.steps = o.warmup + o.steps;
  run.vocab_size = fsdp::demos::transformer_preset(run.model, run.vocab_size).vocab_size;
  if (o.fsdp_train.empty()) o.fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  run.dir = work_dir.empty()
                ? fs::temp_directory_path() / ("fsdp-bench-peers-" + std::to_string(getpid()))
                : fs::path(work_dir);
  fs::create_directories(run.dir);
  if (!fs::exists(o.fsdp_train)) {
    std::cerr << "fsdp-bench peers: error: " << o.fsdp_train
              << " not found; build it (cmake --build build --target fsdp-train) or pass "
                 "--fsdp-train PATH\n";
    return 1;
  }

  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  json out;
  out["bench"] = "peers";
  out["config"] = {{"model", run.model}, {"vocab_size", run.vocab_size},
                   {"world_size", run.devices}, {"backend", "gloo"},
                   {"batch_size_per_rank", run.batch_size}, {"block_size", run.block_size},
                   {"warmup", o.warmup}, {"steps", o.steps}, {"dropout", run.dropout},
                   {"optimizer", "adam"}, {"lr", run.lr}, {"seed", run.seed},
                   {"data", "synthetic, the batches of fsdp-train --save-batches"},
                   {"cores", cores},
                   {"threads_per_rank", std::max(1u, cores / static_cast<unsigned>(run.devices))}};
  out["load_average_start"] = fsdp::bench::load_average();

  // The batches every system trains on: fsdp-train's own, written once.
  out["batches"] = fsdp::bench::write_batches(o.fsdp_train, run);
  if (out["batches"].contains("error")) {
    std::cerr << "fsdp-bench peers: error: " << out["batches"]["error"].get<std::string>() << "\n";
    return 1;
  }

  json runs = json::array();
  for (const auto& c : configs) {
    const bool zero = fsdp::strategy_entry(c.fsdp_train).family == fsdp::StrategyFamily::kDeepSpeed;
    for (const std::string system : {"pytorch", "fsdp.cpp", "lightning", "deepspeed"}) {
      if (std::find(o.systems.begin(), o.systems.end(), system) == o.systems.end()) continue;
      // DeepSpeed runs the ZeRO configurations only, PyTorch and Lightning the others.
      if (system != "fsdp.cpp" && (system == "deepspeed") != zero) continue;
      std::fprintf(stderr, "[bench peers] %s %s, %d rank(s) ...\n", system.c_str(),
                   c.label.c_str(), run.devices);
      runs.push_back(finish(run_one(o, c, system), o));
    }
  }
  // Ratios to PyTorch DDP of this run.
  const json* base = nullptr;
  for (const auto& r : runs) {
    if (r["system"] == "pytorch-ddp" && !r.contains("error")) base = &r;
  }
  if (base) {
    const double it = (*base)["it_per_s"].get<double>();
    const double rss = (*base)["peak_rss_mb_max"].get<double>();
    for (auto& r : runs) {
      if (r.contains("error")) continue;
      r["it_per_s_vs_pytorch_ddp"] = r["it_per_s"].get<double>() / it;
      r["peak_rss_vs_pytorch_ddp"] = r["peak_rss_mb_max"].get<double>() / rss;
    }
  }
  // fsdp.cpp over PyTorch in the same configuration (DDP over PyTorch DDP, FULL_SHARD over
  // FSDP2, ...), against the goal of 1.25.
  json over_pytorch = json::object();
  for (auto& r : runs) {
    if (r["system"] != "fsdp.cpp" || r.contains("error")) continue;
    for (const auto& p : runs) {
      const std::string sys = p["system"].get<std::string>();
      if (p["config"] == r["config"] && sys.rfind("pytorch-", 0) == 0 && !p.contains("error")) {
        r["it_per_s_vs_pytorch_same_config"] = r["it_per_s"].get<double>() / p["it_per_s"].get<double>();
        over_pytorch[r["config"].get<std::string>()] = {
            {"baseline", sys}, {"ratio", r["it_per_s_vs_pytorch_same_config"]}, {"goal", 1.25}};
      }
    }
  }
  out["goal3_fsdp_cpp_over_pytorch"] = over_pytorch;
  out["baseline"] = base ? json("pytorch-ddp") : json(nullptr);
  out["runs"] = runs;
  out["work_dir"] = run.dir.string();
  return fsdp::bench::print_report(out, o.markdown, peers_markdown_table);
}

fsdp::bench::Registrar reg_peers("peers",
                           "fsdp.cpp vs PyTorch DDP/FSDP2 and Lightning: it/s, peak RSS (JSON)",
                           run_peers);

}  // namespace
