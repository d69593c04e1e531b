// The strategy registry (docs/design.md, "Decisions"): the one parser of strategy names. It
// sits above the strategies it names; none of them calls it.
#include "fsdp/strategy_registry.h"

#include "common/text.h"
#include "fsdp/ddp.h"
#include "fsdp/deepspeed.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/single_strategy.h"

#include <c10/util/Exception.h>

#include <functional>
#include <utility>

namespace fsdp {
namespace {

struct RegistryEntry {
  const char* name;
  const char* help;
  std::function<StrategyPtr()> make;
};

// Every strategy name the project knows, in the order `--help` lists them.
const std::vector<RegistryEntry>& registry() {
  static const std::vector<RegistryEntry> entries = {
      {"single", "one process, no communication (world size must be 1)",
       [] { return std::make_shared<SingleDeviceStrategy>(); }},
      {"ddp", "replicate the model, all-reduce gradients in buckets",
       [] { return std::make_shared<DDPStrategy>(); }},
      // FSDP: one name per sharding strategy (make_fsdp_strategy parses them).
      {"fsdp", "fully sharded data parallel (FULL_SHARD unless --sharding-strategy)",
       [] { return make_fsdp_strategy("fsdp"); }},
      {"fsdp_full_shard", "FSDP: shard parameters, gradients, optimizer state",
       [] { return make_fsdp_strategy("fsdp_full_shard"); }},
      {"fsdp_shard_grad_op", "FSDP: shard gradients and optimizer state",
       [] { return make_fsdp_strategy("fsdp_shard_grad_op"); }},
      {"fsdp_no_shard", "FSDP engine, no sharding (DDP-like)",
       [] { return make_fsdp_strategy("fsdp_no_shard"); }},
      {"fsdp_hybrid_shard", "FSDP: FULL_SHARD inside a node, replicate across",
       [] { return make_fsdp_strategy("fsdp_hybrid_shard"); }},
      {"fsdp_hybrid_shard_zero2", "FSDP: SHARD_GRAD_OP inside a node, replicate across",
       [] { return make_fsdp_strategy("fsdp_hybrid_shard_zero2"); }},
      // DeepSpeed ZeRO, Lightning's names (make_deepspeed_strategy parses them).
      {"deepspeed", "DeepSpeed ZeRO stage 2 (Lightning's default DeepSpeedStrategy)",
       [] { return make_deepspeed_strategy("deepspeed"); }},
      {"deepspeed_stage_1", "ZeRO 1: shard optimizer state",
       [] { return make_deepspeed_strategy("deepspeed_stage_1"); }},
      {"deepspeed_stage_2", "ZeRO 2: shard optimizer state and gradients",
       [] { return make_deepspeed_strategy("deepspeed_stage_2"); }},
      {"deepspeed_stage_2_offload", "ZeRO 2, optimizer state in host memory",
       [] { return make_deepspeed_strategy("deepspeed_stage_2_offload"); }},
      {"deepspeed_stage_3", "ZeRO 3: shard parameters, gradients and optimizer state",
       [] { return make_deepspeed_strategy("deepspeed_stage_3"); }},
      {"deepspeed_stage_3_offload", "ZeRO 3, parameters and optimizer state in host memory",
       [] { return make_deepspeed_strategy("deepspeed_stage_3_offload"); }},
      {"deepspeed_stage_3_offload_nvme", "ZeRO 3, parameters and optimizer state on disk (nvme_path)",
       [] { return make_deepspeed_strategy("deepspeed_stage_3_offload_nvme"); }},
  };
  return entries;
}

}  // namespace

StrategyPtr make_strategy(const std::string& name) {
  for (const auto& e : registry()) {
    if (name == e.name) return e.make();
  }
  TORCH_CHECK(false, "[make_strategy] unknown strategy '", name, "'; valid names: ",
              detail::quoted_list(strategy_names()),
              " (or 'auto': 'single' for one rank, 'ddp' for more)");
}

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.emplace_back(e.name);
  return names;
}

}  // namespace fsdp
