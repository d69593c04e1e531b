// fsdp-bench cpu_adam: one optimizer step over 100M+ parameters in host memory, in one run:
//
//   fsdp-bench cpu_adam [--numel 104857600] [--tensor-numel 4194304] [--threads 1,2]
//                       [--steps 3] [--warmup 1] [--no-deepspeed]
//
// per thread count (at::set_num_threads):
//   bandwidth        fsdp::bench::update_bandwidth(): an in-place a += b over 256 MiB, best of 3,
//                    (read + written bytes) / s, the access pattern of an in-place Adam pass
//   torch_adam(w)    libtorch's torch::optim::Adam / AdamW (weight decay 0.01)
//   cpu_adam(w)      fsdp::optim::CPUAdam, adamw_mode false / true, the same settings
//   cpu_adamw_bf16   CPUAdam over bf16 parameters and gradients (fp32 state)
//   floor            bytes one fused pass must move per element (fp32: p, g, m, v read and p,
//                    m, v written = 28 B; bf16 parameters: 22 B) x numel / bandwidth
//   deepspeed        DeepSpeedCPUAdam (adamw_mode) from FSDP_PYTHON's deepspeed, built by its op
//                    builder with DS_ACCELERATOR=cpu, in bench/peers/deepspeed_cpu_adam.py on
//                    the same sizes (and PyTorch's own torch.optim.AdamW(fused=True) beside it);
//                    when it cannot build or run, its error text is the result
// Step time = median of the timed steps (the warm-up steps allocate the state). Ratios are
// step-time ratios measured in this run: speedup = other / cpu_adam(w). Prints JSON on stdout,
// a markdown table on stderr. The machine's load average is recorded at start and end.
#include "../apps/cli.h"
#include "bench.h"
#include "runs.h"

#include <fsdp/cpu_adam.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct CpuAdamOptions {
  int64_t numel = 104857600;       // 100 Mi parameters
  int64_t tensor_numel = 4194304;  // split into tensors of this size (the last one smaller)
  std::string threads = "1,2";
  int steps = 3;
  int warmup = 1;
  bool deepspeed = true;
  std::string python = fsdp::bench::default_python();
  double timeout_s = 1800;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The parameters (with gradients) the optimizers step: numel elements in tensors.
std::vector<at::Tensor> make_params(const CpuAdamOptions& o, at::ScalarType dtype) {
  std::vector<at::Tensor> params;
  for (int64_t done = 0; done < o.numel; done += o.tensor_numel) {
    const int64_t n = std::min(o.tensor_numel, o.numel - done);
    at::Tensor p = at::empty({n}).uniform_(-1, 1).to(dtype).requires_grad_();
    p.mutable_grad() = at::empty({n}).uniform_(-1e-2, 1e-2).to(dtype);
    params.push_back(p);
  }
  return params;
}

// Step times (s) of `opt`: warm-up steps, then the timed ones.
json time_steps(torch::optim::Optimizer& opt, const CpuAdamOptions& o) {
  for (int i = 0; i < o.warmup; ++i) opt.step();
  std::vector<double> times;
  for (int i = 0; i < o.steps; ++i) {
    auto t0 = Clock::now();
    opt.step();
    times.push_back(fsdp::bench::seconds_since(t0));
  }
  return {{"step_seconds", times}, {"median_s", median(times)}};
}

json run_deepspeed(const CpuAdamOptions& o, int threads) {
  const fs::path dir = fs::temp_directory_path() / "fsdp-bench-cpu-adam";
  fs::create_directories(dir);
  const std::string script = (fs::path(fsdp::bench::peers_dir()) / "deepspeed_cpu_adam.py").string();
  std::vector<std::string> argv = {o.python, script, "--numel", std::to_string(o.numel),
                                   "--tensor-numel", std::to_string(o.tensor_numel),
                                   "--threads", std::to_string(threads),
                                   "--steps", std::to_string(o.steps),
                                   "--warmup", std::to_string(o.warmup)};
  const fs::path out = dir / ("ds" + std::to_string(threads) + ".out");
  const fs::path err = dir / ("ds" + std::to_string(threads) + ".err");
  const int code = fsdp::bench::run_program(argv, out, err, o.timeout_s);
  json r = fsdp::bench::last_json_object(fsdp::bench::read_text(out));
  if (r.is_null()) {
    r = {{"error", "exit status " + std::to_string(code) + ": " +
                       fsdp::bench::tail(fsdp::bench::read_text(err))}};
  }
  r["command"] = fsdp::bench::command_line(argv);
  return r;
}

double field(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
}

json ratio(double num, double den) { return den > 0 && num > 0 ? json(num / den) : json(nullptr); }

int run_cpu_adam(const std::vector<std::string>& args) {
  CpuAdamOptions o;
  CLI::App app{"fsdp-bench cpu_adam"};
  app.add_option("--numel", o.numel, "parameters stepped (all tensors)")
      ->check(fsdp::cli::at_least(int64_t{1}));
  app.add_option("--tensor-numel", o.tensor_numel, "elements per parameter tensor")
      ->check(fsdp::cli::at_least(int64_t{1}));
  app.add_option("--threads", o.threads, "comma-separated intra-op thread counts");
  app.add_option("--steps", o.steps, "timed steps")->check(fsdp::cli::at_least(1));
  app.add_option("--warmup", o.warmup, "untimed steps first (they allocate the state)")
      ->check(fsdp::cli::at_least(0));
  app.add_flag("!--no-deepspeed", o.deepspeed, "skip DeepSpeedCPUAdam (bench/peers)");
  app.add_option("--python", o.python, "interpreter with torch and deepspeed (CMake's FSDP_PYTHON)");
  if (auto status = fsdp::bench::parse_args(app, "cpu_adam", args)) return *status;

  std::vector<int> thread_counts;
  {
    std::stringstream in(o.threads);
    for (std::string t; std::getline(in, t, ',');) thread_counts.push_back(std::stoi(t));
  }
  const int threads_before = at::get_num_threads();
  json out = {{"bench", "cpu_adam"},
              {"numel", o.numel},
              {"tensor_numel", o.tensor_numel},
              {"tensors", (o.numel + o.tensor_numel - 1) / o.tensor_numel},
              {"steps", o.steps},
              {"warmup", o.warmup},
              {"isa", fsdp::optim::CPUAdam::isa()},
              {"hyperparameters", "lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01"},
              {"bytes_per_element", {{"fp32", 28}, {"bf16_params", 22}}},
              {"load_average_start", fsdp::bench::load_average()}};
  json runs = json::array();
  for (int threads : thread_counts) {
    at::set_num_threads(threads);
    json r = {{"threads", threads}};
    const double bw = fsdp::bench::update_bandwidth();
    r["bandwidth_gb_s"] = bw / 1e9;
    const double floor32 = 28.0 * static_cast<double>(o.numel) / bw;
    const double floor16 = 22.0 * static_cast<double>(o.numel) / bw;
    r["floor_s"] = {{"fp32", floor32}, {"bf16_params", floor16}};
    {
      auto params = make_params(o, at::kFloat);
      auto run = [&](const char* name, std::unique_ptr<torch::optim::Optimizer> opt) {
        r[name] = time_steps(*opt, o);
        std::cerr << "[cpu_adam] threads " << threads << " " << name << ": "
                  << r[name]["median_s"].get<double>() << " s/step\n";
      };
      run("torch_adam", std::make_unique<torch::optim::Adam>(
                            params, torch::optim::AdamOptions(1e-3).weight_decay(0.01)));
      run("torch_adamw", std::make_unique<torch::optim::AdamW>(
                             params, torch::optim::AdamWOptions(1e-3).weight_decay(0.01)));
      fsdp::optim::CPUAdamOptions co;
      co.weight_decay = 0.01;
      co.adamw_mode = false;
      run("cpu_adam", std::make_unique<fsdp::optim::CPUAdam>(params, co));
      co.adamw_mode = true;
      run("cpu_adamw", std::make_unique<fsdp::optim::CPUAdam>(params, co));
    }
    {
      auto params = make_params(o, at::kBFloat16);
      fsdp::optim::CPUAdamOptions co;
      co.weight_decay = 0.01;
      auto opt = std::make_unique<fsdp::optim::CPUAdam>(params, co);
      r["cpu_adamw_bf16"] = time_steps(*opt, o);
    }
    const double adam = field(r["cpu_adam"], "median_s");
    const double adamw = field(r["cpu_adamw"], "median_s");
    const double bf16 = field(r["cpu_adamw_bf16"], "median_s");
    r["speedup_vs_torch_adam"] = ratio(field(r["torch_adam"], "median_s"), adam);
    r["speedup_vs_torch_adamw"] = ratio(field(r["torch_adamw"], "median_s"), adamw);
    r["floor_over_cpu_adamw"] = ratio(floor32, adamw);
    r["floor_over_cpu_adamw_bf16"] = ratio(floor16, bf16);
    r["cpu_adamw_gb_s"] = adamw > 0 ? json(28.0 * static_cast<double>(o.numel) / adamw / 1e9)
                                    : json(nullptr);
    if (o.deepspeed) {
      r["deepspeed"] = run_deepspeed(o, threads);
      r["speedup_vs_deepspeed"] = ratio(field(r["deepspeed"], "deepspeed_cpu_adamw_median_s"), adamw);
      r["speedup_vs_torch_fused_adamw"] =
          ratio(field(r["deepspeed"], "torch_fused_adamw_median_s"), adamw);
    }
    runs.push_back(r);
  }
  at::set_num_threads(threads_before);
  out["runs"] = runs;
  out["load_average_end"] = fsdp::bench::load_average();

  std::cerr << "\n| threads | in-place GB/s | torch Adam | torch AdamW | CPUAdam | CPUAdamW | "
               "CPUAdamW bf16 | floor fp32 | CPUAdamW vs torch AdamW | floor / CPUAdamW | "
               "DeepSpeedCPUAdam | vs DeepSpeed |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : runs) {
    auto s = [&](const json& j) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.3f s", field(j, "median_s"));
      return std::string(buf);
    };
    auto x = [](const json& j) {
      if (!j.is_number()) return std::string("-");
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2fx", j.get<double>());
      return std::string(buf);
    };
    std::string ds = "-";
    if (r.contains("deepspeed")) {
      const json& d = r["deepspeed"];
      if (d.contains("error")) {
        ds = "error (see JSON)";
      } else {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.3f s", field(d, "deepspeed_cpu_adamw_median_s"));
        ds = buf;
      }
    }
    char bw[32], fl[32];
    std::snprintf(bw, sizeof bw, "%.1f", field(r, "bandwidth_gb_s"));
    std::snprintf(fl, sizeof fl, "%.3f s", r["floor_s"]["fp32"].get<double>());
    std::cerr << "| " << r["threads"].get<int>() << " | " << bw << " | " << s(r["torch_adam"])
              << " | " << s(r["torch_adamw"]) << " | " << s(r["cpu_adam"]) << " | "
              << s(r["cpu_adamw"]) << " | " << s(r["cpu_adamw_bf16"]) << " | " << fl << " | "
              << x(r["speedup_vs_torch_adamw"]) << " | " << x(r["floor_over_cpu_adamw"]) << " | "
              << ds << " | " << x(r.value("speedup_vs_deepspeed", json(nullptr))) << " |\n";
  }
  std::cout << out.dump(2) << std::endl;
  return 0;
}

const fsdp::bench::Registrar reg_cpu_adam(
    "cpu_adam",
    "fsdp::optim::CPUAdam step time vs libtorch Adam/AdamW, the memory-bandwidth floor and "
    "DeepSpeedCPUAdam on 100M+ parameters",
    run_cpu_adam);

}  // namespace
