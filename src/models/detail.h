// Helpers shared by the demo models (private to src/models).
#pragma once

#include "fsdp/nn.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/normalization.h>

#include <functional>
#include <vector>

namespace fsdp::demos::detail {

// The demo models' LayerNorm over the last `d` features (eps 1e-5, PyTorch's and GPT-2's).
inline torch::nn::LayerNorm layer_norm(int64_t d) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5));
}

// Dropout that costs nothing when it is off (p == 0 or eval mode).
inline at::Tensor dropout(const at::Tensor& x, double p, bool training) {
  return (p > 0.0 && training) ? at::dropout(x, p, /*train=*/true) : x;
}

// inputs[i] when present, else an undefined tensor ("no argument").
inline at::Tensor arg(const std::vector<at::Tensor>& inputs, size_t i) {
  return i < inputs.size() ? inputs[i] : at::Tensor();
}

// Runs `body` in place of `model`'s forward, between the model's forward hooks: a method other
// than forward (the models' loss()) called directly would skip them, and a strategy that made
// the model itself a unit (ZeRO-3's one unit per module with parameters) would not have gathered
// the model's own parameters (its final norms) for it. The body travels as the model's forward
// wrapper for this one call (the models set none of their own: activation checkpointing wraps
// their layers, not the model).
inline at::Tensor call_with_hooks(fsdp::nn::Module& model, std::vector<at::Tensor> inputs,
                                  std::function<at::Tensor(const std::vector<at::Tensor>&)> body) {
  TORCH_CHECK(!model.has_forward_wrapper(), "[", model.name(), "] loss(): the model's forward is "
              "wrapped (activation checkpointing of the whole model), which its loss cannot "
              "reuse. HINT: checkpoint its layers instead (the layer types of the model)");
  model.set_forward_wrapper(
      [&body](fsdp::nn::Module&, const std::vector<at::Tensor>& in) { return body(in); });
  struct Unset {
    fsdp::nn::Module& m;
    ~Unset() { m.set_forward_wrapper(nullptr); }
  } unset{model};
  return model.call(std::move(inputs));
}

}  // namespace fsdp::demos::detail
