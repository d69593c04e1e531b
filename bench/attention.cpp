// fsdp-bench attention: the demo models' MultiheadAttention, forward + backward, computed by the
// manual kernel (baddbmm + softmax + dropout + bmm) and by at::scaled_dot_product_attention, on
// the same module, weights and input. Prints one JSON object; the evidence for the kAuto rule in
// Note [Attention kernel] (src/models/attention.cpp).
//
//   fsdp-bench attention [--threads N] [--reps 15] [--long]
//
// Cases: transformer-small (E 512, 8 heads) and gpt2-124m (E 768, 12 heads) at the benchmark
// batch (4 sequences of 35 tokens per rank): encoder self-attention (no mask), decoder
// self-attention (causal mask), decoder cross-attention (transformer only); each in fp32 and
// bf16 (the module cast, as bf16-true and FSDP bf16-mixed compute), dropout 0 and 0.2 (the demo
// default). --long adds gpt2-124m at 128 and 256 tokens (batch 4) and 1024 tokens (batch 1), and
// transformer-small self-attention at 128 tokens. Each case
// times the module (projections included) with each kernel, and the bare kernels
// (fsdp::demos::attention) on contiguous (B, H, T, D) tensors; causal cases also time SDPA with
// is_causal=true instead of the mask. *_ratio = manual / sdpa (> 1: SDPA is faster). Times are
// the minimum over --reps runs.
#include "bench.h"
#include "timing.h"

#include <fsdp/fsdp.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <iostream>

namespace {

using nlohmann::json;
using fsdp::demos::AttentionKernel;

struct Case {
  std::string model;
  std::string kind;  // "self", "causal", "cross"
  int64_t E, H, B, T;
};

double fwd_bwd_ms(fsdp::demos::MultiheadAttention& mha, AttentionKernel kernel, const at::Tensor& x,
                  const at::Tensor& memory, const at::Tensor& mask, int reps) {
  mha.kernel = kernel;
  return fsdp::bench::time_it(
             [&] {
               at::Tensor out = mha(x, memory, mask);
               out.sum().backward();
             },
             2, reps)
      .min_ms;
}

int run_attention(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench attention"};
  int threads = 0;
  int reps = 15;
  bool long_seq = false;
  app.add_option("--threads", threads, "intra-op threads (0: libtorch's default)");
  app.add_option("--reps", reps, "timed runs per case (the minimum is reported)");
  app.add_flag("--long", long_seq, "add longer sequences (128, 256, 1024 tokens)");
  if (auto status = fsdp::bench::parse_args(app, "attention", args)) return *status;
  if (threads > 0) at::set_num_threads(threads);

  std::vector<Case> cases = {
      {"transformer-small", "self", 512, 8, 4, 35},
      {"transformer-small", "causal", 512, 8, 4, 35},
      {"transformer-small", "cross", 512, 8, 4, 35},
      {"gpt2-124m", "causal", 768, 12, 4, 35},
  };
  if (long_seq) {
    cases.push_back({"gpt2-124m", "causal", 768, 12, 4, 128});
    cases.push_back({"transformer-small", "self", 512, 8, 4, 128});
    cases.push_back({"gpt2-124m", "causal", 768, 12, 4, 256});
    cases.push_back({"gpt2-124m", "causal", 768, 12, 1, 1024});
  }
  json rows = json::array();
  for (const Case& c : cases) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (double dropout : {0.0, 0.2}) {
        torch::manual_seed(0);
        fsdp::demos::MultiheadAttention mha(c.E, c.H, dropout);
        mha.to(dtype);
        mha.train();
        const auto opts = at::TensorOptions().dtype(dtype);
        at::Tensor x = at::randn({c.B, c.T, c.E}, opts).requires_grad_(true);
        at::Tensor memory = c.kind == "cross" ? at::randn({c.B, c.T, c.E}, opts) : at::Tensor();
        at::Tensor mask = c.kind == "causal" ? fsdp::demos::causal_mask(c.T, opts) : at::Tensor();
        const double manual = fwd_bwd_ms(mha, AttentionKernel::kManual, x, memory, mask, reps);
        const double sdpa = fwd_bwd_ms(mha, AttentionKernel::kSdpa, x, memory, mask, reps);
        // The bare kernels on contiguous (B, H, T, D) tensors, and is_causal=true instead of
        // the additive mask (the flash kernel then skips the masked blocks).
        const int64_t D = c.E / c.H;
        at::Tensor q = at::randn({c.B, c.H, c.T, D}, opts).requires_grad_(true);
        at::Tensor k = at::randn({c.B, c.H, c.T, D}, opts).requires_grad_(true);
        at::Tensor v = at::randn({c.B, c.H, c.T, D}, opts).requires_grad_(true);
        auto core = [&](AttentionKernel kernel) {
          return fsdp::bench::time_it(
                     [&] {
                       fsdp::demos::attention(q, k, v, mask, dropout, kernel).sum().backward();
                     },
                     2, reps)
              .min_ms;
        };
        const double core_manual = core(AttentionKernel::kManual);
        const double core_sdpa = core(AttentionKernel::kSdpa);
        const AttentionKernel picked =
            fsdp::demos::resolve_attention_kernel(AttentionKernel::kAuto, q, k, dropout);
        json row = {{"model", c.model},
                    {"kind", c.kind},
                    {"batch", c.B},
                    {"seq", c.T},
                    {"dtype", c10::toString(dtype)},
                    {"dropout", dropout},
                    {"module_manual_ms", manual},
                    {"module_sdpa_ms", sdpa},
                    {"module_ratio", manual / sdpa},
                    {"core_manual_ms", core_manual},
                    {"core_sdpa_ms", core_sdpa},
                    {"core_ratio", core_manual / core_sdpa},
                    {"auto_picks", picked == AttentionKernel::kSdpa ? "sdpa" : "manual"}};
        if (c.kind == "causal") {
          row["core_sdpa_is_causal_ms"] =
              fsdp::bench::time_it(
                  [&] {
                    at::scaled_dot_product_attention(q, k, v, std::nullopt, dropout, true)
                        .sum()
                        .backward();
                  },
                  2, reps)
                  .min_ms;
        }
        std::cerr << "[attention] " << row.dump() << std::endl;
        rows.push_back(row);
      }
    }
  }
  json out = {{"bench", "attention"},
              {"threads", at::get_num_threads()},
              {"reps", reps},
              {"note", "forward+backward, minimum over reps; module_* = one MultiheadAttention "
                       "(projections included), core_* = the attention kernel alone; *_ratio = "
                       "manual / sdpa (> 1: SDPA faster)"},
              {"cases", rows}};
  std::cout << out.dump(1) << std::endl;
  return 0;
}

fsdp::bench::Registrar reg_attention("attention",
                           "demo-model attention forward+backward: manual kernel vs "
                           "scaled_dot_product_attention (fp32/bf16, dropout, masks)",
                           run_attention);

}  // namespace
