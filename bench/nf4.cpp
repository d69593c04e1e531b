// fsdp-bench nf4: NF4 dequantization of one Llama decoder layer's weights, old kernel vs new,
// against the memory-bandwidth floor, in one run:
//
//   fsdp-bench nf4 [--preset llama-1b] [--threads 1,2] [--reps 5] [--dtype bfloat16]
//
// The layer's seven quantized weights (q, k, v, o, gate, up, down of --preset) hold random
// N(0, 0.02) values, NF4 + double quantization. Per thread count (at::set_num_threads):
//   elementwise  quant::dequantize_nf4_elementwise: per element a nibble, a code book lookup and
//                a multiply (the kernel before Note [NF4 dequantization kernel])
//   blocks       quant::dequantize_nf4: per block a 16-entry table of rounded values, two
//                lookups per byte, pairs stored together
//   floor        bytes one pass must move (packed 0.5 B + absmax and nested state read, output
//                2 B (bf16) or 4 B (fp32) written, per element) / fsdp::bench::update_bandwidth()
// Time per layer = median of --reps (after one warm-up), all seven weights dequantized once,
// outputs allocated through the tracking allocator's block cache as in training.
// A QLoRA step dequantizes every layer three times (forward, recomputing forward, backward).
// The two kernels' outputs are compared bit for bit. Prints JSON on stdout, a markdown table on
// stderr; the machine's load average at start and end.
#include "../apps/cli.h"
#include "bench.h"

#include <fsdp/llama.h>
#include <fsdp/memory.h>
#include <fsdp/quantization.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::vector<int> parse_threads(const std::string& s) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (!item.empty()) out.push_back(std::stoi(item));
  }
  return out;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int run_nf4(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench nf4"};
  std::string preset = "llama-1b", threads_text = "1,2", dtype_name = "bfloat16";
  int reps = 5;
  app.add_option("--preset", preset, "Llama layout whose decoder layer is dequantized")
      ->check(fsdp::cli::one_of(fsdp::llama_preset_names()));
  app.add_option("--threads", threads_text, "comma-separated intra-op thread counts");
  app.add_option("--reps", reps, "timed repetitions (median)")->check(fsdp::cli::at_least(1));
  app.add_option("--dtype", dtype_name, "output dtype: bfloat16 | float32")
      ->check(fsdp::cli::one_of({"bfloat16", "float32"}));
  if (auto status = fsdp::bench::parse_args(app, "nf4", args)) return *status;
  const at::ScalarType dtype = dtype_name == "bfloat16" ? at::kBFloat16 : at::kFloat;
  // As in training: the tracking allocator's block cache hands the previous repetition's output
  // block back (Note [Block cache]); without it every 100+ MiB output is fresh pages the kernel
  // zero-fills on first touch, which costs more than the dequantization itself.
  fsdp::install_tracking_allocator();
  const std::vector<int> thread_counts = parse_threads(threads_text);

  double load_before[3] = {0, 0, 0};
  ::getloadavg(load_before, 3);
  const fsdp::LlamaConfig c = fsdp::llama_preset(preset);
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_size(),
                kv = c.kv_heads() * c.head_size(), inter = c.intermediate_size;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"q_proj", {q, h}},         {"k_proj", {kv, h}},        {"v_proj", {kv, h}},
      {"o_proj", {h, q}},         {"gate_proj", {inter, h}},  {"up_proj", {inter, h}},
      {"down_proj", {h, inter}}};
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  std::vector<fsdp::quant::Nf4Tensor> weights;
  int64_t numel = 0, stored = 0;
  for (const auto& [name, shape] : shapes) {
    at::Tensor w = at::randn(shape, gen, at::kFloat) * 0.02;
    weights.push_back(fsdp::quant::quantize_nf4(w.to(at::kBFloat16)));
    numel += w.numel();
    stored += weights.back().nbytes();
  }
  const int64_t out_bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  const double pass_bytes = static_cast<double>(stored + out_bytes);

  json rows = json::array();
  std::ostringstream table;
  table << "| threads | elementwise ms | blocks ms | floor ms | speedup | blocks / floor |\n"
        << "|---:|---:|---:|---:|---:|---:|\n";
  bool all_equal = true;
  for (int t : thread_counts) {
    at::set_num_threads(t);
    const double bandwidth = fsdp::bench::update_bandwidth();
    auto time_kernel = [&](bool elementwise) {
      std::vector<double> s;
      for (int r = 0; r <= reps; ++r) {
        const auto start = Clock::now();
        for (const auto& w : weights) {
          at::Tensor out = elementwise ? fsdp::quant::dequantize_nf4_elementwise(w, dtype)
                                       : fsdp::quant::dequantize_nf4(w, dtype);
        }
        if (r > 0) s.push_back(std::chrono::duration<double>(Clock::now() - start).count());
      }
      return median_of(s);
    };
    const double old_s = time_kernel(true), new_s = time_kernel(false);
    const double floor_s = pass_bytes / bandwidth;
    for (const auto& w : weights) {
      all_equal &= at::equal(fsdp::quant::dequantize_nf4_elementwise(w, dtype).view(at::kByte),
                             fsdp::quant::dequantize_nf4(w, dtype).view(at::kByte));
    }
    rows.push_back({{"threads", t}, {"bandwidth_gb_s", bandwidth / 1e9},
                    {"elementwise_ms", old_s * 1e3}, {"blocks_ms", new_s * 1e3},
                    {"floor_ms", floor_s * 1e3}, {"speedup", old_s / new_s},
                    {"blocks_over_floor", new_s / floor_s},
                    {"elementwise_over_floor", old_s / floor_s}});
    char line[256];
    std::snprintf(line, sizeof(line), "| %d | %.1f | %.1f | %.1f | %.2fx | %.2fx |\n", t, old_s * 1e3,
                  new_s * 1e3, floor_s * 1e3, old_s / new_s, new_s / floor_s);
    table << line;
  }
  double load_after[3] = {0, 0, 0};
  ::getloadavg(load_after, 3);
  json out = {{"bench", "nf4"}, {"preset", preset}, {"dtype", dtype_name},
              {"layer_weights", numel}, {"stored_bytes", stored}, {"output_bytes", out_bytes},
              {"reps", reps}, {"bitwise_equal", all_equal}, {"runs", rows},
              {"load_avg_1m_before", load_before[0]}, {"load_avg_1m_after", load_after[0]}};
  std::cerr << table.str();
  std::cout << out.dump(2) << std::endl;
  return all_equal ? 0 : 1;
}

const fsdp::bench::Registrar reg_nf4(
    "nf4", "NF4 dequantization of one Llama layer: old vs new kernel vs the bandwidth floor",
                                 run_nf4);

}  // namespace
