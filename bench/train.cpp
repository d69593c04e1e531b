// fsdp-bench train: training throughput of fsdp.cpp (strategy single, and ddp at world 2)
// against PyTorch DDP (FSDP_PYTHON's torch, Gloo, 2 processes on loopback) on the same model,
// batches and optimizer, measured in one run. Prints one JSON object.
//
//   fsdp-bench train [--model transformer-small] [--steps 12] [--vocab-size 33278] ...
//
// fsdp.cpp runs go through build/bin/fsdp-train --summary-json; the PyTorch peer is
// bench/peers/torch_peer.py --strategy ddp on the batches `fsdp-train --save-batches` wrote
// (runs.h). Every run's it/s excludes its first step, computed from its step end times by one
// function (runs.h it_per_s). Intra-op threads: cores / local ranks for every rank. The headline
// is ratio_ddp (fsdp.cpp DDP it/s / PyTorch DDP it/s; > 1 means fsdp.cpp is faster).
// `fsdp-bench peers` is the wider comparison (FSDP2, Lightning, every sharding strategy).
#include "bench.h"
#include "../apps/cli.h"
#include "runs.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Adds it/s (first step excluded) and samples/s to a run's report.
json timed(json r, const fsdp::bench::TrainRun& run) {
  if (r.contains("error")) return r;
  r["it_per_s"] = fsdp::bench::it_per_s(r.value("step_end_seconds", std::vector<double>{}), 1);
  if (r["it_per_s"].is_number()) {
    r["samples_per_s"] = r["it_per_s"].get<double>() * run.batch_size * run.devices;
  }
  return r;
}

int run_train(const std::vector<std::string>& args) {
  fsdp::bench::TrainRun run;
  run.steps = 12;
  run.vocab_size = 33278;  // the preset's (WikiText-2) vocabulary
  std::string python = fsdp::bench::default_python();
  std::string peer = (fs::path(fsdp::bench::peers_dir()) / "torch_peer.py").string();
  std::string fsdp_train, work_dir;
  bool skip_single = false;
  CLI::App app{"fsdp-bench train: fsdp.cpp single / DDP vs PyTorch DDP throughput (JSON)"};
  app.add_option("--model", run.model, "transformer-tiny | transformer-small")
      ->check(fsdp::cli::one_of({"transformer-tiny", "transformer-small"}))
      ->capture_default_str();
  app.add_option("--vocab-size", run.vocab_size, "synthetic vocabulary")->capture_default_str();
  app.add_option("--batch-size", run.batch_size, "per rank")->capture_default_str();
  app.add_option("--block-size", run.block_size, "tokens per sample")->capture_default_str();
  app.add_option("--steps", run.steps, "optimizer steps per run, first one not timed")
      ->check(fsdp::cli::between(2, 100000))
      ->capture_default_str();
  app.add_option("--dropout", run.dropout)->capture_default_str();
  app.add_option("--lr", run.lr)->capture_default_str();
  app.add_option("--python", python, "interpreter with torch 2.x (CMake's FSDP_PYTHON)")
      ->capture_default_str();
  app.add_option("--peer", peer, "path of bench/peers/torch_peer.py")->capture_default_str();
  app.add_option("--fsdp-train", fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "where logs and summaries go (default: /tmp)");
  app.add_flag("--skip-single", skip_single, "do not run fsdp.cpp strategy single");
  if (auto status = fsdp::bench::parse_args(app, "train", args)) return *status;
  if (fsdp_train.empty()) fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  run.dir = work_dir.empty()
                ? fs::temp_directory_path() / ("fsdp-bench-train-" + std::to_string(getpid()))
                : fs::path(work_dir);
  fs::create_directories(run.dir);
  if (!fs::exists(fsdp_train)) {
    std::cerr << "fsdp-bench train: error: " << fsdp_train
              << " not found; build it (cmake --build build --target fsdp-train) or pass "
                 "--fsdp-train PATH\n";
    return 1;
  }

  json out;
  out["bench"] = "train";
  out["config"] = {{"model", run.model},         {"vocab_size", run.vocab_size},
                   {"batch_size_per_rank", run.batch_size}, {"block_size", run.block_size},
                   {"steps", run.steps},         {"timed_steps", run.steps - 1},
                   {"dropout", run.dropout},     {"optimizer", "adam"},
                   {"lr", run.lr},               {"data", "synthetic"},
                   {"cores", std::thread::hardware_concurrency()}};
  run.devices = 2;
  out["batches"] = fsdp::bench::write_batches(fsdp_train, run);
  if (!skip_single) {
    fsdp::bench::TrainRun single = run;
    single.devices = 1;
    out["fsdp_single"] =
        timed(fsdp::bench::run_fsdp_train(fsdp_train, single, {"--strategy", "single"}, "single"),
              single);
  }
  out["fsdp_ddp"] =
      timed(fsdp::bench::run_fsdp_train(fsdp_train, run, {"--strategy", "ddp"}, "ddp"), run);
  out["pytorch_ddp"] =
      out["batches"].contains("error")
          ? json{{"error", out["batches"]["error"]}}
          : timed(fsdp::bench::run_peer(python, peer, run, {"--strategy", "ddp"}, "pytorch-ddp"),
                  run);

  const json& ours = out["fsdp_ddp"];
  const json& theirs = out["pytorch_ddp"];
  if (ours.value("it_per_s", json()).is_number() && theirs.value("it_per_s", json()).is_number()) {
    out["ratio_ddp"] = ours["it_per_s"].get<double>() / theirs["it_per_s"].get<double>();
    out["ratio_ddp_note"] = "fsdp.cpp DDP it/s / PyTorch DDP it/s at world 2 (> 1: fsdp.cpp faster)";
  } else {
    out["ratio_ddp"] = nullptr;
  }
  if (out.contains("fsdp_single") && out["fsdp_single"].contains("samples_per_s") &&
      ours.contains("samples_per_s")) {
    out["ddp_scaling"] = ours["samples_per_s"].get<double>() /
                         out["fsdp_single"]["samples_per_s"].get<double>();
    out["ddp_scaling_note"] = "samples/s of fsdp.cpp DDP over fsdp.cpp single (same cores)";
  }
  out["work_dir"] = run.dir.string();
  std::cout << out.dump(2) << std::endl;
  const bool ok = ours.contains("it_per_s") &&
                  (out.contains("fsdp_single") ? out["fsdp_single"].contains("it_per_s") : true);
  return ok ? 0 : 1;
}

fsdp::bench::Registrar reg_train("train",
                           "training it/s: fsdp.cpp single and DDP (world 2) vs PyTorch DDP",
                           run_train);

}  // namespace
