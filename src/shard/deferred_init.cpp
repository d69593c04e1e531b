// Deferred initialization and shape-only planning. See include/fsdp/init.h.
#include "shard/deferred_init.h"

#include "fsdp/init.h"
#include "fsdp/strategy.h"
#include "shard/fsdp_state.h"
#include "shard/wrap_policy.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <functional>
#include <set>
#include <unordered_map>

namespace fsdp {
namespace detail {

// Note [Deferred initialization]
// ------------------------------
// Eager setup builds the whole model on every rank, then shards it: the setup peak is the full
// model (3.8 GiB per rank for transformer-1b). Deferred init shards each unit as soon as it is
// built, inside configure_model, so a rank holds at most its shards so far plus one full unit:
//
//   enter_configure_model  FSDPStrategy creates the FsdpState that will own the model and
//                          installs a DeferredInit as this thread's fsdp::nn::InitObserver.
//   fsdp::nn::built(m)     the model says "m is complete" (the demo models do it for every
//                          layer right after constructing it). The wrap policy picks units
//                          inside m now (types: every module of a policy type, innermost
//                          first; size/predicate: the same children-first count select_units
//                          does, which inside m depends only on m's subtree). Each becomes a
//                          unit at once: FsdpParamGroup::init() creates each parameter's shard S
//                          from its values, frees P's storage and swaps S into the module, one
//                          parameter at a time, before the next layer is constructed.
//   fsdp::wrap(m)          the same for a manually wrapped module.
//   setup_module           the usual unit selection runs over the whole model (size and
//                          predicate policies through policy_with_deferred_units, so they do
//                          not count shards); a selected
//                          module that is already a deferred unit is adopted as it is (its
//                          FQN is filled in now), everything else is built and sharded as
//                          before (the root unit: embeddings, final norms, heads).
//
// Values: each layer is constructed and initialized exactly as in eager construction, from the
// same global generator in the same order, and sharding copies rows without arithmetic, so
// the gathered parameters are bitwise those of a single-process model built from the same seed,
// at any world size.
//
// Falls back to eager build-then-shard (nothing is sharded during configure_model) for:
// NO_SHARD and the HYBRID strategies (their groups are made in setup_module), a world of one
// rank, sync_module_states (rank 0's full values are broadcast first), and models that call
// neither fsdp::nn::built nor fsdp::wrap. If the selection at setup does not keep a deferred
// unit (e.g. the model called fsdp::wrap after the policy had sharded its layers, or the
// mixed-precision policy changed after configure_model, or a parameter of it was frozen or
// unfrozen afterwards through module.parameters()), that unit is all-gathered back into full
// parameters first, so the result is always the eager one (at the cost of one gather).
//
// Contract for models: after built(m), m's parameters as seen through m.parameters() are
// shards; set requires_grad and values before calling built(), and do not re-initialize a
// built layer from its parent (the GPT-2 `apply(init_weights)` idiom must run inside each
// layer's constructor instead).

DeferredInit::DeferredInit(const FSDPStrategy* strategy, FsdpState* state, AutoWrapPolicy policy)
    : strategy_(strategy), state_(state), policy_(std::move(policy)) {}

bool DeferredInit::active() const {
  return static_cast<const Strategy*>(strategy_) == fsdp::active_strategy();
}

void DeferredInit::on_built(torch::nn::Module& module) {
  if (!active()) return;
  if (policy_.kind == AutoWrapPolicy::Kind::kSize ||
      policy_.kind == AutoWrapPolicy::Kind::kPredicate) {
    // As select_units, inside the built subtree (every decision there depends only on the
    // subtree): children first, a module's count is the elements no descendant unit took;
    // units sharded earlier count as taken.
    std::set<const c10::TensorImpl*> counted;
    std::set<const torch::nn::Module*> done;
    std::vector<fsdp::nn::Module*> chosen;  // post-order
    std::function<int64_t(torch::nn::Module&)> count = [&](torch::nn::Module& m) -> int64_t {
      if (!done.insert(&m).second || state_->is_deferred_unit(&m)) return 0;
      int64_t n = 0;
      for (auto& child : m.children()) n += count(*child);
      for (auto& p : m.named_parameters(/*recurse=*/false)) {
        if (counted.insert(p.value().unsafeGetTensorImpl()).second) n += p.value().numel();
      }
      auto* hooked = dynamic_cast<fsdp::nn::Module*>(&m);
      if (hooked == nullptr) return n;
      const bool wrap = policy_.kind == AutoWrapPolicy::Kind::kSize
                            ? n >= policy_.min_num_params
                            : policy_.predicate(m, n);
      if (!wrap) return n;
      chosen.push_back(hooked);
      return 0;
    };
    count(module);
    for (auto* unit : chosen) state_->shard_deferred_unit(*unit);
    return;
  }
  if (policy_.kind != AutoWrapPolicy::Kind::kTypes) return;
  // Children first: a nested unit takes its parameters before the unit around it.
  std::set<const torch::nn::Module*> seen;
  std::function<void(torch::nn::Module&)> visit = [&](torch::nn::Module& m) {
    if (!seen.insert(&m).second) return;
    for (auto& child : m.children()) visit(*child);
    if (!fsdp::nn::is_instance_of(m, policy_.types)) return;
    if (auto* hooked = dynamic_cast<fsdp::nn::Module*>(&m)) state_->shard_deferred_unit(*hooked);
  };
  visit(module);
}

void DeferredInit::on_wrap(fsdp::nn::Module& module) {
  if (active()) state_->shard_deferred_unit(module);
}

// --- FsdpState: deferred units ------------------------------------------------------------------

void FsdpState::shard_deferred_unit(fsdp::nn::Module& module) {
  TORCH_INTERNAL_ASSERT(units_.empty(), "deferred unit after FsdpState::build");
  if (is_deferred_unit(&module)) return;
  auto unit = new_unit("<deferred>", &module, config_.reshard_after_forward);
  // Parameters of the subtree no earlier deferred unit took; FQNs relative to `module` until
  // build() knows where it lives. Tied parameters inside the subtree register once.
  std::unordered_map<const c10::TensorImpl*, FsdpParam*> seen;
  std::set<const torch::nn::Module*> visited;
  std::function<void(torch::nn::Module&, const std::string&)> visit =
      [&](torch::nn::Module& m, const std::string& prefix) {
        if (!visited.insert(&m).second) return;
        for (auto& item : registered_parameters(m)) {
          const at::Tensor& tensor = item.value();
          if (!tensor.defined()) continue;
          if (!deferred_taken_.insert({&m, item.key()}).second) continue;  // a nested unit's
          FsdpParam::Registration reg{&m, item.key(), prefix + item.key()};
          auto found = seen.find(tensor.unsafeGetTensorImpl());
          if (found != seen.end()) {
            found->second->add_registration(std::move(reg));
            continue;
          }
          seen[tensor.unsafeGetTensorImpl()] = &unit->add_param(tensor, std::move(reg));
        }
        for (auto& child : m.named_children()) {
          visit(*child.value(), prefix + child.key() + ".");
        }
      };
  visit(module, "");
  unit->init();  // shards every parameter: S created, P's storage freed, S registered
  try {
    deferred_keep_alive_.push_back(module.shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    // Not owned by a shared_ptr (e.g. a member object): its owner keeps it alive.
  }
  preinitialized_.insert(unit.get());
  deferred_.push_back(std::move(unit));
}

bool FsdpState::is_deferred_unit(const torch::nn::Module* module) const {
  for (const auto& unit : deferred_) {
    if (unit->module() == module) return true;
  }
  return false;
}

std::unique_ptr<FsdpParamGroup> FsdpState::take_deferred_unit(const torch::nn::Module* module,
                                                              const std::string& fqn) {
  for (auto it = deferred_.begin(); it != deferred_.end(); ++it) {
    if ((*it)->module() != module) continue;
    std::unique_ptr<FsdpParamGroup> unit = std::move(*it);
    deferred_.erase(it);
    unit->set_name(fqn);
    for (auto& p : unit->params()) p->prefix_fqns(fqn + ".");
    return unit;
  }
  return nullptr;
}

void FsdpState::restore_unselected_deferred(const std::vector<UnitSpec>& specs) {
  std::set<const torch::nn::Module*> selected;
  for (const auto& spec : specs) selected.insert(spec.module);
  at::NoGradGuard no_grad;
  const int w = shard_group_->size();
  for (auto it = deferred_.begin(); it != deferred_.end();) {
    FsdpParamGroup& unit = **it;
    // A parameter frozen (or unfrozen) after its unit was sharded changed only the shard's
    // flag: the unit is rebuilt eagerly with the new flag rather than trained with the old one.
    bool requires_grad_changed = false;
    for (auto& p : unit.params()) {
      requires_grad_changed |= p->sharded().requires_grad() != p->requires_grad();
    }
    if (selected.count(unit.module()) && !requires_grad_changed) {
      ++it;
      continue;
    }
    // Every rank restores the same units in the same (construction) order.
    for (auto& p : unit.params()) {
      const at::Tensor& s = p->sharded();
      if (!p->aliased()) {
        at::Tensor flat = at::empty({w * p->shard_numel()}, s.options().requires_grad(false));
        shard_group_->all_gather_into_tensor(flat, s.detach().reshape({-1}).contiguous());
        at::Tensor full = flat.view({w * p->shard_rows(), p->row_numel()})
                              .narrow(0, 0, p->dim0())
                              .reshape(p->full_shape())
                              .clone();
        // Same TensorImpl (the layer's member), full values, the sharded dtype.
        p->unsharded().set_data(full);
        p->unsharded().set_requires_grad(s.requires_grad());
      }
      for (const auto& reg : p->registrations()) {
        registered_parameters(*reg.module)[reg.name] = p->unsharded();
        deferred_taken_.erase({reg.module, reg.name});
      }
    }
    preinitialized_.erase(&unit);
    it = deferred_.erase(it);
  }
}

AutoWrapPolicy policy_with_deferred_units(const FsdpState& state, const AutoWrapPolicy& policy) {
  if (state.num_deferred_units() == 0 || (policy.kind != AutoWrapPolicy::Kind::kSize &&
                                          policy.kind != AutoWrapPolicy::Kind::kPredicate)) {
    return policy;
  }
  std::set<const torch::nn::Module*> units, inside;
  for (const auto& unit : state.deferred_units()) {
    units.insert(unit->module());
    std::function<void(const torch::nn::Module&)> mark = [&](const torch::nn::Module& m) {
      for (const auto& child : m.children()) {
        if (inside.insert(child.get()).second) mark(*child);
      }
    };
    mark(*unit->module());
  }
  return AutoWrapPolicy::of_predicate(
      [units, inside, policy](const torch::nn::Module& m, int64_t n) {
        if (units.count(&m)) return true;
        if (inside.count(&m)) return false;
        return policy.kind == AutoWrapPolicy::Kind::kSize ? n >= policy.min_num_params
                                                          : policy.predicate(m, n);
      });
}

bool same_sharding_config(const FsdpConfig& a, const FsdpConfig& b) {
  auto mp = [](const FsdpConfig& c) {
    return c.mixed_precision ? c.mixed_precision->to_string() : std::string("none");
  };
  return a.reshard_after_forward == b.reshard_after_forward && mp(a) == mp(b);
}

namespace {

// A group that has a size and no peers: for planning units and their shard sizes
// (estimate_fsdp_memory) without a launcher. Any collective is a bug.
class ShapeOnlyGroup : public ProcessGroup {
 public:
  explicit ShapeOnlyGroup(int size) : size_(size) {
    for (int r = 0; r < size; ++r) ranks_.push_back(r);
  }
  int rank() const override { return 0; }
  int size() const override { return size_; }
  std::string backend() const override { return "shape-only"; }
  const std::vector<int>& world_ranks() const override { return ranks_; }
  WorkPtr all_gather_into_tensor_async(at::Tensor, at::Tensor) override { return fail(); }
  WorkPtr reduce_scatter_tensor_async(at::Tensor, at::Tensor, ReduceOp) override { return fail(); }
  WorkPtr all_reduce_async(at::Tensor, ReduceOp) override { return fail(); }
  WorkPtr broadcast_async(at::Tensor, int) override { return fail(); }
  WorkPtr all_to_all_async(at::Tensor, at::Tensor) override { return fail(); }
  WorkPtr barrier_async() override { return fail(); }
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>&) override {
    fail();
    return nullptr;
  }

 private:
  static WorkPtr fail() {
    TORCH_CHECK(false, "[FSDPStrategy] a planned model (plan_module / estimate_fsdp_memory) "
                "cannot communicate; set up a real model with setup_module to train");
  }
  int size_;
  std::vector<int> ranks_;
};

}  // namespace
}  // namespace detail

// --- FSDPStrategy: deferred init and planning -----------------------------------------------------

bool FSDPStrategy::deferred_init_applies() const {
  const ShardingStrategy ss = options_.sharding_strategy;
  // FSDP_DEFERRED_INIT=0 turns it off without recompiling (e.g. to compare setup peaks).
  const char* env = std::getenv("FSDP_DEFERRED_INIT");
  const bool env_off = env != nullptr && std::string(env) == "0";
  return options_.deferred_init && !env_off && world_ && world_->size() > 1 &&
         !options_.sync_module_states && !state_ &&
         (ss == ShardingStrategy::kFullShard || ss == ShardingStrategy::kShardGradOp);
}

void FSDPStrategy::begin_deferred_init() {
  end_deferred_init();
  if (deferred_state_) deferred_state_->restore_all_deferred();  // configure_model ran again
  deferred_state_.reset();
  num_deferred_units_ = 0;
  if (!deferred_init_applies()) return;
  // Same groups as setup_module makes for these strategies: the world is the shard group.
  deferred_state_ = std::make_unique<detail::FsdpState>(detail::make_fsdp_config(options_),
                                                        world_, nullptr);
  deferred_ = std::make_unique<detail::DeferredInit>(this, deferred_state_.get(),
                                                     options_.auto_wrap_policy);
  fsdp::nn::set_init_observer(deferred_.get());
}

void FSDPStrategy::end_deferred_init() {
  if (deferred_ && fsdp::nn::init_observer() == deferred_.get()) {
    fsdp::nn::set_init_observer(nullptr);
  }
  deferred_.reset();
}

void FSDPStrategy::plan_module(torch::nn::Module& module, int world_size, int local_world_size) {
  TORCH_CHECK(!state_, "[FSDPStrategy] plan_module: this strategy already holds a model");
  TORCH_CHECK(world_size >= 1, "[FSDPStrategy] plan_module: world_size must be >= 1, got ",
              world_size);
  const ShardingStrategy ss = options_.sharding_strategy;
  int shard_size = world_size;
  if (ss == ShardingStrategy::kNoShard) {
    shard_size = 1;
  } else if (ss == ShardingStrategy::kHybridShard || ss == ShardingStrategy::kHybridShardZero2) {
    shard_size = options_.hybrid_shard_size > 0 ? options_.hybrid_shard_size : local_world_size;
    if (shard_size <= 0 || shard_size > world_size) shard_size = world_size;
    TORCH_CHECK(world_size % shard_size == 0, "[FSDPStrategy] ", to_string(ss),
                ": the shard group size ", shard_size, " must divide the world size ",
                world_size, ". HINT: set hybrid_shard_size (e.g. ranks per node).");
  }
  ProcessGroupPtr shard_group = std::make_shared<detail::ShapeOnlyGroup>(shard_size);
  ProcessGroupPtr replicate_group;
  if (world_size / shard_size > 1) {
    replicate_group = std::make_shared<detail::ShapeOnlyGroup>(world_size / shard_size);
  }
  auto units = detail::select_units(module, options_.auto_wrap_policy, manual_units_);
  auto state = std::make_unique<detail::FsdpState>(detail::make_fsdp_config(options_),
                                                   shard_group, replicate_group);
  state->build(module, units);
  state_ = std::move(state);
}

std::pair<int64_t, int64_t> FSDPStrategy::parameter_counts() {
  int64_t all = 0, trainable = 0;
  for (auto* p : state().all_params()) {
    const int64_t n = p->unsharded().numel();  // P keeps its full sizes
    all += n;
    if (p->requires_grad()) trainable += n;
  }
  return {all, trainable};
}

FSDPMemoryEstimate estimate_fsdp_memory(torch::nn::Module& model, const FSDPOptions& options,
                                        int world_size, int local_world_size) {
  FSDPStrategy strategy(options);
  strategy.plan_module(model, world_size, local_world_size > 0 ? local_world_size : world_size);
  return strategy.memory_estimate();
}

}  // namespace fsdp
