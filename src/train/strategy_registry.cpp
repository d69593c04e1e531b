// The one parser of strategy names (DESIGN.md §5.3) and the active-strategy slot used by
// fsdp::wrap() while configure_model runs.
#include "fsdp/strategy.h"
#include "fsdp/trainer.h"

#include "fsdp/ddp.h"
#include "fsdp/fsdp_strategy.h"

#include <c10/util/Exception.h>

#include <functional>
#include <sstream>
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
      // --- FSDP strategies: the fsdp engineer adds their names here (one line each), e.g.
      // {"fsdp", "...", [] { return std::make_shared<FSDPStrategy>(); }},
      {"fsdp", "fully sharded data parallel (FULL_SHARD unless --sharding-strategy)", [] { return make_fsdp_strategy("fsdp"); }},
      {"fsdp_full_shard", "FSDP: shard parameters, gradients, optimizer state", [] { return make_fsdp_strategy("fsdp_full_shard"); }},
      {"fsdp_shard_grad_op", "FSDP: shard gradients and optimizer state", [] { return make_fsdp_strategy("fsdp_shard_grad_op"); }},
      {"fsdp_no_shard", "FSDP engine, no sharding (DDP-like)", [] { return make_fsdp_strategy("fsdp_no_shard"); }},
      {"fsdp_hybrid_shard", "FSDP: FULL_SHARD inside a node, replicate across", [] { return make_fsdp_strategy("fsdp_hybrid_shard"); }},
      {"fsdp_hybrid_shard_zero2", "FSDP: SHARD_GRAD_OP inside a node, replicate across", [] { return make_fsdp_strategy("fsdp_hybrid_shard_zero2"); }},
  };
  return entries;
}

std::string joined_names() {
  std::ostringstream os;
  bool first = true;
  for (const auto& e : registry()) {
    os << (first ? "" : ", ") << "'" << e.name << "'";
    first = false;
  }
  return os.str();
}

Strategy* g_active_strategy = nullptr;

}  // namespace

StrategyPtr make_strategy(const std::string& name) {
  for (const auto& e : registry()) {
    if (name == e.name) return e.make();
  }
  TORCH_CHECK(false, "[make_strategy] unknown strategy '", name, "'; valid names: ",
              joined_names(), " (or 'auto': 'single' for one rank, 'ddp' for more)");
}

std::vector<std::string> strategy_names() {
  std::vector<std::string> names;
  for (const auto& e : registry()) names.emplace_back(e.name);
  return names;
}

Strategy* active_strategy() { return g_active_strategy; }

void configure_model_with(Strategy& strategy, LightningModule& module) {
  TORCH_CHECK(g_active_strategy == nullptr,
              "[configure_model] configure_model is already running under strategy '",
              g_active_strategy ? g_active_strategy->name() : "", "'; it must not nest");
  // Active for the whole enter/configure/exit sequence: fsdp::wrap() may be called from any of it.
  g_active_strategy = &strategy;
  try {
    strategy.enter_configure_model();
    module.configure_model();
    strategy.exit_configure_model();
  } catch (...) {
    g_active_strategy = nullptr;
    throw;
  }
  g_active_strategy = nullptr;
}

}  // namespace fsdp
