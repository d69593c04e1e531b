// fsdp-bench optimizer: one fp32 Adam / AdamW step over ~30M parameters, libtorch's C++
// optimizers (torch::optim::Adam/AdamW: a loop over parameters, ~10 elementwise kernels each)
// against the same update done by ATen's multi-tensor kernels (_foreach_* ops, as PyTorch's
// foreach=True) and by ATen's fused CPU kernels (at::_fused_adam_ / _fused_adamw_, as
// fused=True; one pass over memory). Prints one JSON object with ms per step, ns per parameter
// and the largest difference from torch::optim after the same steps.
//
//   fsdp-bench optimizer [--threads N] [--reps 10] [--params 30000000]
//
// The parameters are 24 matrices of equal size plus 48 bias-sized vectors (per-tensor overhead
// shows), gradients random, state initialised by one untimed step.
#include "bench.h"
#include "timing.h"

#include <fsdp/fsdp.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include <cmath>
#include <iostream>

namespace {

using nlohmann::json;

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWd = 0.01;

struct Params {
  std::vector<at::Tensor> params, grads;
};

Params make_params(int64_t total) {
  Params p;
  const int64_t cols = 1024;
  const int64_t rows = std::max<int64_t>(1, total / 24 / cols);
  torch::manual_seed(0);
  for (int i = 0; i < 24; ++i) {
    p.params.push_back(at::randn({rows, cols}) * 0.02);
    p.grads.push_back(at::randn({rows, cols}) * 1e-3);
  }
  for (int i = 0; i < 48; ++i) {
    p.params.push_back(at::zeros({cols}));
    p.grads.push_back(at::randn({cols}) * 1e-3);
  }
  return p;
}

int64_t numel(const Params& p) {
  int64_t n = 0;
  for (const auto& t : p.params) n += t.numel();
  return n;
}

// libtorch's optimizer over clones of `base` (gradients attached).
template <typename Opt, typename Options>
std::pair<std::vector<at::Tensor>, std::unique_ptr<Opt>> make_libtorch(const Params& base,
                                                                      Options options) {
  std::vector<at::Tensor> ps;
  for (size_t i = 0; i < base.params.size(); ++i) {
    at::Tensor t = base.params[i].clone().requires_grad_(true);
    t.mutable_grad() = base.grads[i].clone();
    ps.push_back(t);
  }
  auto opt = std::make_unique<Opt>(ps, options);
  return {ps, std::move(opt)};
}

// The update with ATen's multi-tensor ops (PyTorch's _multi_tensor_adam, fp32, no amsgrad).
struct ForeachAdam {
  std::vector<at::Tensor> params, grads, m, v;
  int64_t step = 0;
  bool decoupled;  // AdamW
  ForeachAdam(const Params& base, bool adamw) : decoupled(adamw) {
    for (size_t i = 0; i < base.params.size(); ++i) {
      params.push_back(base.params[i].clone());
      grads.push_back(base.grads[i].clone());
      m.push_back(at::zeros_like(params.back()));
      v.push_back(at::zeros_like(params.back()));
    }
  }
  void run() {
    at::NoGradGuard no_grad;
    ++step;
    const double wd = decoupled ? kWd : 0.0;
    if (decoupled) at::_foreach_mul_(params, 1.0 - kLr * wd);
    at::_foreach_lerp_(m, grads, 1.0 - kBeta1);
    at::_foreach_mul_(v, kBeta2);
    at::_foreach_addcmul_(v, grads, grads, 1.0 - kBeta2);
    const double bc1 = 1.0 - std::pow(kBeta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(kBeta2, static_cast<double>(step));
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, std::sqrt(bc2));
    at::_foreach_add_(denom, kEps);
    at::_foreach_addcdiv_(params, m, denom, -kLr / bc1);
  }
};

// The update with ATen's fused CPU kernel.
struct FusedAdam {
  std::vector<at::Tensor> params, grads, m, v, steps;
  bool adamw;
  FusedAdam(const Params& base, bool decoupled) : adamw(decoupled) {
    for (size_t i = 0; i < base.params.size(); ++i) {
      params.push_back(base.params[i].clone());
      grads.push_back(base.grads[i].clone());
      m.push_back(at::zeros_like(params.back()));
      v.push_back(at::zeros_like(params.back()));
      steps.push_back(at::zeros({}, at::kFloat));
    }
  }
  void run() {
    at::NoGradGuard no_grad;
    at::_foreach_add_(steps, 1.0);
    if (adamw) {
      at::_fused_adamw_(params, grads, m, v, {}, steps, kLr, kBeta1, kBeta2, kWd, kEps, false, false);
    } else {
      at::_fused_adam_(params, grads, m, v, {}, steps, kLr, kBeta1, kBeta2, 0.0, kEps, false, false);
    }
  }
};

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, (a[i].detach() - b[i]).abs().max().item<double>());
  }
  return d;
}

int run_optimizer(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench optimizer"};
  int threads = 0;
  int reps = 10;
  int64_t total = 30000000;
  app.add_option("--threads", threads, "intra-op threads (0: libtorch's default)");
  app.add_option("--reps", reps, "timed steps per optimizer (the minimum is reported)");
  app.add_option("--params", total, "parameter elements (approximately)");
  if (auto status = fsdp::bench::parse_args(app, "optimizer", args)) return *status;
  if (threads > 0) at::set_num_threads(threads);

  const Params base = make_params(total);
  const int64_t n = numel(base);
  json rows = json::array();
  for (bool adamw : {false, true}) {
    const std::string name = adamw ? "AdamW" : "Adam";
    std::vector<at::Tensor> lt_params;
    std::function<void()> lt_step;
    std::unique_ptr<torch::optim::Adam> adam;
    std::unique_ptr<torch::optim::AdamW> adamw_opt;
    if (adamw) {
      auto [ps, opt] = make_libtorch<torch::optim::AdamW>(
          base, torch::optim::AdamWOptions(kLr).eps(kEps).weight_decay(kWd));
      lt_params = ps;
      adamw_opt = std::move(opt);
      lt_step = [&] { adamw_opt->step(); };
    } else {
      auto [ps, opt] = make_libtorch<torch::optim::Adam>(base, torch::optim::AdamOptions(kLr).eps(kEps));
      lt_params = ps;
      adam = std::move(opt);
      lt_step = [&] { adam->step(); };
    }
    ForeachAdam foreach_opt(base, adamw);
    FusedAdam fused(base, adamw);
    // Same number of steps everywhere (1 warm-up + reps), so the parameters can be compared.
    const double lt = fsdp::bench::time_it(lt_step, 1, reps).min_ms;
    const double fe = fsdp::bench::time_it([&] { foreach_opt.run(); }, 1, reps).min_ms;
    const double fu = fsdp::bench::time_it([&] { fused.run(); }, 1, reps).min_ms;
    json row = {{"optimizer", name},
                {"params", n},
                {"libtorch_ms", lt},
                {"foreach_ms", fe},
                {"fused_ms", fu},
                {"libtorch_ns_per_param", lt * 1e6 / n},
                {"fused_ns_per_param", fu * 1e6 / n},
                {"fused_speedup", lt / fu},
                {"foreach_speedup", lt / fe},
                {"foreach_max_abs_diff", max_diff(lt_params, foreach_opt.params)},
                {"fused_max_abs_diff", max_diff(lt_params, fused.params)}};
    std::cerr << "[optimizer] " << row.dump() << std::endl;
    rows.push_back(row);
  }
  json out = {{"bench", "optimizer"},
              {"threads", at::get_num_threads()},
              {"reps", reps},
              {"note", "one fp32 optimizer step; minimum over reps; *_speedup = libtorch_ms / "
                       "other_ms; max_abs_diff: parameters after the same 1 + reps steps"},
              {"cases", rows}};
  std::cout << out.dump(1) << std::endl;
  return 0;
}

fsdp::bench::Registrar reg_optimizer("optimizer",
                           "fp32 Adam/AdamW step: torch::optim vs ATen foreach vs fused kernels",
                           run_optimizer);

}  // namespace
