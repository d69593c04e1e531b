// The construction scope: what a model's constructors tell the strategy running configure_model.
// See Note [Configure-model scope] in src/train/strategy.cpp.
#pragma once

#include "fsdp/nn.h"

#include <string>

namespace fsdp::detail {

// The receiving side of fsdp::nn::built() and fsdp::wrap() (the Strategy running
// configure_model, through configure_model_with).
class ConstructionListener {
 public:
  virtual ~ConstructionListener() = default;
  virtual void on_built(torch::nn::Module& module) = 0;
  virtual void on_wrap(fsdp::nn::Module& module) = 0;
};

// While it lives, fsdp::nn::built() and fsdp::wrap() on this thread reach `listener`; without
// one they do nothing. One at a time per thread: opening a second is an error naming the
// `owner` of the first.
class ConstructionScope {
 public:
  ConstructionScope(ConstructionListener& listener, std::string owner);
  ~ConstructionScope();
  ConstructionScope(const ConstructionScope&) = delete;
  ConstructionScope& operator=(const ConstructionScope&) = delete;

  // The listener of this thread's open scope, or null.
  static ConstructionListener* current();

 private:
  ConstructionListener& listener_;
  std::string owner_;
};

// fsdp::wrap(module): tells the open scope's listener, if any.
void notify_wrap(fsdp::nn::Module& module);

}  // namespace fsdp::detail
