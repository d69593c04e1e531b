// The strategy registry (docs/design.md, "Decisions"): the one parser of strategy names, and the
// family of options each name is built from. It sits above the strategies it names; none of
// them calls it.
#include "fsdp/strategy_registry.h"

#include "common/text.h"
#include "fsdp/single_strategy.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <utility>

namespace fsdp {
namespace {

StrategyEntry single_entry() {
  return {"single", "one process, no communication (world size must be 1)",
          StrategyFamily::kSingle,
          [](const StrategyOptions&) { return std::make_shared<SingleDeviceStrategy>(); }};
}

StrategyEntry ddp_entry() {
  return {"ddp", "replicate the model, all-reduce gradients in buckets", StrategyFamily::kDDP,
          [](const StrategyOptions& o) { return std::make_shared<DDPStrategy>(o.ddp); }};
}

// FSDP: one name per sharding strategy (make_fsdp_strategy parses them).
StrategyEntry fsdp_entry(const char* name, const char* help) {
  return {name, help, StrategyFamily::kFSDP, [n = std::string(name)](const StrategyOptions& o) {
            return make_fsdp_strategy(n, o.fsdp);
          }};
}

// DeepSpeed ZeRO, Lightning's names (make_deepspeed_strategy parses them).
StrategyEntry deepspeed_entry(const char* name, const char* help) {
  return {name, help, StrategyFamily::kDeepSpeed,
          [n = std::string(name)](const StrategyOptions& o) {
            return make_deepspeed_strategy(n, o.deepspeed);
          }};
}

struct Registry {
  std::mutex mutex;
  std::vector<StrategyEntry> entries;
};

// The built-in strategies, in the order `--help` lists them; register_strategy appends.
Registry& registry() {
  static Registry r{
      {},
      {
          single_entry(),
          ddp_entry(),
          fsdp_entry("fsdp", "fully sharded data parallel (FULL_SHARD unless --sharding-strategy)"),
          fsdp_entry("fsdp_full_shard", "FSDP: shard parameters, gradients, optimizer state"),
          fsdp_entry("fsdp_shard_grad_op", "FSDP: shard gradients and optimizer state"),
          fsdp_entry("fsdp_no_shard", "FSDP engine, no sharding (DDP-like)"),
          fsdp_entry("fsdp_hybrid_shard", "FSDP: FULL_SHARD inside a node, replicate across"),
          fsdp_entry("fsdp_hybrid_shard_zero2",
                     "FSDP: SHARD_GRAD_OP inside a node, replicate across"),
          deepspeed_entry("deepspeed",
                          "DeepSpeed ZeRO stage 2 (Lightning's default DeepSpeedStrategy)"),
          deepspeed_entry("deepspeed_stage_1", "ZeRO 1: shard optimizer state"),
          deepspeed_entry("deepspeed_stage_2", "ZeRO 2: shard optimizer state and gradients"),
          deepspeed_entry("deepspeed_stage_2_offload", "ZeRO 2, optimizer state in host memory"),
          deepspeed_entry("deepspeed_stage_3",
                          "ZeRO 3: shard parameters, gradients and optimizer state"),
          deepspeed_entry("deepspeed_stage_3_offload",
                          "ZeRO 3, parameters and optimizer state in host memory"),
          deepspeed_entry("deepspeed_stage_3_offload_nvme",
                          "ZeRO 3, parameters and optimizer state on disk (nvme_path)"),
      }};
  return r;
}

[[noreturn]] void unknown(const std::string& name) {
  TORCH_CHECK(false, "[make_strategy] unknown strategy '", name, "'; valid names: ",
              detail::quoted_list(strategy_names()),
              " (or 'auto': 'single' for one rank, 'ddp' for more)");
}

}  // namespace

const char* to_string(StrategyFamily family) {
  switch (family) {
    case StrategyFamily::kSingle: return "single";
    case StrategyFamily::kDDP: return "ddp";
    case StrategyFamily::kFSDP: return "fsdp";
    case StrategyFamily::kDeepSpeed: return "deepspeed";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown StrategyFamily ", static_cast<int>(family));
}

std::vector<StrategyFamily> strategy_families() {
  return {StrategyFamily::kSingle, StrategyFamily::kDDP, StrategyFamily::kFSDP,
          StrategyFamily::kDeepSpeed};
}

void register_strategy(StrategyEntry entry) {
  TORCH_CHECK(!entry.name.empty() && entry.name != "auto", "[register_strategy] '", entry.name,
              "' cannot name a strategy ('auto' means single or ddp by world size)");
  TORCH_CHECK(entry.make, "[register_strategy] strategy '", entry.name,
              "' has no make function (StrategyEntry::make builds it from StrategyOptions)");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const bool taken = std::any_of(r.entries.begin(), r.entries.end(),
                                 [&](const StrategyEntry& e) { return e.name == entry.name; });
  TORCH_CHECK(!taken, "[register_strategy] a strategy named '", entry.name,
              "' is already registered; pick another name");
  r.entries.push_back(std::move(entry));
}

StrategyEntry strategy_entry(const std::string& name) {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    for (const auto& e : r.entries) {
      if (e.name == name) return e;
    }
  }
  unknown(name);
}

std::vector<StrategyEntry> strategy_entries() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.entries;
}

StrategyPtr make_strategy(const std::string& name, const StrategyOptions& options) {
  return strategy_entry(name).make(options);
}

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& e : strategy_entries()) names.push_back(e.name);
  return names;
}

std::vector<std::string> strategy_names(StrategyFamily family) {
  std::vector<std::string> names;
  for (const auto& e : strategy_entries()) {
    if (e.family == family) names.push_back(e.name);
  }
  return names;
}

std::string resolve_strategy_name(const std::string& name, int world_size) {
  if (name != "auto") return name;
  return world_size > 1 ? "ddp" : "single";
}

}  // namespace fsdp
