#include "fsdp/nn.h"

#include <algorithm>

namespace fsdp::nn {

int Module::add_pre_forward_hook(PreForwardHook hook) {
  pre_hooks_.emplace_back(next_handle_, std::move(hook));
  return next_handle_++;
}

int Module::add_post_forward_hook(PostForwardHook hook) {
  post_hooks_.emplace_back(next_handle_, std::move(hook));
  return next_handle_++;
}

void Module::remove_hook(int handle) {
  auto match = [handle](const auto& entry) { return entry.first == handle; };
  pre_hooks_.erase(std::remove_if(pre_hooks_.begin(), pre_hooks_.end(), match), pre_hooks_.end());
  post_hooks_.erase(std::remove_if(post_hooks_.begin(), post_hooks_.end(), match),
                    post_hooks_.end());
}

at::Tensor Module::call(Inputs inputs) {
  // Hooks may add or remove hooks on this module while running: iterate over copies.
  auto pre = pre_hooks_;
  for (auto& [handle, hook] : pre) hook(*this, inputs);
  at::Tensor output = forward_wrapper_ ? forward_wrapper_(*this, inputs) : forward(inputs);
  auto post = post_hooks_;
  for (auto& [handle, hook] : post) hook(*this, inputs, output);
  return output;
}

}  // namespace fsdp::nn
