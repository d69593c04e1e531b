// The dry-run planner; see apps/support/planner.h.
#include "planner.h"

#include <torch/cuda.h>

#include <algorithm>
#include <cstdio>
#include <iostream>

namespace fsdp::app {

PlanRow plan_ddp(const torch::nn::Module& model, const DDPOptions& options) {
  const DDPMemoryEstimate e = estimate_ddp_memory(model, options);
  return {"ddp", e.param_bytes, e.grad_bytes, e.optimizer_bytes, e.bucket_bytes};
}

PlanRow plan_fsdp(torch::nn::Module& model, const FSDPOptions& options, int world, int devices) {
  const FSDPMemoryEstimate e = estimate_fsdp_memory(model, options, world, devices);
  return {std::string("fsdp ") + to_string(options.sharding_strategy), e.sharded_param_bytes,
          e.sharded_grad_bytes, e.optimizer_bytes, e.unsharded_peak_bytes};
}

std::vector<PlanRow> plan_strategies(torch::nn::Module& model, const StrategyOptions& options,
                                     int world, int devices, int num_nodes) {
  std::vector<PlanRow> rows = {plan_ddp(model, options.ddp)};
  std::vector<ShardingStrategy> strategies = {ShardingStrategy::kNoShard,
                                              ShardingStrategy::kShardGradOp,
                                              ShardingStrategy::kFullShard};
  const int hybrid = options.fsdp.hybrid_shard_size;
  const int shard_size = hybrid > 0 ? hybrid : devices;
  if (num_nodes > 1 || (shard_size > 1 && shard_size < world && world % shard_size == 0)) {
    strategies.push_back(ShardingStrategy::kHybridShard);  // meaningful: > 1 shard group
  }
  for (ShardingStrategy ss : strategies) {
    FSDPOptions o;
    o.sharding_strategy = ss;
    o.auto_wrap_policy = options.fsdp.auto_wrap_policy;
    o.hybrid_shard_size = hybrid;
    rows.push_back(plan_fsdp(model, o, world, devices));
  }
  return rows;
}

void print_plan(const std::vector<PlanRow>& rows, const ModelStateBudget& budget) {
  const bool check = budget.bytes > 0;
  std::printf("%-20s %12s %12s %12s %14s %12s%s\n", "strategy", "params/rank", "grads/rank",
              "Adam state", "buffers/units", "total/rank", check ? "  fits" : "");
  for (const auto& r : rows) {
    std::printf("%-20s %12s %12s %12s %14s %12s%s\n", r.name.c_str(),
                format_bytes(r.params).c_str(), format_bytes(r.grads).c_str(),
                format_bytes(r.optimizer).c_str(), format_bytes(r.extra).c_str(),
                format_bytes(r.total()).c_str(),
                !check ? "" : r.total() <= budget.bytes ? "  yes" : "  NO (setup refuses it)");
  }
  if (check) {
    std::printf("budget: %s per rank, %s\n", format_bytes(budget.bytes).c_str(),
                budget.what.c_str());
  }
  std::fflush(stdout);
}

nlohmann::json plan_json(const std::vector<PlanRow>& rows, const ModelStateBudget& budget) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : rows) {
    nlohmann::json row = {{"name", r.name}, {"param_bytes", r.params}, {"grad_bytes", r.grads},
                          {"optimizer_bytes", r.optimizer}, {"extra_bytes", r.extra},
                          {"total_bytes", r.total()}};
    if (budget.bytes > 0) row["fits"] = r.total() <= budget.bytes;
    out.push_back(std::move(row));
  }
  return out;
}

nlohmann::json budget_json(const ModelStateBudget& budget) {
  return {{"bytes", budget.bytes}, {"what", budget.what}};
}

ModelStateBudget plan_budget(const std::string& accelerator, int local_world_size) {
  const bool gpu = accelerator == "cuda" || accelerator == "gpu" ||
                   (accelerator == "auto" && torch::cuda::device_count() > 0);
  return planned_model_state_budget(gpu ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU),
                                    local_world_size);
}

namespace {

// Rows of `t` this rank holds when dim 0 is split over `world` ranks, times its row size.
int64_t shard_numel(const at::Tensor& t, int world) {
  const int64_t dim0 = t.dim() >= 1 ? t.size(0) : 1;
  return (dim0 + world - 1) / world * (t.numel() / std::max<int64_t>(dim0, 1));
}

// "fits" or why setup would refuse it, for `node_disk` bytes on a disk with `free` bytes free.
bool print_node_disk(int64_t disk_bytes, int64_t free_bytes, int devices, const char* extra) {
  const int64_t node_disk = disk_bytes * devices;
  const bool fits = free_bytes < 0 || node_disk <= free_bytes;
  std::cout << "  this node (" << devices << " rank(s)): " << format_bytes(node_disk)
            << " on disk: " << (fits ? "fits" : "does NOT fit; setup would refuse it") << extra
            << "\n";
  return fits;
}

}  // namespace

bool print_disk_plans(const torch::nn::Module& model, const DeepSpeedOptions& o, int world,
                      int devices) {
  bool ok = true;
  // Optimizer state on disk: rank 0's ZeRO partition (the largest) of the Adam moments goes to
  // swap files; the plan is the one DeepSpeedStrategy checks at setup.
  if (o.offload_optimizer && o.offload_optimizer_device == "nvme") {
    int64_t part = 0;
    for (const auto& p : model.parameters()) {
      if (p.requires_grad()) part += shard_numel(p, world);
    }
    DiskPlan plan = plan_disk_offload(part, static_cast<int64_t>(o.sub_group_size), o.nvme_path);
    plan.dir = o.nvme_path + "/<job>/rank<r>";
    std::cout << "disk tier (offload_optimizer nvme), per rank: the Adam state column above "
                 "goes to disk instead of RAM\n"
              << plan.describe();
    ok = print_node_disk(plan.disk_bytes, plan.free_bytes, devices, "") && ok;
  }
  // Parameters on disk (stage 3): each unit (a module with parameters above
  // stage3_param_persistence_threshold) puts this rank's shard in one record.
  if ((o.offload_parameters && o.offload_params_device == "nvme") || o.remote_device == "nvme") {
    std::vector<int64_t> unit_bytes;
    for (const auto& m : model.modules(/*include_self=*/true)) {
      int64_t bytes = 0;
      for (const auto& p : m->named_parameters(/*recurse=*/false)) {
        if (p.value().numel() > o.stage3_param_persistence_threshold) {
          bytes += shard_numel(p.value(), world) * 4;
        }
      }
      if (bytes > 0) unit_bytes.push_back(bytes);
    }
    ParamDiskPlan plan = plan_param_offload(
        unit_bytes, o.params_buffer_count, static_cast<int64_t>(o.params_buffer_size),
        static_cast<int64_t>(o.max_in_cpu), o.nvme_path);
    plan.dir = o.nvme_path + "/<job>/rank<r>";
    const bool buffer_ok = plan.largest_unit_numel <= plan.buffer_numel;
    std::cout << "parameters on disk (offload_param nvme), per rank: the parameter column of "
                 "stage 3 goes to disk, except the persistent parameters (<= "
              << o.stage3_param_persistence_threshold << " elements)\n"
              << plan.describe();
    ok = print_node_disk(plan.disk_bytes, plan.free_bytes, devices,
                         buffer_ok ? ""
                                   : "; the largest unit's shard exceeds buffer_size: setup "
                                     "would refuse it (raise --params-buffer-size)") &&
         buffer_ok && ok;
  }
  return ok;
}

int64_t count_parameters(const torch::nn::Module& model) {
  int64_t n = 0;
  for (const auto& p : model.parameters()) n += p.numel();
  return n;
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace fsdp::app
