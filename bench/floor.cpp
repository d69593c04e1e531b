// fsdp-bench floor / llmc: a training step against what this machine can do, measured in one run.
//
//   fsdp-bench floor [--model transformer-1b] [--devices 2] [--backend mpi] [--steps 4]
//       Runs fsdp-train FULL_SHARD and prints its step time beside a floor computed from rates
//       measured in the same invocation, and where the step's time went (forward, backward,
//       optimizer, communication; fsdp-train --summary-json). Goal: step <= 1.5 x floor.
//   fsdp-bench llmc --llmc-dir PATH [--steps 8]
//       Builds llm.c's CPU trainer (train_gpt2.c from a checkout given on the command line; never
//       vendored) beside the project, runs it on GPT-2 124M at B 4, T 64 with a random checkpoint
//       and random tokens written here in its file formats, and runs fsdp-train --model gpt2-124m
//       --strategy single on the same shapes. Goals: fsdp.cpp >= 3 x llm.c, step <= 1.3 x floor.
//
// The floor (Note [Step floor]):
//   compute   = the step's matmuls (forward, input gradient, weight gradient of every Linear at
//               the run's shapes) each timed with at::mm at the rank's thread count, summed;
//               attention's two batched matmuls per block are left out (their flops are printed:
//               under 1% of the Linear flops at these lengths);
//   optimizer = Adam's memory traffic per rank (fp32 read p, g, m, v; write p, m, v: 28 B per
//               element of the rank's shard) / the measured in-place bandwidth (bench/bandwidth.cpp);
//   comm      = FULL_SHARD's collective bytes per rank (all-gather of the parameters in forward
//               and again in backward, reduce-scatter of the gradients) / the algorithmic
//               bandwidth `fsdp-bench comm` measures for the backend at the world size, 64 MiB.
//   floor     = compute + optimizer + comm. On this machine the ranks share the cores with their
//               communication, so the parts add; a machine with spare cores could hide comm.
// Rates are measured in this process with the thread count each rank gets
// (cores / devices), while the other cores are idle: slightly optimistic for a floor.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench.h"
#include "runs.h"
#include "fsdp/models.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Best-of-`reps` seconds of fn() after one warm-up call.
template <typename F>
double best_seconds(F&& fn, int reps) {
  fn();
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    fn();
    best = std::min(best, fsdp::bench::seconds_since(t0));
  }
  return best;
}

// One Linear of the model: y (m x out) = x (m x in) W^T, applied `count` times per step.
struct LinearShape {
  std::string name;
  int64_t m, in, out, count;
};

// The Linears of a forward pass with `tokens` rows (batch x block), per preset. Attention's
// q k^T and (softmax) v are not Linears: attention_flops counts them.
std::vector<LinearShape> linear_shapes(const std::string& model, int64_t vocab, int64_t tokens,
                                       int64_t block, double* attention_flops) {
  std::vector<LinearShape> v;
  if (fsdp::demos::is_transformer_model(model)) {
    auto o = fsdp::demos::transformer_preset(model, vocab);
    const int64_t d = o.ninp, f = o.nhid, L = o.nlayers;
    // Encoder layer: in-projection (q, k, v), out-projection, two FFN Linears. Decoder layer: the
    // same for self-attention, cross-attention's q, its k and v on the memory, its out-projection,
    // and the FFN. Then the output Linear to the vocabulary.
    v = {{"attn in-proj (enc+dec self)", tokens, d, 3 * d, 2 * L},
         {"attn out-proj (enc+dec self+cross)", tokens, d, d, 3 * L},
         {"cross-attn q", tokens, d, d, L},
         {"cross-attn k,v", tokens, d, 2 * d, L},
         {"ffn up", tokens, d, f, 2 * L},
         {"ffn down", tokens, f, d, 2 * L},
         {"output", tokens, d, o.vocab_size, 1}};
    *attention_flops = 3.0 * 4.0 * tokens * block * d * (3 * L);  // fwd + 2x bwd, 3L blocks
  } else {
    auto o = fsdp::demos::gpt_preset(model, vocab);
    const int64_t d = o.n_embd, L = o.n_layer;
    v = {{"attn qkv", tokens, d, 3 * d, L},
         {"attn proj", tokens, d, d, L},
         {"mlp fc", tokens, d, 4 * d, L},
         {"mlp proj", tokens, 4 * d, d, L},
         {"lm head (tied wte)", tokens, d, o.vocab_size, 1}};
    // causal: half the scores are needed; counted in full as the kernels compute them
    *attention_flops = 3.0 * 4.0 * tokens * block * d * L;
  }
  return v;
}

// Seconds of the step's matmuls at this machine's at::mm rate: per Linear forward (x W^T),
// input gradient (dy W) and weight gradient (dy^T x), each timed at its own shape.
json compute_floor(const std::string& model, int64_t vocab, int64_t tokens, int64_t block) {
  double attention_flops = 0;
  auto shapes = linear_shapes(model, vocab, tokens, block, &attention_flops);
  json rows = json::array();
  double seconds = 0, flops = 0;
  for (const auto& s : shapes) {
    auto x = at::randn({s.m, s.in});
    auto w = at::randn({s.out, s.in});
    auto dy = at::randn({s.m, s.out});
    const double t_fwd = best_seconds([&] { (void)at::mm(x, w.t()); }, 3);
    const double t_dx = best_seconds([&] { (void)at::mm(dy, w); }, 3);
    const double t_dw = best_seconds([&] { (void)at::mm(dy.t(), x); }, 3);
    const double t = (t_fwd + t_dx + t_dw) * s.count;
    const double f = 6.0 * s.m * s.in * s.out * s.count;
    seconds += t;
    flops += f;
    rows.push_back({{"linear", s.name}, {"m", s.m}, {"in", s.in}, {"out", s.out},
                    {"per_step", s.count}, {"seconds", t}, {"gflops", f / t / 1e9}});
  }
  return {{"seconds", seconds},
          {"linear_flops", flops},
          {"gflops", flops / seconds / 1e9},
          {"attention_flops_not_counted", attention_flops},
          {"attention_share_of_flops", attention_flops / (flops + attention_flops)},
          {"linears", rows}};
}

// libtorch's Adam step on `n` fp32 elements: seconds per element (for the record beside the
// bandwidth floor; the floor itself uses the bandwidth).
double adam_seconds_per_element(int64_t n) {
  auto p = at::randn({n}).set_requires_grad(true);
  p.mutable_grad() = at::randn({n});
  torch::optim::Adam opt({p}, torch::optim::AdamOptions(1e-4));
  const double t = best_seconds([&] { opt.step(); }, 3);
  return t / static_cast<double>(n);
}

// `fsdp-bench comm` for one backend and world at 64 MiB: {"all_gather": GB/s, ...} or {"error"}.
json collective_bandwidth(const std::string& backend, int world, const fs::path& dir) {
  const std::string self = (fsdp::bench::self_dir() / "fsdp-bench").string();
  std::vector<std::string> argv = {self,     "comm",          "--backends", backend,
                                   "--worlds", std::to_string(world), "--sizes-mib", "64"};
  const fs::path out = dir / "comm.out", err = dir / "comm.err";
  const int code = fsdp::bench::run_program(argv, out, err, 600);
  json r = {{"command", fsdp::bench::command_line(argv)}};
  if (code != 0) {
    r["error"] = "fsdp-bench comm exited with status " + std::to_string(code) + ": " +
                 fsdp::bench::tail(fsdp::bench::read_text(err));
    return r;
  }
  json j = json::parse(fsdp::bench::read_text(out), nullptr, false);
  if (j.is_discarded() || !j.contains("results")) {
    r["error"] = "fsdp-bench comm printed no JSON: " + fsdp::bench::tail(fsdp::bench::read_text(out));
    return r;
  }
  for (const auto& row : j["results"]) r[row["op"].get<std::string>()] = row["algbw_gbps"];
  return r;
}

// Mean over steps 2..n of a per-step series of the summary (the first step is warm-up).
double mean_after_first(const json& series) {
  if (!series.is_array() || series.size() < 2) return 0;
  double s = 0;
  for (size_t i = 1; i < series.size(); ++i) s += series[i].get<double>();
  return s / static_cast<double>(series.size() - 1);
}

// Seconds per step (steps 2..n) and the per-phase means from an fsdp-train summary.
json step_and_phases(const json& r) {
  json out;
  const auto& ends = r["step_end_seconds"];
  const size_t n = ends.size();
  out["step_seconds"] =
      (ends[n - 1].get<double>() - ends[0].get<double>()) / static_cast<double>(n - 1);
  for (const char* phase : {"forward", "backward", "optimizer", "comm"}) {
    const std::string key = std::string(phase) + "_seconds";
    if (r.contains(key)) out[key] = mean_after_first(r[key]);
  }
  if (out.contains("forward_seconds")) {
    out["other_seconds"] = out["step_seconds"].get<double>() -
                           out["forward_seconds"].get<double>() -
                           out["backward_seconds"].get<double>() -
                           out["optimizer_seconds"].get<double>();
  }
  return out;
}

fs::path work_dir_for(const std::string& name, const std::string& given) {
  fs::path dir = given.empty() ? fs::temp_directory_path() /
                                     ("fsdp-bench-" + name + "-" + std::to_string(getpid()))
                               : fs::path(given);
  fs::create_directories(dir);
  return dir;
}

int threads_per_rank(int devices) {
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / devices);
}

// ---------------------------------------------------------------------------------------------
int run_floor(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench floor: an FSDP step against the machine's floor",
               "fsdp-bench floor"};
  fsdp::bench::TrainRun run;
  run.model = "transformer-1b";
  run.batch_size = 1;
  run.steps = 4;
  run.dropout = 0.0;
  run.timeout_s = 3600;
  std::string backend = "mpi", fsdp_train, work_dir, optimizer = "adam";
  app.add_option("--model", run.model, "transformer-* or gpt2-* preset")->capture_default_str();
  app.add_option("--vocab-size", run.vocab_size, "synthetic vocabulary (0: the preset's)")
      ->capture_default_str();
  app.add_option("--devices", run.devices, "ranks")->capture_default_str();
  app.add_option("--batch-size", run.batch_size, "per rank")->capture_default_str();
  app.add_option("--block-size", run.block_size, "tokens per sample")->capture_default_str();
  app.add_option("--steps", run.steps, "optimizer steps, the first not timed")
      ->capture_default_str();
  app.add_option("--backend", backend, "gloo | mpi")->capture_default_str();
  app.add_option("--optimizer", optimizer, "fsdp-train --optimizer (adam | cpu_adam ...)")
      ->capture_default_str();
  app.add_option("--fsdp-train", fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "where logs and summaries go (default: /tmp)");
  if (auto status = fsdp::bench::parse_args(app, "floor", args)) return *status;
  TORCH_CHECK(run.steps >= 2, "[fsdp-bench floor] --steps must be at least 2 (the first is "
              "warm-up and not timed)");
  if (fsdp_train.empty()) fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  run.dir = work_dir_for("floor", work_dir);

  json out{{"bench", "floor"}, {"goal", "FULL_SHARD step <= 1.5 x floor"}};
  const int threads = threads_per_rank(run.devices);
  out["config"] = {{"model", run.model},       {"vocab_size", run.vocab_size}, {"devices", run.devices},
                   {"batch_size", run.batch_size}, {"block_size", run.block_size},
                   {"steps", run.steps},       {"backend", backend},
                   {"optimizer", optimizer},   {"threads_per_rank", threads},
                   {"cores", std::thread::hardware_concurrency()}};

  // The run first (it needs the memory; the probes below are small).
  std::cerr << "[fsdp-bench floor] fsdp-train " << run.model << " FULL_SHARD, world "
            << run.devices << " (" << backend << ")..." << std::endl;
  json train = fsdp::bench::run_fsdp_train(
      fsdp_train, run,
      {"--strategy", "fsdp", "--sharding-strategy", "FULL_SHARD", "--backend", backend,
       "--optimizer", optimizer},
      "full_shard");
  out["run"] = train;
  if (train.contains("error")) {
    std::cout << out.dump(2) << std::endl;
    return 1;
  }
  const int64_t params = train["params"].get<int64_t>();

  std::cerr << "[fsdp-bench floor] measuring matmul, memory and collective rates..." << std::endl;
  at::set_num_threads(threads);
  json compute = compute_floor(run.model, run.vocab_size, run.batch_size * run.block_size, run.block_size);
  const double update_bw = fsdp::bench::update_bandwidth();
  const int64_t shard = (params + run.devices - 1) / run.devices;
  const double optimizer_floor = 28.0 * static_cast<double>(shard) / update_bw;
  const double adam_spe = adam_seconds_per_element(int64_t{16} << 20);
  json comm = collective_bandwidth(backend, run.devices, run.dir);
  json floor{{"compute_seconds", compute["seconds"]},
             {"optimizer_seconds", optimizer_floor},
             {"memory_gbps", update_bw / 1e9},
             {"libtorch_adam_seconds_for_shard", adam_spe * static_cast<double>(shard)},
             {"compute", compute},
             {"collectives", comm}};
  double comm_floor = 0;
  if (!comm.contains("error")) {
    const double bytes = 4.0 * static_cast<double>(params);  // the full fp32 parameters
    // Algorithmic bandwidth is full-buffer bytes / time (fsdp-bench comm's convention).
    comm_floor = 2.0 * bytes / (comm["all_gather"].get<double>() * 1e9) +
                 bytes / (comm["reduce_scatter"].get<double>() * 1e9);
    floor["comm_seconds"] = comm_floor;
  }
  const double floor_s = compute["seconds"].get<double>() + optimizer_floor + comm_floor;
  floor["seconds"] = floor_s;
  out["floor"] = floor;
  json measured = step_and_phases(train);
  out["measured"] = measured;
  out["step_over_floor"] = measured["step_seconds"].get<double>() / floor_s;
  out["goal_met"] = out["step_over_floor"].get<double>() <= 1.5;
  std::cout << out.dump(2) << std::endl;

  std::ostringstream t;
  t << std::fixed << std::setprecision(2) << "| " << run.model << " FULL_SHARD world "
    << run.devices << " " << backend << " | measured s | floor s |\n|---|---|---|\n"
    << "| step | " << measured["step_seconds"].get<double>() << " | " << floor_s << " |\n"
    << "| forward + backward | "
    << measured.value("forward_seconds", 0.0) + measured.value("backward_seconds", 0.0) << " | "
    << compute["seconds"].get<double>() << " (matmuls) |\n"
    << "| optimizer | " << measured.value("optimizer_seconds", 0.0) << " | " << optimizer_floor
    << " (28 B/elem at " << update_bw / 1e9 << " GB/s) |\n"
    << "| collectives (comm thread busy) | " << measured.value("comm_seconds", 0.0) << " | "
    << comm_floor << " |\n"
    << "step / floor = " << out["step_over_floor"].get<double>() << " (goal <= 1.5)\n";
  std::cerr << t.str();
  return 0;
}

// ---------------------------------------------------------------------------------------------
// llm.c's file formats (train_gpt2.c, llmc/dataloader.h): a model header of 256 int32 (magic
// 20240326, version 3, maxT, V, L, NH, C, Vp) then the fp32 parameters; a token file header of
// 256 int32 (magic 20240520, version 1, token count) then uint16 tokens.
void write_llmc_checkpoint(const fs::path& path, int64_t maxT, int64_t V, int64_t Vp, int64_t L,
                           int64_t NH, int64_t C) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240326, header[1] = 3, header[2] = maxT, header[3] = V, header[4] = L,
  header[5] = NH, header[6] = C, header[7] = Vp;
  const int64_t n = Vp * C + maxT * C + L * C * 2 + L * 3 * C * C + L * 3 * C + L * C * C + L * C +
                    L * C * 2 + L * 4 * C * C + L * 4 * C + L * C * 4 * C + L * C + 2 * C;
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 256 * sizeof(int32_t));
  at::Tensor w = at::randn({n}) * 0.02;
  // layer norms' weights are 1 in GPT-2's init; for a speed run the values do not matter
  f.write(reinterpret_cast<const char*>(w.data_ptr<float>()), n * sizeof(float));
  TORCH_CHECK(f, "[fsdp-bench llmc] cannot write ", path.string());
}

void write_llmc_tokens(const fs::path& path, int64_t count, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520, header[1] = 1, header[2] = static_cast<int32_t>(count);
  std::vector<uint16_t> tokens(count);
  std::mt19937_64 rng(seed);
  for (auto& t : tokens) t = static_cast<uint16_t>(rng() % vocab);
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 256 * sizeof(int32_t));
  f.write(reinterpret_cast<const char*>(tokens.data()), count * sizeof(uint16_t));
  TORCH_CHECK(f, "[fsdp-bench llmc] cannot write ", path.string());
}

// Runs llm.c's trainer in `dir` until it has printed `steps` training steps, then stops it
// (its loop also evaluates and samples text at fixed steps; only the steps' own times count).
// Returns the per-step milliseconds it printed, or {"error"}.
json run_llmc(const fs::path& exe, const fs::path& dir, int steps, int threads) {
  const fs::path out = dir / "llmc.out";
  const pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    if (chdir(dir.c_str()) != 0) _exit(127);
    FILE* o = std::freopen(out.c_str(), "w", stdout);
    if (!o) _exit(127);
    setvbuf(stdout, nullptr, _IOLBF, 0);
    std::freopen((dir / "llmc.err").c_str(), "w", stderr);
    setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
    // stdbuf: llm.c prints with printf; line buffering lets us see each step as it ends
    execlp("stdbuf", "stdbuf", "-oL", exe.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const std::regex step_re(R"(step (\d+): train loss ([0-9.naninf]+) \(took ([0-9.]+) ms\))");
  json ms = json::array(), losses = json::array();
  const auto start = Clock::now();
  bool exited = false;
  int status = 0;
  while (true) {
    std::ifstream f(out);
    std::string line;
    ms = json::array();
    losses = json::array();
    while (std::getline(f, line)) {
      std::smatch m;
      if (std::regex_search(line, m, step_re)) {
        losses.push_back(std::stod(m[2]));
        ms.push_back(std::stod(m[3]));
      }
    }
    if (static_cast<int>(ms.size()) >= steps) break;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      break;
    }
    if (fsdp::bench::seconds_since(start) > 3600) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!exited) {
    kill(-pid, SIGKILL);
    waitpid(pid, &status, 0);
  }
  if (static_cast<int>(ms.size()) < steps) {
    return {{"error", "llm.c's train_gpt2 printed " + std::to_string(ms.size()) + " of " +
                          std::to_string(steps) + " steps: " +
                          fsdp::bench::tail(fsdp::bench::read_text(out)) +
                          fsdp::bench::tail(fsdp::bench::read_text(dir / "llmc.err"))}};
  }
  return {{"step_ms", ms}, {"losses", losses}};
}

int run_llmc_bench(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench llmc: GPT-2 124M single process vs llm.c's CPU trainer",
               "fsdp-bench llmc"};
  std::string llmc_dir, fsdp_train, work_dir, cc = "cc";
  int steps = 8;
  app.add_option("--llmc-dir", llmc_dir, "a checkout of karpathy/llm.c (train_gpt2.c, llmc/)")
      ->required();
  app.add_option("--steps", steps, "training steps of each system, the first not timed")
      ->capture_default_str();
  app.add_option("--cc", cc, "C compiler for llm.c")->capture_default_str();
  app.add_option("--fsdp-train", fsdp_train, "path of fsdp-train (default: beside fsdp-bench)");
  app.add_option("--work-dir", work_dir, "where llm.c is built and run (default: /tmp)");
  if (auto status = fsdp::bench::parse_args(app, "llmc", args)) return *status;
  TORCH_CHECK(steps >= 2, "[fsdp-bench llmc] --steps must be at least 2");
  TORCH_CHECK(fs::exists(fs::path(llmc_dir) / "train_gpt2.c"), "[fsdp-bench llmc] --llmc-dir '",
              llmc_dir, "' has no train_gpt2.c; pass a checkout of https://github.com/karpathy/llm.c");
  if (fsdp_train.empty()) fsdp_train = (fsdp::bench::self_dir() / "fsdp-train").string();
  const fs::path dir = work_dir_for("llmc", work_dir);
  const int threads = static_cast<int>(std::thread::hardware_concurrency());
  const int64_t B = 4, T = 64;
  auto g = fsdp::demos::gpt_preset("gpt2-124m");

  json out{{"bench", "llmc"},
           {"goal", "fsdp.cpp >= 3 x llm.c's CPU trainer; step <= 1.3 x floor"},
           {"config", {{"model", "gpt2-124m"}, {"B", B}, {"T", T}, {"precision", "fp32"},
                       {"optimizer", "AdamW lr 1e-4, weight decay 0 (llm.c's)"},
                       {"threads", threads}, {"steps", steps}}}};

  // llm.c: build with its Makefile's CPU flags (OpenMP on), then run.
  const fs::path exe = dir / "train_gpt2";
  std::vector<std::string> build = {cc, "-Ofast", "-march=native", "-fopenmp", "-DOMP",
                                    "-Wno-unused-result", "-I", llmc_dir,
                                    (fs::path(llmc_dir) / "train_gpt2.c").string(), "-lm", "-o",
                                    exe.string()};
  out["llmc_build"] = fsdp::bench::command_line(build);
  int code = fsdp::bench::run_program(build, dir / "build.out", dir / "build.err", 600);
  json llmc;
  if (code != 0) {
    llmc = {{"error", "building llm.c failed: " + fsdp::bench::tail(fsdp::bench::read_text(dir / "build.err"))}};
  } else {
    const int64_t Vp = (g.vocab_size + 127) / 128 * 128;
    write_llmc_checkpoint(dir / "gpt2_124M.bin", g.block_size, g.vocab_size, Vp, g.n_layer,
                          g.n_head, g.n_embd);
    write_llmc_tokens(dir / "dev/data/tinyshakespeare/tiny_shakespeare_train.bin", 1 << 20,
                      g.vocab_size, 1);
    write_llmc_tokens(dir / "dev/data/tinyshakespeare/tiny_shakespeare_val.bin", 1 << 16,
                      g.vocab_size, 2);
    std::cerr << "[fsdp-bench llmc] llm.c train_gpt2, " << steps << " steps..." << std::endl;
    llmc = run_llmc(exe, dir, steps, threads);
  }
  if (!llmc.contains("error")) {
    double s = 0;
    for (int i = 1; i < steps; ++i) s += llmc["step_ms"][i].get<double>() / 1000.0;
    llmc["step_seconds"] = s / (steps - 1);
  }
  out["llmc"] = llmc;

  fsdp::bench::TrainRun run;
  run.model = "gpt2-124m";
  run.devices = 1;
  run.batch_size = B;
  run.block_size = T;
  run.steps = steps;
  run.dropout = 0.0;
  run.lr = 1e-4;
  run.dir = dir;
  std::cerr << "[fsdp-bench llmc] fsdp-train gpt2-124m single, " << steps << " steps..."
            << std::endl;
  json train = fsdp::bench::run_fsdp_train(
      fsdp_train, run, {"--strategy", "single", "--optimizer", "adamw", "--weight-decay", "0"},
      "fsdp_single");
  out["fsdp_cpp"] = train;
  json measured;
  if (!train.contains("error")) {
    measured = step_and_phases(train);
    out["fsdp_cpp_measured"] = measured;
  }

  at::set_num_threads(threads);
  json compute = compute_floor("gpt2-124m", 0, B * T, T);
  const double update_bw = fsdp::bench::update_bandwidth();
  const int64_t params = fsdp::demos::model_parameter_count("gpt2-124m");
  const double optimizer_floor = 28.0 * static_cast<double>(params) / update_bw;
  const double floor_s = compute["seconds"].get<double>() + optimizer_floor;
  out["floor"] = {{"seconds", floor_s},
                  {"compute_seconds", compute["seconds"]},
                  {"optimizer_seconds", optimizer_floor},
                  {"memory_gbps", update_bw / 1e9},
                  {"compute", compute}};
  if (!measured.is_null()) {
    const double ours = measured["step_seconds"].get<double>();
    out["step_over_floor"] = ours / floor_s;
    if (!llmc.contains("error")) {
      out["speedup_over_llmc"] = llmc["step_seconds"].get<double>() / ours;
      out["goal_met"] = out["speedup_over_llmc"].get<double>() >= 3.0 &&
                        out["step_over_floor"].get<double>() <= 1.3;
    }
  }
  std::cout << out.dump(2) << std::endl;
  std::ostringstream t;
  t << std::fixed << std::setprecision(3) << "| GPT-2 124M, B 4, T 64, fp32 | s/step |\n|---|---|\n";
  if (llmc.contains("step_seconds")) t << "| llm.c train_gpt2 (CPU) | " << llmc["step_seconds"].get<double>() << " |\n";
  if (!measured.is_null()) t << "| fsdp.cpp single | " << measured["step_seconds"].get<double>() << " |\n";
  t << "| floor (matmuls + Adam traffic) | " << floor_s << " |\n";
  if (out.contains("step_over_floor")) {
    t << "step / floor = " << out["step_over_floor"].get<double>() << " (goal <= 1.3)";
    if (out.contains("speedup_over_llmc")) {
      t << "; llm.c / fsdp.cpp = " << out["speedup_over_llmc"].get<double>() << " (goal >= 3)";
    }
    t << "\n";
  }
  std::cerr << t.str();
  return train.contains("error") ? 1 : 0;
}

fsdp::bench::Registrar reg_floor("floor",
                                 "an FSDP step against a floor measured in the same run",
                                 run_floor);
fsdp::bench::Registrar reg_llmc("llmc", "GPT-2 124M vs llm.c's CPU trainer",
                                run_llmc_bench);

}  // namespace
