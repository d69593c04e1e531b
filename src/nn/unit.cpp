// Unit holders (fsdp/unit.h): a plain torch::nn module behind FSDP's call hooks.
//
// Note [Unit holders]
// -------------------
// A holder takes over the wrapped module's registrations: the wrapped module's own parameters
// and buffers are registered on the holder under the same names (the same tensors), its
// children are the holder's children, and the wrapped module itself is registered nowhere. So
// the model's FQNs are those of the plain model, and every walk over the module tree (wrap
// policies, named_parameters, checkpoints, module.to) sees each tensor once.
// The wrapped module's own parameters_ dict still holds those tensors too: the engine registers
// each such parameter in both dicts (parameter_owners in src/shard/fsdp_param.h), so swapping
// in the sharded parameter changes both, and the wrapped module's forward computes with the
// unsharded parameter through its members as any layer does.
#include "fsdp/unit.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/container/any.h>

#include <optional>
#include <string>

namespace fsdp::nn {
namespace {

std::string holder_name(const std::shared_ptr<torch::nn::Module>& wrapped) {
  TORCH_CHECK(wrapped, "[fsdp::nn::unit] the module to wrap is null");
  return "fsdp::nn::Unit(" + wrapped->name() + ")";
}

}  // namespace

UnitBase::UnitBase(std::shared_ptr<torch::nn::Module> wrapped)
    : Module(holder_name(wrapped)), wrapped_(std::move(wrapped)) {
  // See Note [Unit holders].
  for (const auto& p : wrapped_->named_parameters(/*recurse=*/false)) {
    register_parameter(p.key(), p.value(), p.value().defined() && p.value().requires_grad());
  }
  for (const auto& b : wrapped_->named_buffers(/*recurse=*/false)) {
    register_buffer(b.key(), b.value());
  }
  for (const auto& c : wrapped_->named_children()) register_module(c.key(), c.value());
  if (wrapped_->is_training() != is_training()) Module::train(wrapped_->is_training());
}

void UnitBase::train(bool on) {
  Module::train(on);
  wrapped_->train(on);
}

void UnitBase::pretty_print(std::ostream& stream) const {
  stream << "fsdp::nn::Unit(";
  wrapped_->pretty_print(stream);
  stream << ")";
}

at::Tensor UnitBase::forward(const Inputs& inputs) { return run_wrapped(inputs); }

void UnitBase::check_arity(size_t given, size_t arity) const {
  TORCH_CHECK(given <= arity, "[fsdp::nn::Unit] ", wrapped_->name(), " takes ", arity,
              " tensor(s), called with ", given);
}

bool is_instance_of(const torch::nn::Module& m, const ModuleTypes& types) {
  if (types.count(std::type_index(typeid(m)))) return true;
  const auto* holder = dynamic_cast<const UnitBase*>(&m);
  if (holder == nullptr) return false;
  const torch::nn::Module& inner = *holder->wrapped();
  return types.count(std::type_index(typeid(inner))) > 0;
}

namespace {

// The holder of a Sequential's child, whose type is known only at run time: the Sequential
// passes it one tensor.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Woverloaded-virtual"
class SequentialChildUnit : public UnitBase {
 public:
  SequentialChildUnit(torch::nn::AnyModule child, std::string name)
      : UnitBase(child.ptr()), child_(std::move(child)), name_(std::move(name)) {}

  at::Tensor forward(at::Tensor x) { return call(Inputs{std::move(x)}); }

 protected:
  at::Tensor run_wrapped(const Inputs& inputs) override {
    check_arity(inputs.size(), 1);
    std::optional<torch::nn::AnyValue> out;
    try {
      out.emplace(child_.any_forward(inputs.empty() ? at::Tensor() : inputs[0]));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "[fsdp::nn::unit_children] child '", name_, "' (", wrapped()->name(),
                  ") failed in forward: ", e.what_without_backtrace(),
                  "\nHINT: unit_children wraps children whose forward takes one tensor and "
                  "returns a tensor; wrap another child with fsdp::nn::unit or leave it out of "
                  "the Sequential.");
    }
    const at::Tensor* tensor = out->try_get<at::Tensor>();
    TORCH_CHECK(tensor != nullptr, "[fsdp::nn::unit_children] child '", name_, "' (",
                wrapped()->name(), ") returned a ", c10::demangle(out->type_info().name()),
                ", not a tensor; FSDP's hooks need a tensor output. HINT: wrap the module "
                "around it whose forward returns a tensor.");
    return *tensor;
  }

 private:
  torch::nn::AnyModule child_;
  std::string name_;
};
#pragma GCC diagnostic pop

}  // namespace

int unit_children(torch::nn::SequentialImpl& seq) {
  const auto children = seq.named_children();
  TORCH_INTERNAL_ASSERT(children.size() == seq.size(), "Sequential children and slots differ");
  int wrapped = 0;
  size_t i = 0;
  for (auto slot = seq.begin(); slot != seq.end(); ++slot, ++i) {
    const std::string& name = children[i].key();
    const std::shared_ptr<torch::nn::Module>& child = children[i].value();
    TORCH_INTERNAL_ASSERT(child.get() == slot->ptr().get(), "Sequential slot ", i,
                          " is not child '", name, "'");
    if (dynamic_cast<Module*>(child.get()) != nullptr) continue;  // has the hooks already
    if (child->parameters(/*recurse=*/true).empty()) continue;
    auto holder = std::make_shared<SequentialChildUnit>(*slot, name);
    seq.replace_module(name, holder);
    *slot = torch::nn::AnyModule(holder);
    ++wrapped;
  }
  return wrapped;
}

}  // namespace fsdp::nn
