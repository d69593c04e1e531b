// --dry-run: a model built on the meta device (shapes only, see fsdp/init.h) and the per-rank
// model-state bytes of the strategies a program can run, printed as one table and written as
// JSON rows; nothing is allocated, no rank is started, nothing trains.
#pragma once

#include <fsdp/fsdp.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace fsdp::app {

// One strategy's per-rank model state: fp32 parameters, gradients, optimizer state and the
// strategy's own buffers (DDP's buckets, FSDP's unsharded units).
struct PlanRow {
  std::string name;  // "ddp", "fsdp FULL_SHARD", ...
  int64_t params = 0, grads = 0, optimizer = 0, extra = 0;
  int64_t total() const { return params + grads + optimizer + extra; }
};

PlanRow plan_ddp(const torch::nn::Module& model, const DDPOptions& options);
// FSDP with `options` (its sharding strategy names the row) at `world` ranks, `devices` per node.
PlanRow plan_fsdp(torch::nn::Module& model, const FSDPOptions& options, int world, int devices);
// DDP with `options.ddp`, and FSDP NO_SHARD / SHARD_GRAD_OP / FULL_SHARD with `options.fsdp`'s
// wrap policy (and HYBRID_SHARD when there is more than one shard group).
std::vector<PlanRow> plan_strategies(torch::nn::Module& model, const StrategyOptions& options,
                                     int world, int devices, int num_nodes);

// The table: one line per row, bytes per rank in each column; with a budget (bytes > 0) a last
// column says whether the row fits in it, and a line names it.
void print_plan(const std::vector<PlanRow>& rows, const ModelStateBudget& budget = {});
// [{"name", "param_bytes", "grad_bytes", "optimizer_bytes", "extra_bytes", "total_bytes"}, ...],
// each with "fits" (true/false) when the budget has bytes > 0.
nlohmann::json plan_json(const std::vector<PlanRow>& rows, const ModelStateBudget& budget = {});
// {"bytes", "what"} of the budget (bytes 0: none).
nlohmann::json budget_json(const ModelStateBudget& budget);
// The budget a run with `accelerator` ("cpu", "cuda", "gpu", "auto") at `local_world_size` ranks
// per node would check its model state against on local rank 0 (fsdp::planned_model_state_budget).
ModelStateBudget plan_budget(const std::string& accelerator, int local_world_size);

// DeepSpeed's disk tier under `options` (optimizer state and/or parameters on nvme), per rank
// and for the `devices` ranks of this node, printed. Returns false when setup would refuse it
// (the disk is too small, a unit does not fit a buffer); true when it fits or is not used.
bool print_disk_plans(const torch::nn::Module& model, const DeepSpeedOptions& options, int world,
                      int devices);

int64_t count_parameters(const torch::nn::Module& model);
std::string with_commas(int64_t n);  // 1,008,763,390

}  // namespace fsdp::app
