// fsdp::optim::CPUAdam equals libtorch's Adam / AdamW: fp32 (within 1e-6 relative over 30
// steps), 16-bit parameters (against libtorch's optimizer stepping an fp32 copy that is rounded
// back every step), every mode, odd sizes, an empty parameter and one without a gradient; the
// result does not depend on the thread count; torch::save archives load across the two; errors.
#include "fsdp/cpu_adam.h"

#include <gtest/gtest.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using fsdp::optim::CPUAdam;
using fsdp::optim::CPUAdamOptions;

// Odd sizes (not multiples of 8/16/32 lanes); the last one (40200 elements) is large enough
// that 2 threads split the step inside it, off the vector grid.
const std::vector<std::vector<int64_t>> kShapes = {{1}, {7}, {3, 11}, {1003}, {200, 201}};
constexpr double kLr = 1e-2;
constexpr int kSteps = 30;

struct Params {
  std::vector<at::Tensor> trained;  // get gradients (the shapes above)
  at::Tensor empty;                 // zero elements, with an (empty) gradient
  at::Tensor no_grad;               // never has a gradient
  std::vector<at::Tensor> all() const {
    auto v = trained;
    v.push_back(empty);
    v.push_back(no_grad);
    return v;
  }
};

Params make_params(at::ScalarType dtype) {
  at::manual_seed(11);
  Params p;
  for (const auto& s : kShapes) p.trained.push_back(at::randn(s).to(dtype).requires_grad_());
  p.empty = at::empty({0}, at::TensorOptions().dtype(dtype)).requires_grad_();
  p.no_grad = at::randn({5}).to(dtype).requires_grad_();
  return p;
}

Params clone(const Params& p) {
  Params c;
  for (const auto& t : p.trained) c.trained.push_back(t.detach().clone().requires_grad_());
  c.empty = p.empty.detach().clone().requires_grad_();
  c.no_grad = p.no_grad.detach().clone().requires_grad_();
  return c;
}

// The gradients of step `step` (the same for every optimizer), in `dtype`.
std::vector<at::Tensor> grads_of(int step, at::ScalarType dtype) {
  at::manual_seed(1000 + step);
  std::vector<at::Tensor> g;
  for (size_t i = 0; i < kShapes.size(); ++i) {
    g.push_back((at::randn(kShapes[i]) * (0.1 + 0.5 * static_cast<double>(i))).to(dtype));
  }
  return g;
}

void set_grads(Params& p, const std::vector<at::Tensor>& g) {
  for (size_t i = 0; i < g.size(); ++i) p.trained[i].mutable_grad() = g[i].clone();
  p.empty.mutable_grad() = at::empty({0}, p.empty.options());
}

// max |a - b| / max |b| (the max-norm relative error; exact zeros compare absolutely).
double rel_err(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor a64 = a.to(at::kDouble), b64 = b.to(at::kDouble);
  const double diff = (a64 - b64).abs().max().item<double>();
  const double scale = b64.abs().max().item<double>();
  return scale == 0 ? diff : diff / scale;
}

struct Mode {
  bool adamw;
  double weight_decay;
  bool amsgrad;
  std::string name() const {
    return std::string(adamw ? "adamw" : "adam") + (weight_decay != 0 ? "_wd" : "") +
           (amsgrad ? "_amsgrad" : "");
  }
};

std::vector<Mode> all_modes() {
  std::vector<Mode> m;
  for (bool adamw : {false, true}) {
    for (double wd : {0.0, 0.05}) {
      for (bool ams : {false, true}) m.push_back({adamw, wd, ams});
    }
  }
  return m;
}

std::unique_ptr<torch::optim::Optimizer> torch_optimizer(const Mode& m,
                                                          std::vector<at::Tensor> params) {
  if (m.adamw) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(kLr).weight_decay(m.weight_decay).amsgrad(m.amsgrad));
  }
  return std::make_unique<torch::optim::Adam>(
      params, torch::optim::AdamOptions(kLr).weight_decay(m.weight_decay).amsgrad(m.amsgrad));
}

std::unique_ptr<CPUAdam> cpu_optimizer(const Mode& m, std::vector<at::Tensor> params) {
  CPUAdamOptions o;
  o.lr = kLr;
  o.weight_decay = m.weight_decay;
  o.amsgrad = m.amsgrad;
  o.adamw_mode = m.adamw;
  return std::make_unique<CPUAdam>(params, o);
}

// (exp_avg, exp_avg_sq, max_exp_avg_sq or undefined, step) of p in either optimizer.
struct Moments {
  at::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;
  int64_t step = 0;
};
std::optional<Moments> moments(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(p.unsafeGetTensorImpl());
  if (it == opt.state().end()) return std::nullopt;
  if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
    return Moments{s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq(), s->step()};
  }
  auto* s = dynamic_cast<torch::optim::AdamParamState*>(it->second.get());
  if (!s) return std::nullopt;
  return Moments{s->exp_avg(), s->exp_avg_sq(), s->max_exp_avg_sq(), s->step()};
}

void expect_states_close(torch::optim::Optimizer& got, const Params& pg,
                         torch::optim::Optimizer& want, const Params& pw, double tol) {
  for (size_t i = 0; i < pg.trained.size(); ++i) {
    auto g = moments(got, pg.trained[i]);
    auto w = moments(want, pw.trained[i]);
    ASSERT_TRUE(g && w) << "param " << i;
    EXPECT_EQ(g->step, w->step);
    EXPECT_EQ(g->exp_avg.scalar_type(), at::kFloat);
    EXPECT_LE(rel_err(g->exp_avg, w->exp_avg), tol) << "exp_avg of param " << i;
    EXPECT_LE(rel_err(g->exp_avg_sq, w->exp_avg_sq), tol) << "exp_avg_sq of param " << i;
    ASSERT_EQ(g->max_exp_avg_sq.defined(), w->max_exp_avg_sq.defined());
    if (w->max_exp_avg_sq.defined()) {
      EXPECT_LE(rel_err(g->max_exp_avg_sq, w->max_exp_avg_sq), tol) << "max_exp_avg_sq " << i;
    }
  }
  EXPECT_FALSE(moments(got, pg.no_grad)) << "a parameter without a gradient has no state";
}

TEST(CPUAdam, MatchesLibtorchFp32EveryMode) {
  for (const Mode& m : all_modes()) {
    SCOPED_TRACE(m.name());
    Params mine = make_params(at::kFloat), ref = clone(mine);
    const at::Tensor no_grad_before = mine.no_grad.detach().clone();
    auto cpu = cpu_optimizer(m, mine.all());
    auto tor = torch_optimizer(m, ref.all());
    for (int s = 0; s < kSteps; ++s) {
      auto g = grads_of(s, at::kFloat);
      set_grads(mine, g);
      set_grads(ref, g);
      cpu->step();
      tor->step();
    }
    for (size_t i = 0; i < mine.trained.size(); ++i) {
      EXPECT_LE(rel_err(mine.trained[i], ref.trained[i]), 1e-6) << "param " << i;
      EXPECT_FALSE(at::equal(mine.trained[i], make_params(at::kFloat).trained[i]))
          << "param " << i << " did not move";
    }
    EXPECT_TRUE(at::equal(mine.no_grad, no_grad_before));
    expect_states_close(*cpu, mine, *tor, ref, 1e-6);
  }
}

// 16-bit parameters: CPUAdam reads them, steps in fp32 with fp32 state and rounds back. The
// reference is libtorch's optimizer stepping an fp32 copy that is reset from the rounded
// values every step. Rounding can flip where the two fp32 results straddle a rounding boundary
// (fused multiply-adds round once where libtorch's separate ops round twice): allowed for at
// most 1 in 200 elements, and then by at most two units in the last place (a flip can repeat
// in a later step). ulp_rel: 2^-mantissa bits; min_ulp: the smallest subnormal step.
void check_16bit(at::ScalarType dtype, double ulp_rel, double min_ulp) {
  for (const Mode& m : all_modes()) {
    SCOPED_TRACE(m.name() + " " + c10::toString(dtype));
    Params mine = make_params(dtype), ref16 = clone(mine);
    Params mirror;  // fp32 copies stepped by libtorch
    for (const auto& t : ref16.trained) {
      mirror.trained.push_back(t.detach().to(at::kFloat).requires_grad_());
    }
    mirror.empty = at::empty({0}).requires_grad_();
    mirror.no_grad = ref16.no_grad.detach().to(at::kFloat).requires_grad_();
    auto cpu = cpu_optimizer(m, mine.all());
    auto tor = torch_optimizer(m, mirror.all());
    for (int s = 0; s < kSteps; ++s) {
      auto g = grads_of(s, dtype);
      set_grads(mine, g);
      std::vector<at::Tensor> g32;
      for (const auto& t : g) g32.push_back(t.to(at::kFloat));
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < mirror.trained.size(); ++i) {
          mirror.trained[i].copy_(ref16.trained[i]);
        }
      }
      set_grads(mirror, g32);
      cpu->step();
      tor->step();
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < mirror.trained.size(); ++i) ref16.trained[i].copy_(mirror.trained[i]);
    }
    int64_t flipped = 0, total = 0;
    for (size_t i = 0; i < mine.trained.size(); ++i) {
      EXPECT_EQ(mine.trained[i].scalar_type(), dtype);
      const at::Tensor a = mine.trained[i].detach().to(at::kDouble);
      const at::Tensor b = ref16.trained[i].detach().to(at::kDouble);
      const at::Tensor differs = a.ne(b);
      flipped += differs.sum().item<int64_t>();
      total += a.numel();
      const at::Tensor ulp = at::clamp_min(b.abs() * ulp_rel, min_ulp);
      EXPECT_TRUE(((a - b).abs() <= 2 * ulp).all().item<bool>())
          << "param " << i << " differs by more than two units in the last place";
    }
    EXPECT_LE(flipped * 200, total) << flipped << " of " << total << " elements differ";
    expect_states_close(*cpu, mine, *tor, mirror, 1e-6);
  }
}

TEST(CPUAdam, MatchesLibtorchBf16ParamsFp32State) {
  check_16bit(at::kBFloat16, 1.0 / 128, 9.2e-41);
}
TEST(CPUAdam, MatchesLibtorchFp16ParamsFp32State) {
  check_16bit(at::kHalf, 1.0 / 1024, 5.97e-8);
}

// The step splits the elements over threads anywhere (not on the vector grid): every thread
// count gives the same bits.
TEST(CPUAdam, ThreadCountDoesNotChangeResults) {
  const int before = at::get_num_threads();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    std::vector<Params> runs;
    for (int threads : {1, 2, 3}) {
      at::set_num_threads(threads);
      Params p = make_params(dtype);
      auto cpu = cpu_optimizer({true, 0.05, false}, p.all());
      for (int s = 0; s < 5; ++s) {
        set_grads(p, grads_of(s, dtype));
        cpu->step();
      }
      runs.push_back(p);
    }
    for (size_t r = 1; r < runs.size(); ++r) {
      for (size_t i = 0; i < runs[0].trained.size(); ++i) {
        EXPECT_TRUE(at::equal(runs[r].trained[i], runs[0].trained[i])) << "param " << i;
      }
    }
  }
  at::set_num_threads(before);
}

TEST(CPUAdam, NoBiasCorrectionFirstStep) {
  at::Tensor p = at::randn({37}).requires_grad_();
  const at::Tensor p0 = p.detach().clone();
  const at::Tensor g = at::randn({37});
  p.mutable_grad() = g.clone();
  CPUAdamOptions o;
  o.lr = 0.1;
  o.bias_correction = false;
  CPUAdam opt({p}, o);
  opt.step();
  const at::Tensor m = 0.1 * g, v = 0.001 * g * g;
  const at::Tensor want = p0 - 0.1 * m / (v.sqrt() + 1e-8);
  EXPECT_LE(rel_err(p.detach(), want), 1e-6);
}

// CPUAdam's torch::save archive is libtorch's AdamW (adamw_mode) / Adam layout: state saved by
// one continues in the other exactly.
template <typename TorchOpt, typename TorchOptions>
void round_trip(bool adamw) {
  const Mode m{adamw, 0.05, false};
  // CPUAdam -> libtorch.
  {
    Params a = make_params(at::kFloat);
    auto cpu = cpu_optimizer(m, a.all());
    for (int s = 0; s < 3; ++s) {
      set_grads(a, grads_of(s, at::kFloat));
      cpu->step();
    }
    std::stringstream archive;
    torch::save(*cpu, archive);
    Params b = clone(a);
    TorchOpt tor(b.all(), TorchOptions(kLr).weight_decay(m.weight_decay));
    torch::load(tor, archive);
    expect_states_close(tor, b, *cpu, a, 0.0);
    for (int s = 3; s < 8; ++s) {
      auto g = grads_of(s, at::kFloat);
      set_grads(a, g);
      set_grads(b, g);
      cpu->step();
      tor.step();
    }
    for (size_t i = 0; i < a.trained.size(); ++i) {
      EXPECT_LE(rel_err(b.trained[i], a.trained[i]), 1e-6) << "param " << i;
    }
  }
  // libtorch -> CPUAdam.
  {
    Params a = make_params(at::kFloat);
    TorchOpt tor(a.all(), TorchOptions(kLr).weight_decay(m.weight_decay));
    for (int s = 0; s < 3; ++s) {
      set_grads(a, grads_of(s, at::kFloat));
      tor.step();
    }
    std::stringstream archive;
    torch::save(tor, archive);
    Params b = clone(a);
    auto cpu = cpu_optimizer(m, b.all());
    torch::load(*cpu, archive);
    expect_states_close(*cpu, b, tor, a, 0.0);
    for (int s = 3; s < 8; ++s) {
      auto g = grads_of(s, at::kFloat);
      set_grads(a, g);
      set_grads(b, g);
      tor.step();
      cpu->step();
    }
    for (size_t i = 0; i < a.trained.size(); ++i) {
      EXPECT_LE(rel_err(b.trained[i], a.trained[i]), 1e-6) << "param " << i;
    }
  }
}

TEST(CPUAdam, StateDictRoundTripWithLibtorchAdamW) {
  round_trip<torch::optim::AdamW, torch::optim::AdamWOptions>(true);
}
TEST(CPUAdam, StateDictRoundTripWithLibtorchAdam) {
  round_trip<torch::optim::Adam, torch::optim::AdamOptions>(false);
}

// Parameter groups with their own options, as configure_optimizers builds them.
TEST(CPUAdam, ParameterGroupsKeepTheirOptions) {
  Params mine = make_params(at::kFloat), ref = clone(mine);
  auto groups = [](const Params& p) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{p.trained[0], p.trained[1], p.trained[2]},
                   std::make_unique<torch::optim::AdamWOptions>(
                       torch::optim::AdamWOptions(3e-2).weight_decay(0.1)));
    g.emplace_back(std::vector<at::Tensor>{p.trained[3], p.trained[4]});  // the defaults
    return g;
  };
  CPUAdamOptions o;
  o.lr = kLr;
  CPUAdam cpu(groups(mine), o);
  torch::optim::AdamW tor(groups(ref), torch::optim::AdamWOptions(kLr).weight_decay(0));
  for (int s = 0; s < 10; ++s) {
    auto g = grads_of(s, at::kFloat);
    set_grads(mine, g);
    set_grads(ref, g);
    cpu.step();
    tor.step();
  }
  for (size_t i = 0; i < mine.trained.size(); ++i) {
    EXPECT_LE(rel_err(mine.trained[i], ref.trained[i]), 1e-6) << "param " << i;
  }
}

TEST(CPUAdam, ClearErrors) {
  // Unsupported dtype.
  at::Tensor d = at::randn({4}, at::kDouble).requires_grad_();
  d.mutable_grad() = at::ones_like(d);
  CPUAdam opt({d});
  try {
    opt.step();
    ADD_FAILURE() << "a double parameter was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("Float, BFloat16 and Half"), std::string::npos)
        << e.what();
  }
  // Group options of the other mode.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{at::randn({3}).requires_grad_()},
                      std::make_unique<torch::optim::AdamOptions>(1e-3));
  try {
    CPUAdam bad(groups, CPUAdamOptions{});  // adamw_mode by default
    ADD_FAILURE() << "AdamOptions were accepted in adamw_mode";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("AdamWOptions"), std::string::npos) << e.what();
  }
  // Invalid hyper-parameters.
  CPUAdamOptions o;
  o.betas = {0.9, 1.0};
  EXPECT_THROW(CPUAdam({at::randn({3}).requires_grad_()}, o), c10::Error);
}

TEST(CPUAdam, ReportsItsInstructionSet) {
  const std::string isa = CPUAdam::isa();
  EXPECT_TRUE(isa == "avx512" || isa == "avx2" || isa == "default") << isa;
}

}  // namespace
