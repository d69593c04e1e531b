// fsdp-bench precision: fp32, bf16 and fp16 on this CPU, op by op and for one demo-model
// training step (forward + backward, no optimizer), measured in one run. Prints one JSON
// object: per case the minimum time over --reps runs per dtype and the ratio to fp32
// (> 1: faster than fp32). The evidence behind docs/precision.md (16-mixed / 16-true speed).
//
//   fsdp-bench precision [--threads N] [--reps 10] [--model transformer-small]
//
// Op shapes are transformer-small's at the benchmark batch (4 x 35 = 140 tokens, E 512,
// feed-forward 2048, vocabulary 33278); "matmul 1024" is a square GEMM reported in GFLOP/s too.
// The model step runs the whole model: "true" casts the model (bf16-true, 16-true; FSDP
// mixed precision computes the same way), "autocast" keeps fp32 parameters under CPU autocast
// (bf16-mixed / 16-mixed outside FSDP).
#include "bench.h"
#include "timing.h"

#include <fsdp/fsdp.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iostream>

namespace {

using nlohmann::json;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf};
// Time per case and dtype; fp16 GEMM without fp16 kernels runs at ~0.5 GFLOP/s here.
constexpr double kBudgetSeconds = 20;

std::string dtype_key(at::ScalarType t) {
  return t == at::kFloat ? "fp32" : t == at::kBFloat16 ? "bf16" : "fp16";
}

// One op in every dtype: builds its inputs with `make(dtype)`, which returns the work to time.
json time_op(const std::string& name, int reps,
             const std::function<std::function<void()>(at::ScalarType)>& make) {
  json row = {{"case", name}};
  double fp32 = 0;
  for (at::ScalarType t : kDtypes) {
    std::function<void()> work;
    try {
      work = make(t);
      const auto timing = fsdp::bench::time_it(work, 2, reps, kBudgetSeconds);
      const double ms = timing.min_ms;
      row[dtype_key(t) + "_ms"] = ms;
      if (timing.runs < reps) row[dtype_key(t) + "_runs"] = timing.runs;
      if (t == at::kFloat) fp32 = ms;
      else row[dtype_key(t) + "_speedup_vs_fp32"] = fp32 / ms;
    } catch (const c10::Error& e) {
      row[dtype_key(t) + "_error"] = e.what_without_backtrace();
    }
  }
  std::cerr << "[precision] " << row.dump() << std::endl;
  return row;
}

at::Tensor leaf(std::vector<int64_t> shape, at::ScalarType t) {
  return at::randn(shape, at::TensorOptions().dtype(t)).requires_grad_(true);
}

int run_precision(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench precision"};
  int threads = 0;
  int reps = 10;
  std::string model = "transformer-small";
  app.add_option("--threads", threads, "intra-op threads (0: libtorch's default)");
  app.add_option("--reps", reps, "timed runs per case (the minimum is reported)");
  app.add_option("--model", model, "demo model for the training-step case");
  if (auto status = fsdp::bench::parse_args(app, "precision", args)) return *status;
  if (threads > 0) at::set_num_threads(threads);
  torch::manual_seed(0);

  const int64_t N = 4 * 35, E = 512, F = 2048, V = 33278, BH = 4 * 8, T = 35;
  json rows = json::array();
  {
    json row = time_op("matmul 1024x1024x1024", reps, [](at::ScalarType t) {
      auto a = at::randn({1024, 1024}, t), b = at::randn({1024, 1024}, t);
      return std::function<void()>([a, b] { at::mm(a, b); });
    });
    for (at::ScalarType t : kDtypes) {
      const std::string k = dtype_key(t) + "_ms";
      if (row.contains(k)) row[dtype_key(t) + "_gflops"] = 2.0 * 1024 * 1024 * 1024 / (row[k].get<double>() * 1e6);
    }
    rows.push_back(row);
  }
  rows.push_back(time_op("addmm (140,512)x(512,2048)+bias", reps, [&](at::ScalarType t) {
    auto x = at::randn({N, E}, t), w = at::randn({E, F}, t), b = at::randn({F}, t);
    return std::function<void()>([=] { at::addmm(b, x, w); });
  }));
  rows.push_back(time_op("linear fwd+bwd (140,512)->2048", reps, [&](at::ScalarType t) {
    auto x = leaf({N, E}, t), w = leaf({F, E}, t), b = leaf({F}, t);
    return std::function<void()>([=] { at::linear(x, w, b).sum().backward(); });
  }));
  rows.push_back(time_op("linear fwd+bwd (140,512)->33278 (vocab head)", reps, [&](at::ScalarType t) {
    auto x = leaf({N, E}, t), w = leaf({V, E}, t), b = leaf({V}, t);
    return std::function<void()>([=] { at::linear(x, w, b).sum().backward(); });
  }));
  rows.push_back(time_op("softmax fwd+bwd (32,35,35)", reps, [&](at::ScalarType t) {
    auto x = leaf({BH, T, T}, t);
    return std::function<void()>([=] { at::softmax(x, -1).sum().backward(); });
  }));
  rows.push_back(time_op("log_softmax fwd+bwd (140,33278)", reps, [&](at::ScalarType t) {
    auto x = leaf({N, V}, t);
    return std::function<void()>([=] { at::log_softmax(x, -1).sum().backward(); });
  }));
  rows.push_back(time_op("layer_norm fwd+bwd (140,512)", reps, [&](at::ScalarType t) {
    auto x = leaf({N, E}, t), w = leaf({E}, t), b = leaf({E}, t);
    return std::function<void()>([=] { at::layer_norm(x, {E}, w, b).sum().backward(); });
  }));
  rows.push_back(time_op("embedding fwd+bwd 140 of (33278,512)", reps, [&](at::ScalarType t) {
    auto w = leaf({V, E}, t);
    auto ids = at::randint(V, {N}, at::kLong);
    return std::function<void()>([=] { at::embedding(w, ids).sum().backward(); });
  }));

  // One training step (forward + backward) of the demo model, per precision.
  json steps = json::array();
  const int64_t vocab = fsdp::demos::is_transformer_model(model)
                           ? fsdp::demos::transformer_preset(model).vocab_size
                           : fsdp::demos::gpt_preset(model).vocab_size;
  const at::Tensor ids = at::randint(vocab, {4, 35}, at::kLong);
  double fp32_ms = 0;
  struct Mode {
    std::string name;
    at::ScalarType dtype;  // parameters
    std::optional<at::ScalarType> autocast;
  };
  for (const Mode& m : {Mode{"32-true", at::kFloat, std::nullopt},
                        Mode{"bf16-true", at::kBFloat16, std::nullopt},
                        Mode{"16-true", at::kHalf, std::nullopt},
                        Mode{"bf16-mixed (autocast)", at::kFloat, at::kBFloat16},
                        Mode{"16-mixed (autocast)", at::kFloat, at::kHalf}}) {
    torch::manual_seed(0);
    auto net = fsdp::demos::make_model(model, vocab, 0.2);
    net->to(m.dtype);
    net->train();
    auto work = [&] {
      fsdp::CpuAutocastGuard autocast(m.autocast);
      at::Tensor loss = at::nll_loss((*net)(ids, ids), ids.reshape(-1));
      loss.backward();
    };
    // fp16 steps take a minute here: no warm-up run for them (their first run is the timing).
    const bool fp16 = m.dtype == at::kHalf || m.autocast == at::kHalf;
    const auto timing =
        fsdp::bench::time_it(work, fp16 ? 0 : 1, std::max(3, reps / 2), 3 * kBudgetSeconds);
    if (m.name == "32-true") fp32_ms = timing.min_ms;
    json row = {{"precision", m.name}, {"step_ms", timing.min_ms},
                {"median_ms", timing.median_ms}, {"runs", timing.runs},
                {"speedup_vs_fp32", fp32_ms / timing.min_ms}};
    std::cerr << "[precision] " << model << " " << row.dump() << std::endl;
    steps.push_back(row);
  }

  json out = {{"bench", "precision"},
              {"threads", at::get_num_threads()},
              {"reps", reps},
              {"note", "minimum time over reps per dtype; speedup_vs_fp32 > 1 means faster than "
                       "fp32; model step = forward + backward at batch 4 x 35, no optimizer"},
              {"ops", rows},
              {"model", model},
              {"model_step", steps}};
  std::cout << out.dump(1) << std::endl;
  return 0;
}

fsdp::bench::Registrar reg_precision("precision",
                           "fp32 vs bf16 vs fp16 on this CPU: matmul, linear, softmax, layer "
                           "norm, embedding backward, and one demo-model training step",
                           run_precision);

}  // namespace
