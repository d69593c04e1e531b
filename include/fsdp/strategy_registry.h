// The strategy registry: every strategy name the project knows ("single", "ddp", "fsdp",
// "fsdp_shard_grad_op", "deepspeed_stage_3", ...), parsed in one place, each with the family of
// options it is built from. Programs take their strategy names, and the flags that apply to each,
// from here and never match names themselves: a strategy added with register_strategy appears
// in fsdp-train's --strategy with its family's flags.
//
//   fsdp::StrategyOptions o;
//   o.fsdp.limit_all_gathers = true;
//   auto s = fsdp::make_strategy("fsdp_shard_grad_op", o);  // reads o.fsdp only
//
//   fsdp::register_strategy({"my_fsdp", "FSDP with my defaults", fsdp::StrategyFamily::kFSDP,
//                            [](const fsdp::StrategyOptions& o) { return make_mine(o.fsdp); }});
//
// It sits above the strategies it names (src/train/strategy_registry.cpp); the strategies
// themselves never call it.
#pragma once

#include "fsdp/ddp.h"
#include "fsdp/deepspeed.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/strategy.h"

#include <functional>
#include <string>
#include <vector>

namespace fsdp {

// Which options a strategy is built from, and so which of a program's flags apply to it:
//   kSingle     none (one process, no communication)
//   kDDP        StrategyOptions::ddp
//   kFSDP       StrategyOptions::fsdp
//   kDeepSpeed  StrategyOptions::deepspeed
enum class StrategyFamily { kSingle, kDDP, kFSDP, kDeepSpeed };
const char* to_string(StrategyFamily family);  // "single", "ddp", "fsdp", "deepspeed"
std::vector<StrategyFamily> strategy_families();  // every family, in the order above

// What a registered strategy may be built from; an entry reads its family's member only.
struct StrategyOptions {
  FSDPOptions fsdp;
  DDPOptions ddp;
  DeepSpeedOptions deepspeed;
};

struct StrategyEntry {
  std::string name;  // what --strategy and TrainerOptions::strategy say
  std::string help;  // one line, for --help
  StrategyFamily family = StrategyFamily::kSingle;
  std::function<StrategyPtr(const StrategyOptions&)> make;
};

// Adds a strategy after the built-in ones (in --help order). An empty name, "auto", a name
// already registered or an entry without `make` is an error.
void register_strategy(StrategyEntry entry);
// The entry registered as `name`. An unknown name is an error that lists the valid ones.
StrategyEntry strategy_entry(const std::string& name);
// Every registered entry, in --help order.
std::vector<StrategyEntry> strategy_entries();

// A new strategy object for `name`, built from `options` (its family's member). An unknown
// name is an error that lists the valid ones.
StrategyPtr make_strategy(const std::string& name, const StrategyOptions& options = {});
// Every registered name, in the order `fsdp-train --help` lists them.
std::vector<std::string> strategy_names();
// The registered names of one family, in the same order.
std::vector<std::string> strategy_names(StrategyFamily family);
// "auto": "single" for one rank, "ddp" for more (Lightning's default); any other name as given.
std::string resolve_strategy_name(const std::string& name, int world_size);

}  // namespace fsdp
