// fsdp-bench train: training throughput of fsdp.cpp (strategy single, and ddp at world 2)
// against PyTorch DDP (Debian's python3-torch, Gloo, 2 processes on loopback) on the same
// model, batch and optimizer, measured in one run. Prints one JSON object.
//
//   fsdp-bench train [--model transformer-small] [--steps 12] [--vocab-size 33278] ...
//
// fsdp.cpp runs go through build/bin/fsdp-train --summary-json (it/s there excludes the first
// step); the PyTorch peer is bench/peers/ddp_peer.py (its first --warmup steps are excluded the
// same way). Intra-op threads: fsdp-train gives each rank cores / local ranks, and so does the
// peer. The headline is ratio_ddp (fsdp.cpp DDP it/s / PyTorch DDP it/s; > 1 means fsdp.cpp is
// faster).
#include "bench.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Config {
  std::string model = "transformer-small";
  int64_t vocab_size = 33278;  // the preset's (WikiText-2) vocabulary
  int64_t batch_size = 4;      // per rank
  int64_t block_size = 35;
  int64_t steps = 12;          // optimizer steps per run; the first is warm-up (not timed)
  double dropout = 0.2;        // the Lightning demo's default
  double lr = 1e-3;
  int64_t seed = 42;
  int world = 2;
  std::string python = "/usr/bin/python3";
  std::string peer;            // default: bench/peers/ddp_peer.py next to this source
  std::string fsdp_train;      // default: fsdp-train next to fsdp-bench
  std::string work_dir;        // default: a fresh directory under /tmp
  bool skip_single = false;
};

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

std::string read_file(const fs::path& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& text, size_t max_chars = 1500) {
  return text.size() <= max_chars ? text : "..." + text.substr(text.size() - max_chars);
}

// Runs argv with stdout/stderr to files in dir; returns the exit status.
int run(const std::vector<std::string>& argv, const fs::path& out, const fs::path& err) {
  std::string cmd;
  for (const auto& a : argv) cmd += quote(a) + " ";
  cmd += "> " + quote(out.string()) + " 2> " + quote(err.string());
  int status = std::system(cmd.c_str());
  if (status == -1) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

json run_fsdp_train(const Config& c, const std::string& strategy, int devices,
                    const fs::path& dir) {
  const fs::path summary = dir / ("summary_" + strategy + ".json");
  std::vector<std::string> argv = {
      c.fsdp_train,          "--model",        c.model,
      "--data",              "synthetic",      "--vocab-size",
      std::to_string(c.vocab_size),            "--strategy",
      strategy,              "--devices",      std::to_string(devices),
      "--batch-size",        std::to_string(c.batch_size),
      "--block-size",        std::to_string(c.block_size),
      "--max-steps",         std::to_string(c.steps),
      "--dropout",           std::to_string(c.dropout),
      "--lr",                std::to_string(c.lr),
      "--seed",              std::to_string(c.seed),
      "--limit-val-batches", "0",
      "--no-progress-bar",   "--default-root-dir", (dir / "logs").string(),
      "--summary-json",      summary.string()};
  const fs::path out = dir / (strategy + ".out"), err = dir / (strategy + ".err");
  std::fprintf(stderr, "[bench train] fsdp.cpp %s, %d rank(s) ...\n", strategy.c_str(), devices);
  const int code = run(argv, out, err);
  json r;
  r["command"] = [&] {
    std::string s;
    for (const auto& a : argv) s += (s.empty() ? "" : " ") + a;
    return s;
  }();
  if (code != 0 || !fs::exists(summary)) {
    r["error"] = "fsdp-train exited with status " + std::to_string(code) + ": " +
                 tail(read_file(err));
    return r;
  }
  json s = json::parse(read_file(summary));
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  r["it_per_s"] = s["it_per_s"];
  r["samples_per_s"] = s["it_per_s"].get<double>() * c.batch_size * devices;
  r["world_size"] = s["world_size"];
  r["threads_per_rank"] = std::max(1u, cores / static_cast<unsigned>(devices));
  r["params"] = s["params"];
  r["steps"] = s["steps"];
  r["peak_alloc_mb"] = s["peak_alloc_mb"];
  r["peak_rss_mb"] = s["peak_rss_mb"];
  r["final_loss"] = s["final_loss"];
  return r;
}

json run_peer(const Config& c, const fs::path& dir) {
  json r;
  if (!fs::exists(c.python)) {
    r["available"] = false;
    r["error"] = c.python + " not found: install Debian's python3-torch to run the PyTorch peer";
    return r;
  }
  const fs::path probe_out = dir / "probe.out", probe_err = dir / "probe.err";
  if (run({c.python, "-c", "import torch, torch.distributed; print(torch.__version__)"}, probe_out,
          probe_err) != 0) {
    r["available"] = false;
    r["error"] = "python3-torch is missing (" + c.python +
                 " cannot import torch): apt-get install python3-torch to run the PyTorch peer; " +
                 tail(read_file(probe_err), 300);
    return r;
  }
  if (!fs::exists(c.peer)) {
    r["available"] = false;
    r["error"] = "peer script not found at " + c.peer + " (pass --peer PATH)";
    return r;
  }
  // Same number of timed steps as fsdp-train (which excludes its first step).
  std::vector<std::string> argv = {c.python,       c.peer,
                                   "--model",      c.model,
                                   "--vocab",      std::to_string(c.vocab_size),
                                   "--world",      std::to_string(c.world),
                                   "--batch-size", std::to_string(c.batch_size),
                                   "--block",      std::to_string(c.block_size),
                                   "--steps",      std::to_string(std::max<int64_t>(1, c.steps - 1)),
                                   "--warmup",     "1",
                                   "--lr",         std::to_string(c.lr),
                                   "--dropout",    std::to_string(c.dropout),
                                   "--seed",       std::to_string(c.seed)};
  std::fprintf(stderr, "[bench train] PyTorch DDP (gloo), %d ranks ...\n", c.world);
  const fs::path out = dir / "peer.out", err = dir / "peer.err";
  const int code = run(argv, out, err);
  r["available"] = true;
  if (code != 0) {
    r["error"] = "ddp_peer.py exited with status " + std::to_string(code) + ": " +
                 tail(read_file(err));
    return r;
  }
  std::string text = read_file(out), last;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && line[0] == '{') last = line;
  }
  if (last.empty()) {
    r["error"] = "ddp_peer.py printed no JSON: " + tail(text + read_file(err));
    return r;
  }
  json p = json::parse(last);
  for (auto it = p.begin(); it != p.end(); ++it) r[it.key()] = it.value();
  r["samples_per_s"] = p["it_per_s"].get<double>() * c.batch_size * c.world;
  return r;
}

int run_train(const std::vector<std::string>& args) {
  Config c;
  CLI::App app{"fsdp-bench train: fsdp.cpp single / DDP vs PyTorch DDP throughput (JSON)"};
  app.add_option("--model", c.model, "transformer-tiny | transformer-small")
      ->check(CLI::IsMember({"transformer-tiny", "transformer-small"}))
      ->capture_default_str();
  app.add_option("--vocab-size", c.vocab_size, "synthetic vocabulary")->capture_default_str();
  app.add_option("--batch-size", c.batch_size, "per rank")->capture_default_str();
  app.add_option("--block-size", c.block_size, "tokens per sample")->capture_default_str();
  app.add_option("--steps", c.steps, "optimizer steps per run, first one not timed")
      ->check(CLI::Range(2, 100000))
      ->capture_default_str();
  app.add_option("--dropout", c.dropout)->capture_default_str();
  app.add_option("--lr", c.lr)->capture_default_str();
  app.add_option("--python", c.python, "interpreter with python3-torch")->capture_default_str();
  app.add_option("--peer", c.peer, "path of bench/peers/ddp_peer.py");
  app.add_option("--fsdp-train", c.fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", c.work_dir, "where logs and summaries go (default: /tmp)");
  app.add_flag("--skip-single", c.skip_single, "do not run fsdp.cpp strategy single");
  if (auto status = fsdp::bench::parse_args(app, "train", args)) return *status;
  if (c.fsdp_train.empty()) c.fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  if (c.peer.empty()) {
    fs::path here = fs::path(__FILE__).parent_path() / "peers" / "ddp_peer.py";
    fs::path from_exe = fsdp::bench::self_dir() / ".." / ".." / "bench" / "peers" / "ddp_peer.py";
    c.peer = (fs::exists(here) ? here : from_exe).lexically_normal().string();
  }
  if (c.work_dir.empty()) {
    c.work_dir = (fs::temp_directory_path() / ("fsdp-bench-train-" + std::to_string(getpid())))
                     .string();
  }
  fs::create_directories(c.work_dir);
  if (!fs::exists(c.fsdp_train)) {
    std::cerr << "fsdp-bench train: error: " << c.fsdp_train
              << " not found; build it (cmake --build build --target fsdp-train) or pass "
                 "--fsdp-train PATH\n";
    return 1;
  }

  json out;
  out["bench"] = "train";
  out["config"] = {{"model", c.model},         {"vocab_size", c.vocab_size},
                   {"batch_size_per_rank", c.batch_size}, {"block_size", c.block_size},
                   {"steps", c.steps},         {"timed_steps", c.steps - 1},
                   {"dropout", c.dropout},     {"optimizer", "adam"},
                   {"lr", c.lr},               {"data", "synthetic"},
                   {"cores", std::thread::hardware_concurrency()}};
  if (!c.skip_single) out["fsdp_single"] = run_fsdp_train(c, "single", 1, c.work_dir);
  out["fsdp_ddp"] = run_fsdp_train(c, "ddp", c.world, c.work_dir);
  out["pytorch_ddp"] = run_peer(c, c.work_dir);

  const json& ours = out["fsdp_ddp"];
  const json& peer = out["pytorch_ddp"];
  if (ours.contains("it_per_s") && peer.contains("it_per_s")) {
    out["ratio_ddp"] = ours["it_per_s"].get<double>() / peer["it_per_s"].get<double>();
    out["ratio_ddp_note"] = "fsdp.cpp DDP it/s / PyTorch DDP it/s at world " +
                            std::to_string(c.world) + " (> 1: fsdp.cpp faster)";
  } else {
    out["ratio_ddp"] = nullptr;
  }
  if (out.contains("fsdp_single") && out["fsdp_single"].contains("samples_per_s") &&
      ours.contains("samples_per_s")) {
    out["ddp_scaling"] = ours["samples_per_s"].get<double>() /
                         out["fsdp_single"]["samples_per_s"].get<double>();
    out["ddp_scaling_note"] = "samples/s of fsdp.cpp DDP over fsdp.cpp single (same cores)";
  }
  out["work_dir"] = c.work_dir;
  std::cout << out.dump(2) << std::endl;
  const bool ok = ours.contains("it_per_s") &&
                  (out.contains("fsdp_single") ? out["fsdp_single"].contains("it_per_s") : true);
  return ok ? 0 : 1;
}

fsdp::bench::Registrar reg("train",
                           "training it/s: fsdp.cpp single and DDP (world 2) vs PyTorch DDP",
                           run_train);

}  // namespace
