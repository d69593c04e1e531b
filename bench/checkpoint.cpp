// fsdp-bench checkpoint: save and load time and peak tensor memory per rank for full vs sharded
// checkpoints of one model under FSDP (world 2 by default), and the streaming converter.
// Prints one JSON object on stdout (rank 0).
//
//   fsdp-bench checkpoint [--model transformer-small] [--world 2] [--dir /tmp/fsdp-bench-ckpt]
//                         [--params-on-disk NVME_PATH [--sub-group-size 10000000]]
//
// --params-on-disk: DeepSpeed stage 3 with the parameters and the optimizer state on disk under
// NVME_PATH (every unit on disk, built sharded) instead of FSDP, sharded format only: a save
// reads each unit's record while it writes that unit, a load writes the records back (Note
// [Checkpoints of parameters on disk]); "state_on_disk_mb_per_rank" is what the rank keeps in
// swap files, against which "extra_peak_mb_per_rank" is to be read.
//
// The ranks are launched by the Trainer (fsdp::launch re-executes this program). One optimizer
// step runs first so AdamW state exists. Peak memory is the tracking allocator's peak tensor
// bytes per rank during each operation, beside the model-state bytes the rank holds (its
// shards of parameters and optimizer state): "extra" = peak - before is what the operation
// itself needed. For a full save under FSDP rank 0's extra should stay near the largest tensor
// (it gathers one at a time), not the model.
#include "bench.h"
#include "demo_lm.h"

#include <fsdp/checkpoint.h>
#include <fsdp/deepspeed.h>
#include <fsdp/fsdp.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <iostream>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

int run_checkpoint(const std::vector<std::string>& args) {
  CLI::App app{"fsdp-bench checkpoint"};
  std::string model = "transformer-small";
  int world = 2;
  int64_t vocab = 33278;
  std::string dir = "/tmp/fsdp-bench-ckpt";
  app.add_option("--model", model, "demo model preset");
  app.add_option("--world", world, "ranks");
  app.add_option("--vocab-size", vocab, "vocabulary (the preset's WikiText-2 size by default)");
  app.add_option("--dir", dir, "scratch directory for the checkpoints");
  std::string nvme;
  app.add_option("--params-on-disk", nvme,
                 "DeepSpeed stage 3 with parameters and optimizer state on disk under this "
                 "directory (sharded checkpoints only)");
  int64_t sub_group_size = 10000000;
  app.add_option("--sub-group-size", sub_group_size,
                 "with --params-on-disk: elements per streamed moment sub-group (three buffers "
                 "of one sub-group's record are in RAM)");
  if (auto status = fsdp::bench::parse_args(app, "checkpoint", args)) return *status;

  fsdp::TrainerOptions t;
  t.devices = world;
  if (nvme.empty()) {
    fsdp::FSDPOptions fo;
    fo.auto_wrap_policy = fsdp::AutoWrapPolicy::of_types(fsdp::demos::layer_types(model));
    t.strategy = std::make_shared<fsdp::FSDPStrategy>(fo);
  } else {
    std::error_code ec;
    fs::create_directories(nvme, ec);  // the swapper creates only <job>/ inside it
    fsdp::DeepSpeedOptions ds;
    ds.stage = 3;
    ds.offload_optimizer = true;
    ds.offload_optimizer_device = "nvme";
    ds.offload_parameters = true;
    ds.offload_params_device = "nvme";
    ds.nvme_path = nvme;
    ds.sub_group_size = sub_group_size;
    ds.max_in_cpu = 0;
    ds.stage3_param_persistence_threshold = 0;  // every parameter in a unit, built sharded
    t.strategy = std::make_shared<fsdp::DeepSpeedStrategy>(ds);
  }
  t.max_steps = 1;
  t.seed = 42;
  t.enable_progress_bar = false;
  t.enable_summary = false;
  t.logger = false;
  fsdp::Trainer trainer(t);
  auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(vocab, 20000, 42);
  fsdp::DataLoader loader(data, 2, fsdp::DistributedSampler(data->size()));
  fsdp::bench::DemoLM lm(model, vocab);
  trainer.fit(lm, loader);
  auto& strategy = *trainer.strategy();
  auto& pg = *trainer.world();

  json out = {{"bench", "checkpoint"}, {"model", model}, {"world", world},
              {"params", trainer.results().params}, {"strategy", strategy.name()}};
  if (!nvme.empty()) {
    auto* ds = dynamic_cast<fsdp::DeepSpeedStrategy*>(&strategy);
    TORCH_CHECK(ds && ds->param_disk_plan() && ds->disk_plan(),
                "fsdp-bench checkpoint: --params-on-disk did not put the parameters on disk");
    // This rank's swap records: parameter shards and moments (fp32).
    at::Tensor mine = at::tensor({ds->param_disk_plan()->numel_on_disk * 4 +
                                  ds->disk_plan()->state_numel * 8}, at::kLong);
    at::Tensor all = at::empty({world}, at::kLong);
    pg.all_gather_into_tensor(all, mine);
    json per_rank = json::array();
    for (int r = 0; r < world; ++r) per_rank.push_back(all[r].item<int64_t>() / 1048576.0);
    out["state_on_disk_mb_per_rank"] = per_rank;
    out["largest_unit_shard_mb"] = ds->param_disk_plan()->largest_unit_numel * 4 / 1048576.0;
    out["sub_group_size"] = sub_group_size;
  }
  auto measure = [&](const std::string& what, const std::function<void()>& fn) {
    strategy.barrier();
    const int64_t before = fsdp::memory_stats().current_bytes;
    fsdp::reset_peak_memory_stats();
    const double t0 = now_s();
    fn();
    strategy.barrier();
    const double secs = now_s() - t0;
    at::Tensor extra = at::tensor({fsdp::memory_stats().peak_bytes - before, before}, at::kLong);
    at::Tensor all = at::empty({2 * world}, at::kLong);
    pg.all_gather_into_tensor(all, extra);
    json per_rank_extra = json::array(), per_rank_before = json::array();
    for (int r = 0; r < world; ++r) {
      per_rank_extra.push_back(all[2 * r].item<int64_t>() / 1048576.0);
      per_rank_before.push_back(all[2 * r + 1].item<int64_t>() / 1048576.0);
    }
    out[what] = {{"seconds", secs},
                 {"extra_peak_mb_per_rank", per_rank_extra},
                 {"resident_mb_per_rank", per_rank_before}};
  };

  if (trainer.is_global_zero()) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  strategy.barrier();
  std::vector<std::string> types = {"full", "sharded"};
  if (!nvme.empty()) types = {"sharded"};  // the full format would gather the moments whole
  for (const std::string& type : types) {
    const std::string path = dir + "/" + type;
    auto st = fsdp::parse_state_dict_type(type);
    measure("save_" + type, [&] {
      fsdp::TrainingProgress p;
      p.global_step = 1;
      fsdp::save_checkpoint(path, strategy, lm, lm.opt.get(), p, st);
    });
    measure("load_" + type, [&] { fsdp::load_checkpoint(path, strategy, lm, lm.opt.get()); });
    if (trainer.is_global_zero()) {
      int64_t bytes = 0;
      for (auto& e : fs::directory_iterator(path)) bytes += fs::file_size(e.path());
      out["save_" + type]["bytes_on_disk_mb"] = bytes / 1048576.0;
    }
  }
  // The converter runs on rank 0 alone (others wait at the barrier).
  measure("convert_sharded_to_safetensors", [&] {
    if (trainer.is_global_zero()) {
      fsdp::convert_to_safetensors(dir + "/sharded", dir + "/model.safetensors");
    }
  });
  if (trainer.is_global_zero()) {
    int64_t largest = 0, total = 0;
    for (const auto& info : fsdp::inspect_checkpoint(dir + "/model.safetensors").tensors) {
      int64_t n = 4;
      for (int64_t d : info.shape) n *= d;
      largest = std::max(largest, n);
      total += n;
    }
    out["model_mb"] = total / 1048576.0;
    out["largest_tensor_mb"] = largest / 1048576.0;
    out["note"] = "extra_peak_mb = peak tensor bytes during the operation minus bytes held "
                  "before it (tracking allocator); resident_mb = bytes held before it";
    std::cout << out.dump(1) << std::endl;
  }
  return 0;
}

fsdp::bench::Registrar reg_checkpoint("checkpoint",
                           "checkpoint save/load time and peak memory per rank (full vs "
                           "sharded, fsdp) and the streaming converter",
                           run_checkpoint);

}  // namespace
