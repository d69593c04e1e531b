// The strategy registry: every strategy name the project knows ("single", "ddp", "fsdp",
// "fsdp_shard_grad_op", ...), parsed in one place. It sits above the strategies it names
// (src/train/strategy_registry.cpp); the strategies themselves never call it.
#pragma once

#include "fsdp/strategy.h"

#include <string>
#include <vector>

namespace fsdp {

// A new strategy object for `name`. An unknown name is an error that lists the valid ones.
StrategyPtr make_strategy(const std::string& name);
// Every registered name, in the order `fsdp-train --help` lists them.
std::vector<std::string> strategy_names();

}  // namespace fsdp
