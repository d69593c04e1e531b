// fsdp::optim::CPUAdam (include/fsdp/cpu_adam.h): checks, state, the step's scalars and the
// threading; the element loop is src/optim/kernels/cpu_adam_kernel.cpp. See Note [CPU Adam] in
// docs/design.md.
#include "fsdp/cpu_adam.h"

#include "optim/cpu_adam_kernel.h"
#include "optim/cpu_adam_spans.h"

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/optim/serialize.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp::optim {
namespace {

namespace kernel = fsdp::detail::cpu_adam;
using StateMap = ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>>;

// One group's hyper-parameters, whichever of AdamOptions / AdamWOptions holds them.
struct GroupOptions {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
};

const char* options_name(bool adamw_mode) {
  return adamw_mode ? "torch::optim::AdamWOptions" : "torch::optim::AdamOptions";
}

GroupOptions group_options(torch::optim::OptimizerOptions& options, bool adamw_mode) {
  if (adamw_mode) {
    if (auto* o = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      return {o->lr(), std::get<0>(o->betas()), std::get<1>(o->betas()), o->eps(),
              o->weight_decay(), o->amsgrad()};
    }
  } else if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
    return {o->lr(), std::get<0>(o->betas()), std::get<1>(o->betas()), o->eps(),
            o->weight_decay(), o->amsgrad()};
  }
  TORCH_CHECK(false, "[CPUAdam] a parameter group has options of another optimizer; with "
              "adamw_mode = ", adamw_mode ? "true" : "false", " give each group ",
              options_name(adamw_mode), " (or none: it takes the CPUAdamOptions)");
}

void check_options(const GroupOptions& o) {
  TORCH_CHECK(o.lr >= 0, "[CPUAdam] invalid learning rate ", o.lr, " (must be >= 0)");
  TORCH_CHECK(o.eps >= 0, "[CPUAdam] invalid eps ", o.eps, " (must be >= 0)");
  TORCH_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1,
              "[CPUAdam] invalid betas (", o.beta1, ", ", o.beta2, "): each must be in [0, 1)");
  TORCH_CHECK(o.weight_decay >= 0, "[CPUAdam] invalid weight_decay ", o.weight_decay,
              " (must be >= 0)");
}

// libtorch's add_param_group keeps a group's options only when their type is the defaults'
// type (it silently takes the defaults otherwise): refuse the other type before that.
std::vector<torch::optim::OptimizerParamGroup> checked_groups(
    std::vector<torch::optim::OptimizerParamGroup> groups, bool adamw_mode) {
  for (auto& group : groups) {
    if (group.has_options()) check_options(group_options(group.options(), adamw_mode));
  }
  return groups;
}

std::unique_ptr<torch::optim::OptimizerOptions> make_defaults(const CPUAdamOptions& o) {
  check_options({o.lr, std::get<0>(o.betas), std::get<1>(o.betas), o.eps, o.weight_decay,
                 o.amsgrad});
  if (o.adamw_mode) {
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(o.lr)
                                                            .betas(o.betas)
                                                            .eps(o.eps)
                                                            .weight_decay(o.weight_decay)
                                                            .amsgrad(o.amsgrad));
  }
  return std::make_unique<torch::optim::AdamOptions>(torch::optim::AdamOptions(o.lr)
                                                         .betas(o.betas)
                                                         .eps(o.eps)
                                                         .weight_decay(o.weight_decay)
                                                         .amsgrad(o.amsgrad));
}

// Float32 and contiguous, with p's number of elements: the kernel's view of a moment. State
// from elsewhere (torch::load of a 16-bit Adam's state, a checkpoint) is converted once.
at::Tensor as_kernel_state(const at::Tensor& t, const at::Tensor& p, const char* name) {
  TORCH_CHECK(t.defined() && t.numel() == p.numel(), "[CPUAdam] the optimizer state '", name,
              "' of a parameter of shape ", p.sizes(), " has ",
              t.defined() ? std::to_string(t.numel()) : std::string("no"),
              " elements; was it loaded from another model?");
  if (t.scalar_type() == at::kFloat && t.is_contiguous() && t.device().is_cpu()) return t;
  return t.to(at::kCPU, at::kFloat, /*non_blocking=*/false, /*copy=*/false,
              at::MemoryFormat::Contiguous)
      .contiguous();
}

// The parameter's state (created on first use as libtorch's Adam/AdamW would), its moments
// made kernel-ready, and its step counted.
template <typename State>
State& step_state(StateMap& states, const at::Tensor& p,
                  bool amsgrad) {
  auto it = states.find(p.unsafeGetTensorImpl());
  if (it == states.end()) {
    auto s = std::make_unique<State>();
    s->step(0);
    auto zeros = [&] { return at::zeros(p.sizes(), p.options().dtype(at::kFloat)); };
    s->exp_avg(zeros());
    s->exp_avg_sq(zeros());
    if (amsgrad) s->max_exp_avg_sq(zeros());
    it = states.emplace(p.unsafeGetTensorImpl(), std::move(s)).first;
  }
  auto* s = dynamic_cast<State*>(it->second.get());
  TORCH_CHECK(s, "[CPUAdam] a parameter's optimizer state is not ",
              std::is_same_v<State, torch::optim::AdamWParamState> ? "AdamWParamState"
                                                                    : "AdamParamState",
              "; it was loaded from another optimizer type (load an Adam state with "
              "adamw_mode = false, an AdamW state with adamw_mode = true)");
  s->exp_avg(as_kernel_state(s->exp_avg(), p, "exp_avg"));
  s->exp_avg_sq(as_kernel_state(s->exp_avg_sq(), p, "exp_avg_sq"));
  if (amsgrad) {
    s->max_exp_avg_sq(s->max_exp_avg_sq().defined()
                          ? as_kernel_state(s->max_exp_avg_sq(), p, "max_exp_avg_sq")
                          : at::zeros(p.sizes(), p.options().dtype(at::kFloat)));
  }
  s->step(s->step() + 1);
  return *s;
}

// ATen's own choice of instruction set ("AVX512", "AVX2", "DEFAULT", ...; it honours
// ATEN_CPU_CAPABILITY), read once.
const std::string& aten_capability() {
  static const std::string capability = at::get_cpu_capability();
  return capability;
}

kernel::RangeFn range_fn() {
#if defined(FSDP_CPU_ADAM_X86)
  if (aten_capability() == "AVX512") return kernel::AVX512::adam_range;
  if (aten_capability() == "AVX2") return kernel::AVX2::adam_range;
#endif
  return kernel::DEFAULT::adam_range;
}

}  // namespace
}  // namespace fsdp::optim

namespace fsdp::detail::cpu_adam {

Scalars make_scalars(const Hyper& o, int64_t step) {
  Scalars s;
  const double bc1 = o.bias_correction ? 1 - std::pow(o.beta1, step) : 1.0;
  const double bc2 = o.bias_correction ? 1 - std::pow(o.beta2, step) : 1.0;
  s.beta1 = static_cast<float>(o.beta1);
  s.one_minus_beta1 = static_cast<float>(1 - o.beta1);
  s.beta2 = static_cast<float>(o.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - o.beta2);
  s.bias_correction2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.neg_step_size = static_cast<float>(-(o.lr / bc1));
  s.eps = static_cast<float>(o.eps);
  if (o.weight_decay != 0) {
    if (o.adamw_mode) {
      s.decay = static_cast<float>(1 - o.lr * o.weight_decay);
    } else {
      s.l2 = static_cast<float>(o.weight_decay);
    }
  }
  s.amsgrad = o.amsgrad;
  return s;
}

// Work below this many elements stays on the calling thread.
constexpr int64_t kGrainSize = 32768;

// Every span's elements as one range [0, total) split over at::get_num_threads() threads: one
// parallel region per step, however many (small) parameters there are.
void run_spans(const std::vector<Span>& spans) {
  if (spans.empty()) return;
  std::vector<int64_t> starts(spans.size() + 1, 0);
  for (size_t i = 0; i < spans.size(); ++i) starts[i + 1] = starts[i] + spans[i].numel;
  const RangeFn fn = fsdp::optim::range_fn();
  at::parallel_for(0, starts.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (; i < spans.size() && starts[i] < end; ++i) {
      const int64_t lo = std::max(begin, starts[i]) - starts[i];
      const int64_t hi = std::min(end, starts[i + 1]) - starts[i];
      if (lo < hi) fn(spans[i], lo, hi);
    }
  });
}

}  // namespace fsdp::detail::cpu_adam

namespace fsdp::optim {

CPUAdam::CPUAdam(std::vector<at::Tensor> params, CPUAdamOptions options)
    : CPUAdam(std::vector<torch::optim::OptimizerParamGroup>{
                  torch::optim::OptimizerParamGroup(std::move(params))},
              options) {}

CPUAdam::CPUAdam(std::vector<torch::optim::OptimizerParamGroup> param_groups,
                 CPUAdamOptions options)
    : torch::optim::Optimizer(checked_groups(std::move(param_groups), options.adamw_mode),
                              make_defaults(options)),
      adamw_mode_(options.adamw_mode),
      bias_correction_(options.bias_correction) {
  for (auto& group : param_groups_) check_options(group_options(group.options(), adamw_mode_));
}

const char* CPUAdam::isa() {
  const kernel::RangeFn fn = range_fn();
#if defined(FSDP_CPU_ADAM_X86)
  if (fn == kernel::AVX512::adam_range) return "avx512";
  if (fn == kernel::AVX2::adam_range) return "avx2";
#endif
  return fn == kernel::DEFAULT::adam_range ? "default" : "unknown";
}

at::Tensor CPUAdam::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  std::vector<kernel::Span> spans;
  // Tensors the kernels read or write besides the registered ones (a contiguous copy of a
  // strided parameter or gradient), and where strided parameters go back after the pass.
  std::vector<at::Tensor> keep;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;  // (registered, contiguous copy)
  for (auto& group : param_groups_) {
    const GroupOptions o = group_options(group.options(), adamw_mode_);
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const at::Tensor& grad = p.grad();
      TORCH_CHECK(p.device().is_cpu() && grad.device().is_cpu(), "[CPUAdam] a parameter of "
                  "shape ", p.sizes(), " is on ", p.device(), "; CPUAdam steps parameters in "
                  "host memory only (use torch::optim::Adam/AdamW for device parameters)");
      TORCH_CHECK(!grad.is_sparse() && p.layout() == at::kStrided, "[CPUAdam] sparse "
                  "parameters or gradients are not supported (shape ", p.sizes(), ")");
      const auto dtype = p.scalar_type();
      TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                  "[CPUAdam] a parameter of shape ", p.sizes(), " is ", dtype, "; CPUAdam "
                  "supports Float, BFloat16 and Half parameters (use torch::optim::Adam/AdamW "
                  "for others)");
      TORCH_CHECK(grad.scalar_type() == dtype && grad.numel() == p.numel(), "[CPUAdam] the "
                  "gradient of a ", dtype, " parameter of shape ", p.sizes(), " is ",
                  grad.scalar_type(), " of shape ", grad.sizes(), "; it must match the parameter");

      torch::optim::AdamWParamState* sw = nullptr;
      torch::optim::AdamParamState* sa = nullptr;
      if (adamw_mode_) {
        sw = &step_state<torch::optim::AdamWParamState>(state_, p, o.amsgrad);
      } else {
        sa = &step_state<torch::optim::AdamParamState>(state_, p, o.amsgrad);
      }
      const int64_t step = sw ? sw->step() : sa->step();
      if (p.numel() == 0) continue;

      // The scalars exactly as libtorch computes them (double, then float in the kernels).
      kernel::Span span;
      span.s = kernel::make_scalars({o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad,
                                     adamw_mode_, bias_correction_},
                                    step);

      at::Tensor pc = p.is_contiguous() ? p : p.contiguous();
      if (!pc.is_same(p)) write_back.emplace_back(p, pc);
      at::Tensor gc = grad.is_contiguous() ? grad : grad.contiguous();
      keep.push_back(gc);
      span.param = pc.data_ptr();
      span.grad = gc.const_data_ptr();
      span.exp_avg = (sw ? sw->exp_avg() : sa->exp_avg()).data_ptr<float>();
      span.exp_avg_sq = (sw ? sw->exp_avg_sq() : sa->exp_avg_sq()).data_ptr<float>();
      if (o.amsgrad) {
        span.max_exp_avg_sq =
            (sw ? sw->max_exp_avg_sq() : sa->max_exp_avg_sq()).data_ptr<float>();
      }
      span.numel = p.numel();
      span.dtype = dtype;
      spans.push_back(span);
    }
  }
  kernel::run_spans(spans);
  for (auto& [registered, copy] : write_back) registered.copy_(copy);
  return loss;
}

void CPUAdam::save(torch::serialize::OutputArchive& archive) const {
  if (adamw_mode_) {
    torch::optim::serialize<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive,
                                                                                       *this);
  } else {
    torch::optim::serialize<torch::optim::AdamParamState, torch::optim::AdamOptions>(archive,
                                                                                     *this);
  }
}

void CPUAdam::load(torch::serialize::InputArchive& archive) {
  if (adamw_mode_) {
    torch::optim::serialize<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive,
                                                                                       *this);
  } else {
    torch::optim::serialize<torch::optim::AdamParamState, torch::optim::AdamOptions>(archive,
                                                                                     *this);
  }
}

}  // namespace fsdp::optim
