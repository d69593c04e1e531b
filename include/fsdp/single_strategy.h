// SingleDeviceStrategy ("single"): one process, no communication. The reference every
// parallel strategy is compared against.
#pragma once

#include "fsdp/strategy.h"

#include <string>

namespace fsdp {

class SingleDeviceStrategy : public Strategy {
 public:
  std::string name() const override { return "single"; }
  // The world must have one rank.
  void connect(ProcessGroupPtr world, const LaunchInfo& launch) override;
  void setup_module(LightningModule& module) override;
  double clip_grad_norm(LightningModule& module, double max_norm) override;
};

}  // namespace fsdp
