// fsdp-bench qlora: QLoRA against bf16 LoRA on the same Llama layout, measured in one run.
// Prints one JSON object.
//
//   fsdp-bench qlora [--preset llama-1b] [--world 2] [--steps 4] [--seq 128] [--batch 1]
//
// Both runs go through build/bin/fsdp-finetune --preset (random weights of the layout, random
// token sequences; no files), FSDP FULL_SHARD at --world ranks, one unit per decoder layer,
// gradient checkpointing, LoRA r 8 on q/k/v/o/gate/up/down, paged_adamw_8bit:
//   qlora            NF4 + double quantization base (bf16 compute), non-quantized parameters
//                    fp32 (prepare_model_for_kbit_training, --kbit-upcast all)
//   qlora_bf16_rest  the same with --kbit-upcast none --base-dtype bfloat16: embeddings, norms
//                    and head stay bf16
//   lora_bf16        the same base kept dense in bf16 (frozen), fp32 adapters
// Reported per run: it/s (first step excluded), peak tensor bytes and peak RSS per rank during
// training and during setup, and the training peak by memory category (peak_breakdown_mb,
// Note [Memory categories] in fsdp/memory.h); ratios qlora / lora_bf16 and qlora_bf16_rest /
// lora_bf16; the stored bytes per quantized weight;
// and the --dry-run plan of the recipe's 8B layout at --world ranks. The machine's load average
// is recorded beside the numbers (ranks share the cores with whatever else runs).
#include "bench.h"
#include "runs.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using fsdp::bench::max_of;

struct QloraOptions {
  std::string preset = "llama-1b";
  int world = 2;
  int64_t steps = 4;
  int64_t seq = 128;
  int64_t batch = 1;
  std::string work_dir;
};

json load_json(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

// Runs fsdp-finetune with `args`, output to dir/<name>.log; its --summary-json, or a JSON
// error naming the log.
json finetune(const QloraOptions& o, const std::string& name, std::vector<std::string> args) {
  const fs::path summary = fs::path(o.work_dir) / (name + ".json");
  const fs::path log = fs::path(o.work_dir) / (name + ".log");
  std::string cmd = "'" + (fsdp::bench::self_dir() / "fsdp-finetune").string() + "'";
  args.insert(args.end(), {"--summary-json", summary.string(), "--no-progress-bar"});
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " > '" + log.string() + "' 2>&1";
  std::fprintf(stderr, "[bench qlora] %s ...\n", name.c_str());
  const int status = std::system(cmd.c_str());
  if (status != 0 || !fs::exists(summary)) {
    return {{"error", "fsdp-finetune failed (status " + std::to_string(status) + "), see " + log.string()}};
  }
  return load_json(summary);
}

int run_qlora(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench qlora"};
  QloraOptions o;
  app.add_option("--preset", o.preset, "Llama layout (fsdp-finetune --preset)");
  app.add_option("--world", o.world, "ranks");
  app.add_option("--steps", o.steps, "optimizer steps per run (the first is warm-up)");
  app.add_option("--seq", o.seq, "tokens per example");
  app.add_option("--batch", o.batch, "examples per rank per step");
  app.add_option("--work-dir", o.work_dir, "where logs and summaries go (default: a fresh /tmp dir)");
  if (auto status = fsdp::bench::parse_args(app, "qlora", args)) return *status;
  if (o.work_dir.empty()) o.work_dir = (fs::temp_directory_path() / ("fsdp_bench_qlora_" + std::to_string(::getpid()))).string();
  fs::create_directories(o.work_dir);

  double load_before[3] = {0, 0, 0};
  ::getloadavg(load_before, 3);
  const std::vector<std::string> common = {
      "--preset", o.preset, "--data", "synthetic", "--synthetic-examples",
      std::to_string(o.steps * o.batch * o.world + o.world), "--max-length", std::to_string(o.seq),
      "--strategy", "fsdp", "--devices", std::to_string(o.world), "--per-device-train-batch-size",
      std::to_string(o.batch), "--max-steps", std::to_string(o.steps), "--save-steps", "0",
      "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
      "--optim", "paged_adamw_8bit", "--output-dir", (fs::path(o.work_dir) / "out").string()};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  json qlora = finetune(o, "qlora", with({"--load-in-4bit", "--bnb-4bit-compute-dtype", "bfloat16"}));
  json qlora_bf16 = finetune(o, "qlora_bf16_rest",
                             with({"--load-in-4bit", "--bnb-4bit-compute-dtype", "bfloat16",
                                   "--kbit-upcast", "none", "--base-dtype", "bfloat16"}));
  json lora = finetune(o, "lora_bf16", with({"--no-load-in-4bit", "--base-dtype", "bfloat16"}));
  json plan = finetune(o, "dry_run_llama3_8b",
                       {"--preset", "llama3-8b", "--devices", std::to_string(o.world), "--dry-run",
                        "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj,lm_head"});
  json plan_small = finetune(o, "dry_run_" + o.preset,
                             {"--preset", o.preset, "--devices", std::to_string(o.world), "--dry-run"});
  double load_after[3] = {0, 0, 0};
  ::getloadavg(load_after, 3);

  json out = {{"bench", "qlora"}, {"preset", o.preset}, {"world", o.world}, {"steps", o.steps},
              {"seq", o.seq}, {"batch_per_rank", o.batch},
              {"load_avg_1m_before", load_before[0]}, {"load_avg_1m_after", load_after[0]},
              {"qlora", qlora}, {"qlora_bf16_rest", qlora_bf16}, {"lora_bf16", lora},
              {"dry_run_llama3_8b", plan}};
  if (plan_small.contains("quantized_weights")) {
    out["bytes_per_quantized_weight"] =
        plan_small["quantized_bytes"].get<double>() / plan_small["quantized_weights"].get<double>();
  }
  if (qlora.contains("it_per_s") && lora.contains("it_per_s")) {
    out["it_per_s_ratio_qlora_over_lora_bf16"] = qlora["it_per_s"].get<double>() / lora["it_per_s"].get<double>();
    out["peak_alloc_ratio_qlora_over_lora_bf16"] =
        max_of(qlora["peak_alloc_mb"]) / max_of(lora["peak_alloc_mb"]);
    out["setup_peak_alloc_ratio_qlora_over_lora_bf16"] =
        max_of(qlora["setup_peak_alloc_mb"]) / max_of(lora["setup_peak_alloc_mb"]);
  }
  if (qlora_bf16.contains("it_per_s") && lora.contains("it_per_s")) {
    out["it_per_s_ratio_qlora_bf16_rest_over_lora_bf16"] =
        qlora_bf16["it_per_s"].get<double>() / lora["it_per_s"].get<double>();
    out["peak_alloc_ratio_qlora_bf16_rest_over_lora_bf16"] =
        max_of(qlora_bf16["peak_alloc_mb"]) / max_of(lora["peak_alloc_mb"]);
  }
  std::cout << out.dump(2) << std::endl;
  return 0;
}

const fsdp::bench::Registrar reg_qlora(
    "qlora", "QLoRA vs bf16 LoRA: it/s and peak memory per rank", run_qlora);

}  // namespace
