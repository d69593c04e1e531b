// Linear layers that can be swapped inside a model: dense, 4-bit (fsdp/quantization.h) and
// LoRA-wrapped (fsdp/lora.h) layers share one interface, so a model holds "a linear layer" and
// quantization or LoRA replaces it in place, as bitsandbytes and PEFT do in Python:
//
//   auto model = std::make_shared<fsdp::LlamaForCausalLM>(config);
//   for (auto& [fqn, linear] : fsdp::named_linears(*model)) std::cout << fqn << "\n";
//   fsdp::replace_linear(*model, "model.layers.0.self_attn.q_proj", new_layer);
//
// A module whose children include swappable linear layers derives from fsdp::LinearOwner and
// registers them with register_linear(), which keeps its member pointer and the registered
// child in step when replace_linear() swaps one.
#pragma once

#include "fsdp/nn.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

// y = x W^T (+ b) for x (..., in_features) -> (..., out_features), whatever stores W.
class LinearLayer : public fsdp::nn::Module {
 public:
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
  // W as a dense (out_features, in_features) tensor in `dtype`: dequantized for a 4-bit layer,
  // the base layer's W for a LoRA layer (its adapter is not included).
  virtual at::Tensor dense_weight(at::ScalarType dtype) const = 0;
  // The bias, or an undefined tensor.
  virtual at::Tensor dense_bias() const = 0;
};
using LinearPtr = std::shared_ptr<LinearLayer>;

// torch.nn.Linear: parameters `weight` (out, in) and optional `bias` (out). Initialization as
// torch.nn.Linear (Kaiming-uniform a=sqrt(5) weight, uniform(+-1/sqrt(in)) bias); models that
// initialize differently overwrite the values.
class Linear : public LinearLayer {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         at::ScalarType dtype = at::kFloat);
  // Adopts existing tensors (e.g. a tied weight) without copying.
  Linear(at::Tensor weight, at::Tensor bias);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  int64_t in_features() const override { return weight.size(1); }
  int64_t out_features() const override { return weight.size(0); }
  at::Tensor dense_weight(at::ScalarType dtype) const override;
  at::Tensor dense_bias() const override { return bias; }

  at::Tensor weight;  // (out, in)
  at::Tensor bias;    // (out) or undefined
};

// A module with swappable linear children.
class LinearOwner {
 public:
  virtual ~LinearOwner() = default;
  // The member holding child `name`, or nullptr when `name` is not one of its linear layers.
  LinearPtr* linear_slot(const std::string& name);
  // Names of the linear children, in registration order.
  const std::vector<std::string>& linear_names() const { return names_; }

 protected:
  // Registers `layer` as child `name` of `self` and remembers `member` as its slot.
  void register_linear(torch::nn::Module& self, const std::string& name, LinearPtr& member,
                       LinearPtr layer);

 private:
  std::vector<std::string> names_;
  std::vector<LinearPtr*> slots_;
};

// Every swappable linear layer under `root` (including nested ones such as a LoRA layer's
// base_layer), with its fully qualified name, parents before children.
std::vector<std::pair<std::string, LinearPtr>> named_linears(torch::nn::Module& root);

// Replaces the linear layer at `fqn` (e.g. "model.layers.0.mlp.up_proj") with `layer`: both
// the owner's member and its registered child. Errors name the path and what is there.
void replace_linear(torch::nn::Module& root, const std::string& fqn, LinearPtr layer);

}  // namespace fsdp
