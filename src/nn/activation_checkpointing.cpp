#include "fsdp/activation_checkpointing.h"

#include "nn/activation_partitioning.h"
#include "nn/group_capsule.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {
namespace {

// Depth of checkpointed forwards being recomputed on this thread (nested blocks recompute
// inside their parent's recompute).
thread_local int recompute_depth = 0;

struct RecomputeScope {
  RecomputeScope() { ++recompute_depth; }
  ~RecomputeScope() { --recompute_depth; }
};

// The default generator of `device` (the CPU's, or a CUDA device's: generic ATen, so this
// file needs no CUDA header; a CUDA generator exists only in a CUDA build).
at::Generator default_generator(c10::Device device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

at::Tensor get_rng_state(c10::Device device) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(c10::Device device, const at::Tensor& state) {
  at::Generator gen = default_generator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// Puts `saved` in `device`'s default generator for its lifetime, then the state it found back
// (also when the recompute throws), so checkpointing leaves the RNG stream exactly where the
// plain model would.
class RngStateSwap {
 public:
  RngStateSwap(c10::Device device, const at::Tensor& saved)
      : device_(device), current_(get_rng_state(device)) {
    set_rng_state(device_, saved);
  }
  ~RngStateSwap() { set_rng_state(device_, current_); }
  RngStateSwap(const RngStateSwap&) = delete;
  RngStateSwap& operator=(const RngStateSwap&) = delete;

 private:
  c10::Device device_;
  at::Tensor current_;
};

// Autocast of one device type (bf16-/16-mixed outside FSDP: CPU or CUDA autocast) as it was
// when the block ran forward, for the recompute: backward runs outside the autocast scope, and
// a recompute in fp32 would not reproduce the bf16 forward. Nesting is counted like an
// autocast scope so cached weight casts are dropped after.
class AutocastSwap {
 public:
  AutocastSwap(c10::DeviceType type, bool enabled, at::ScalarType dtype)
      : type_(type),
        enabled_(enabled),
        prev_enabled_(at::autocast::is_autocast_enabled(type)),
        prev_dtype_(at::autocast::get_autocast_dtype(type)) {
    at::autocast::set_autocast_enabled(type_, enabled);
    at::autocast::set_autocast_dtype(type_, dtype);
    if (enabled_) at::autocast::increment_nesting();
  }
  ~AutocastSwap() {
    if (enabled_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(type_, prev_enabled_);
    at::autocast::set_autocast_dtype(type_, prev_dtype_);
  }
  AutocastSwap(const AutocastSwap&) = delete;
  AutocastSwap& operator=(const AutocastSwap&) = delete;

 private:
  c10::DeviceType type_;
  bool enabled_;
  bool prev_enabled_;
  at::ScalarType prev_dtype_;
};

// Keeps the module alive while the graph that recomputes it exists.
struct ModuleRef : torch::CustomClassHolder {
  std::shared_ptr<fsdp::nn::Module> owned;  // null when the module is not owned by a shared_ptr
  fsdp::nn::Module* module = nullptr;
};

// Note [Checkpoint function]
// --------------------------
// forward   runs module.forward(inputs) with grad disabled (Function::apply does that), so no
//           activation of the block is saved; saves the inputs (save_for_backward) and the
//           default CPU generator's state taken just before the block ran (and the CUDA
//           device's, when the block's inputs are on one), and the CPU and CUDA autocast
//           states (bf16-mixed under DDP/single).
// backward  detaches the saved inputs (leaves that require grad where the originals did), swaps
//           the saved RNG state (and autocast state) in, re-runs module.forward with grad
//           enabled (same dropout masks, same dtypes), swaps the current state back, then
//           back-propagates the incoming gradient through the recomputed graph with
//           torch::autograd::backward. That nested
//           backward accumulates into every leaf it reaches: the detached inputs (whose .grad
//           is returned as this function's input gradients) and the block's parameters (their
//           .grad, as without checkpointing; hooks on their AccumulateGrad nodes run there).
// The module's call hooks (FSDP's pre/post-forward) run around the wrapper in forward only; the
// recompute calls forward() directly. Hooks of hooked submodules inside the block do run in the
// recompute; they can tell by in_activation_recompute().
// When no input requires grad (the first block after frozen embeddings, token ids) the output
// would not require grad and the block's parameters would get no gradient: a 0-element
// `anchor` input that requires grad is added then, and receives no gradient.
// Inputs cross the function as one list of defined tensors (autograd cannot take undefined
// tensors as inputs): `slots` says where each one goes in the module's inputs (size n), -1 marks
// the anchor.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                            std::vector<int64_t> slots, int64_t n, c10::IValue module_ref) {
    auto* m = static_cast<ModuleRef*>(module_ref.toCapsule().get())->module;
    fsdp::nn::Inputs inputs(static_cast<size_t>(n));
    // Activation partitioning: per saved input, whether it is kept as a slice (with its sizes
    // and requires_grad) or saved whole. See Note [Activation partitioning].
    const auto partitioning = activation_partitioning();
    std::shared_ptr<ProcessGroup> group = partitioning ? partitioning->group : nullptr;
    const int world = group ? group->size() : 1;
    std::vector<at::Tensor> to_save, parts;
    std::vector<int64_t> partitioned, part_dims, part_sizes, part_grad;
    std::string part_device;
    for (size_t k = 0; k < tensors.size(); ++k) {
      if (slots[k] < 0) continue;  // the anchor
      inputs[static_cast<size_t>(slots[k])] = tensors[k];
      if (detail::partitions(tensors[k], world)) {
        partitioned.push_back(1);
        parts.push_back(
            detail::partition_activation(tensors[k], *group, partitioning->cpu_checkpointing));
        part_dims.push_back(tensors[k].dim());
        for (int64_t d : tensors[k].sizes()) part_sizes.push_back(d);
        part_grad.push_back(tensors[k].requires_grad());
        part_device = tensors[k].device().str();  // blocks compute on one device
      } else {
        partitioned.push_back(0);
        to_save.push_back(tensors[k]);
      }
    }
    if (!parts.empty()) {
      // The group the saved inputs are partitioned over (Note [Activation partitioning]).
      ctx->saved_data["group"] = detail::group_capsule(group);
      ctx->saved_data["parts"] = parts;
      ctx->saved_data["part_dims"] = part_dims;
      ctx->saved_data["part_sizes"] = part_sizes;
      ctx->saved_data["part_grad"] = part_grad;
      ctx->saved_data["part_device"] = part_device;
    }
    ctx->saved_data["partitioned"] = partitioned;
    ctx->saved_data["module"] = std::move(module_ref);
    ctx->saved_data["rng_state"] = get_rng_state(c10::Device(c10::kCPU));
    // A block computing on a CUDA device draws its dropout masks from that device's generator.
    for (const at::Tensor& t : tensors) {
      if (!t.is_cuda()) continue;
      ctx->saved_data["cuda_rng_device"] = static_cast<int64_t>(t.device().index());
      ctx->saved_data["cuda_rng_state"] = get_rng_state(t.device());
      break;
    }
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(at::kCPU);
    ctx->saved_data["autocast_dtype"] =
        static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCPU));
    ctx->saved_data["autocast_cuda"] = at::autocast::is_autocast_enabled(at::kCUDA);
    ctx->saved_data["autocast_cuda_dtype"] =
        static_cast<int64_t>(at::autocast::get_autocast_dtype(at::kCUDA));
    ctx->saved_data["slots"] = slots;
    ctx->saved_data["n"] = n;
    ctx->save_for_backward(to_save);
    return m->forward(inputs);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "[activation_checkpointing] double backward (create_graph=true) through a "
                "checkpointed block is not supported. HINT: remove the block from the "
                "checkpointing policy, or do not differentiate the gradients.");
    auto* m = static_cast<ModuleRef*>(ctx->saved_data["module"].toCapsule().get())->module;
    const at::Tensor rng_state = ctx->saved_data["rng_state"].toTensor();
    const std::vector<int64_t> slots = ctx->saved_data["slots"].toIntVector();
    const int64_t n = ctx->saved_data["n"].toInt();
    const auto saved = ctx->get_saved_variables();

    const std::vector<int64_t> partitioned = ctx->saved_data["partitioned"].toIntVector();
    std::vector<at::Tensor> parts;
    std::vector<int64_t> part_dims, part_sizes, part_grad;
    std::shared_ptr<ProcessGroup> group;
    c10::Device part_device(c10::kCPU);
    if (ctx->saved_data.count("parts")) {
      parts = ctx->saved_data["parts"].toTensorVector();
      part_dims = ctx->saved_data["part_dims"].toIntVector();
      part_sizes = ctx->saved_data["part_sizes"].toIntVector();
      part_grad = ctx->saved_data["part_grad"].toIntVector();
      part_device = c10::Device(ctx->saved_data["part_device"].toStringRef());
      group = detail::group_in_capsule(ctx->saved_data["group"]);
    }

    fsdp::nn::Inputs detached(static_cast<size_t>(n));
    std::vector<at::Tensor> leaves;  // per entry of `tensors` (undefined for the anchor)
    size_t next_saved = 0, next_part = 0, next_dim = 0, input = 0;
    for (int64_t slot : slots) {
      if (slot < 0) {
        leaves.emplace_back();
        continue;
      }
      at::Tensor d;
      if (partitioned.at(input++)) {
        // See Note [Activation partitioning]: the whole input from every rank's slice.
        const int64_t dims = part_dims.at(next_part);
        std::vector<int64_t> sizes(part_sizes.begin() + static_cast<int64_t>(next_dim),
                                   part_sizes.begin() + static_cast<int64_t>(next_dim) + dims);
        next_dim += static_cast<size_t>(dims);
        d = detail::gather_activation(parts.at(next_part), sizes, part_device, *group);
        if (part_grad.at(next_part)) d.requires_grad_(true);
        ++next_part;
      } else {
        const at::Tensor& original = saved.at(next_saved++);
        d = original.detach();
        if (original.requires_grad()) d.requires_grad_(true);
      }
      detached[static_cast<size_t>(slot)] = d;
      leaves.push_back(d);
    }
    at::Tensor output;
    {
      RngStateSwap rng(c10::Device(c10::kCPU), rng_state);
      std::optional<RngStateSwap> cuda_rng;
      if (ctx->saved_data.count("cuda_rng_state")) {
        cuda_rng.emplace(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(
                                                     ctx->saved_data["cuda_rng_device"].toInt())),
                         ctx->saved_data["cuda_rng_state"].toTensor());
      }
      AutocastSwap autocast(c10::DeviceType::CPU, ctx->saved_data["autocast"].toBool(),
                            static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt()));
      AutocastSwap autocast_cuda(
          c10::DeviceType::CUDA, ctx->saved_data["autocast_cuda"].toBool(),
          static_cast<at::ScalarType>(ctx->saved_data["autocast_cuda_dtype"].toInt()));
      RecomputeScope scope;
      at::AutoGradMode grad(true);
      output = m->forward(detached);
    }
    TORCH_INTERNAL_ASSERT(output.defined(), "[activation_checkpointing] the recomputed forward "
                          "returned an undefined tensor");
    if (output.requires_grad()) {
      torch::autograd::backward({output}, {grad_outputs.at(0)});
    }
    torch::autograd::variable_list grads;
    grads.reserve(leaves.size() + 3);
    for (auto& d : leaves) {
      grads.push_back(d.defined() && d.requires_grad() ? d.grad() : at::Tensor());
    }
    grads.resize(leaves.size() + 3);  // slots, n, module_ref
    return grads;
  }
};

// Marks a forward wrapper as ours: the module's wrapper owns the only shared_ptr to its marker,
// the registry holds a weak_ptr. Replacing the wrapper or destroying the module expires it, so a
// stale address never reads as checkpointed.
struct Marker {};
std::mutex registry_mutex;
std::unordered_map<const fsdp::nn::Module*, std::weak_ptr<Marker>>& registry() {
  static std::unordered_map<const fsdp::nn::Module*, std::weak_ptr<Marker>> r;
  return r;
}

at::Tensor checkpointed_forward(fsdp::nn::Module& module, const fsdp::nn::Inputs& inputs) {
  if (!at::GradMode::is_enabled()) return module.forward(inputs);  // eval: nothing to save
  bool any_requires_grad = false;
  for (const auto& x : inputs) any_requires_grad |= x.defined() && x.requires_grad();
  std::vector<at::Tensor> tensors;
  std::vector<int64_t> slots;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) continue;
    tensors.push_back(inputs[i]);
    slots.push_back(static_cast<int64_t>(i));
  }
  if (!any_requires_grad) {
    bool trainable = false;
    for (const auto& p : module.parameters()) trainable |= p.requires_grad();
    if (!trainable) return module.forward(inputs);  // nothing to differentiate
    // See Note [Checkpoint function]: the anchor.
    tensors.push_back(at::empty({0}, at::TensorOptions().dtype(at::kFloat)).requires_grad_(true));
    slots.push_back(-1);
  }
  auto ref = c10::make_intrusive<ModuleRef>();
  ref->module = &module;
  try {
    ref->owned = std::dynamic_pointer_cast<fsdp::nn::Module>(module.shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    // Not owned by a shared_ptr (a member or a stack object): the caller keeps it alive.
  }
  return CheckpointFunction::apply(at::TensorList(tensors), slots,
                                   static_cast<int64_t>(inputs.size()),
                                   c10::IValue::make_capsule(std::move(ref)));
}

}  // namespace

bool in_activation_recompute() { return recompute_depth > 0; }

bool is_activation_checkpointed(const fsdp::nn::Module& module) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(&module);
  return it != registry().end() && !it->second.expired();
}

void checkpoint_module(fsdp::nn::Module& module) {
  if (is_activation_checkpointed(module)) return;
  TORCH_CHECK(!module.has_forward_wrapper(), "[activation_checkpointing] module '",
              module.name(), "' already has a forward wrapper that is not activation "
              "checkpointing; a module has at most one (fsdp::nn::Module::set_forward_wrapper). "
              "HINT: leave this module out of the checkpointing policy.");
  auto marker = std::make_shared<Marker>();
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto& r = registry();
    for (auto it = r.begin(); it != r.end();) it = it->second.expired() ? r.erase(it) : ++it;
    r[&module] = marker;
  }
  module.set_forward_wrapper(
      [marker](fsdp::nn::Module& m, const fsdp::nn::Inputs& inputs) {
        return checkpointed_forward(m, inputs);
      });
}

int apply_activation_checkpointing(torch::nn::Module& root, const CheckpointPredicate& predicate) {
  TORCH_CHECK(predicate, "[activation_checkpointing] empty predicate");
  std::vector<fsdp::nn::Module*> targets;
  auto consider = [&](torch::nn::Module& m) {
    auto* hooked = dynamic_cast<fsdp::nn::Module*>(&m);
    if (hooked && predicate(*hooked)) targets.push_back(hooked);
  };
  consider(root);
  // modules(include_self=false): root itself may not be owned by a shared_ptr.
  for (auto& m : root.modules(/*include_self=*/false)) consider(*m);
  int wrapped = 0;
  for (auto* m : targets) {
    if (is_activation_checkpointed(*m)) continue;
    checkpoint_module(*m);
    ++wrapped;
  }
  return wrapped;
}

int apply_activation_checkpointing(torch::nn::Module& root, const fsdp::nn::ModuleTypes& policy) {
  return apply_activation_checkpointing(
      root, [&policy](const fsdp::nn::Module& m) { return fsdp::nn::is_instance_of(m, policy); });
}

int count_activation_checkpointed(torch::nn::Module& root) {
  int n = 0;
  if (auto* hooked = dynamic_cast<fsdp::nn::Module*>(&root)) n += is_activation_checkpointed(*hooked);
  for (auto& m : root.modules(/*include_self=*/false)) {
    if (auto* hooked = dynamic_cast<fsdp::nn::Module*>(m.get())) {
      n += is_activation_checkpointed(*hooked);
    }
  }
  return n;
}

}  // namespace fsdp
