// Linear, LinearOwner, named_linears, replace_linear. See include/fsdp/linear.h.
#include "fsdp/linear.h"

#include "models/detail.h"

#include <torch/nn/init.h>

#include <cmath>

namespace fsdp {

Linear::Linear(int64_t in_features, int64_t out_features, bool with_bias, at::ScalarType dtype) {
  TORCH_CHECK(in_features > 0 && out_features > 0, "[Linear] in_features (", in_features,
              ") and out_features (", out_features, ") must be positive");
  weight = register_parameter("weight", at::empty({out_features, in_features}, at::dtype(dtype)));
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (with_bias) {
    bias = register_parameter("bias", at::empty({out_features}, at::dtype(dtype)));
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    torch::nn::init::uniform_(bias, -bound, bound);
  }
}

Linear::Linear(at::Tensor w, at::Tensor b) {
  TORCH_CHECK(w.defined() && w.dim() == 2, "[Linear] weight must be (out, in), got ",
              w.defined() ? w.sizes() : at::IntArrayRef{});
  const bool weight_grad = w.requires_grad();
  weight = register_parameter("weight", std::move(w), weight_grad);
  if (b.defined()) {
    TORCH_CHECK(b.dim() == 1 && b.size(0) == weight.size(0), "[Linear] bias must be (",
                weight.size(0), "), got ", b.sizes());
    const bool bias_grad = b.requires_grad();
    bias = register_parameter("bias", std::move(b), bias_grad);
  }
}

at::Tensor Linear::forward(const fsdp::nn::Inputs& inputs) {
  const at::Tensor x = demos::detail::arg(inputs, 0);  // (..., in)
  TORCH_CHECK(x.defined() && x.size(-1) == weight.size(1), "[Linear] input must end in ",
              weight.size(1), " features, got ", x.defined() ? x.sizes() : at::IntArrayRef{});
  // An input of another floating dtype is cast to the weight's (at::linear would refuse it): a
  // bf16 head after fp32 norms (KbitUpcast::kNorms in fsdp/lora.h). Autocast casts both first.
  if (x.is_floating_point() && weight.is_floating_point() && x.scalar_type() != weight.scalar_type()) {
    return at::linear(x.to(weight.scalar_type()), weight, bias);
  }
  return at::linear(x, weight, bias);
}

at::Tensor Linear::dense_weight(at::ScalarType dtype) const {
  return weight.detach().to(dtype);
}

LinearPtr* LinearOwner::linear_slot(const std::string& name) {
  for (size_t i = 0; i < names_.size(); ++i) {
    if (names_[i] == name) return slots_[i];
  }
  return nullptr;
}

void LinearOwner::register_linear(torch::nn::Module& self, const std::string& name,
                                  LinearPtr& member, LinearPtr layer) {
  TORCH_CHECK(layer, "[LinearOwner] linear layer '", name, "' is null");
  member = self.register_module(name, std::move(layer));
  names_.push_back(name);
  slots_.push_back(&member);
}

namespace {

void collect_linears(torch::nn::Module& m, const std::string& prefix,
                     std::vector<std::pair<std::string, LinearPtr>>& out) {
  for (auto& item : m.named_children()) {
    const std::string fqn = prefix.empty() ? item.key() : prefix + "." + item.key();
    if (auto linear = std::dynamic_pointer_cast<LinearLayer>(item.value())) {
      out.emplace_back(fqn, linear);
    }
    collect_linears(*item.value(), fqn, out);
  }
}

}  // namespace

std::vector<std::pair<std::string, LinearPtr>> named_linears(torch::nn::Module& root) {
  std::vector<std::pair<std::string, LinearPtr>> out;
  collect_linears(root, "", out);
  return out;
}

void replace_linear(torch::nn::Module& root, const std::string& fqn, LinearPtr layer) {
  TORCH_CHECK(layer, "[replace_linear] the new layer for '", fqn, "' is null");
  const auto dot = fqn.rfind('.');
  const std::string parent_path = dot == std::string::npos ? "" : fqn.substr(0, dot);
  const std::string name = dot == std::string::npos ? fqn : fqn.substr(dot + 1);
  torch::nn::Module* parent = &root;
  if (!parent_path.empty()) {
    std::shared_ptr<torch::nn::Module> found;
    for (auto& item : root.named_modules("", /*include_self=*/false)) {
      if (item.key() == parent_path) {
        found = item.value();
        break;
      }
    }
    TORCH_CHECK(found, "[replace_linear] no module '", parent_path, "' under the root (while "
                "replacing '", fqn, "')");
    parent = found.get();
  }
  auto* owner = dynamic_cast<LinearOwner*>(parent);
  LinearPtr* slot = owner ? owner->linear_slot(name) : nullptr;
  TORCH_CHECK(slot != nullptr, "[replace_linear] '", fqn, "' is not a swappable linear layer: ",
              owner ? "its parent has no linear child of that name"
                    : "its parent module is not an fsdp::LinearOwner");
  parent->replace_module(name, layer);
  *slot = std::move(layer);
}

}  // namespace fsdp
