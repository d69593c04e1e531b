// 8-bit AdamW against bitsandbytes.optim.AdamW8bit (0.50.2, CPU; tests/hf_reference.py bnb):
// the same parameters after every one of several steps and the same quantized states, for a
// parameter above min_8bit_size (block-wise 8-bit moments) and one below it (fp32 moments).
// Also: close to torch's fp32 AdamW (the 8-bit error is small), and state bytes per element.
#include "fsdp/optim8bit.h"
#include "hf_testing.h"

#include <gtest/gtest.h>
#include <torch/optim/adamw.h>

namespace {

using fsdp::testing::hf_scratch;
using fsdp::testing::max_abs_diff;
using fsdp::testing::read_tensors;
using fsdp::testing::run_hf_reference;
using fsdp::testing::write_tensors;

constexpr int kSteps = 5;
constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.999, kEps = 1e-8, kWd = 0.01;

struct Case {
  at::Tensor p0;
  std::vector<at::Tensor> grads;
};

Case make_case(int64_t numel, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Case c;
  c.p0 = at::randn({numel / 50, 50}, gen) * 0.1;
  for (int k = 0; k < kSteps; ++k) c.grads.push_back(at::randn({numel / 50, 50}, gen) * (0.01 * (k + 1)));
  return c;
}

void write_case(const Case& c, const std::string& path) {
  std::vector<std::pair<std::string, at::Tensor>> t = {
      {"opt.p", c.p0}, {"opt.hparams", at::tensor({kLr, kBeta1, kBeta2, kEps, kWd}, at::kDouble)}};
  for (int k = 0; k < kSteps; ++k) t.emplace_back("opt.g" + std::to_string(k), c.grads[k]);
  write_tensors(path, t);
}

// Runs our optimizer; returns the parameter after each step.
std::vector<at::Tensor> run_ours(const Case& c, fsdp::AdamW8bit** keep = nullptr,
                                 at::Tensor* param = nullptr) {
  at::Tensor p = c.p0.clone().requires_grad_(true);
  auto* opt = new fsdp::AdamW8bit({p}, fsdp::AdamW8bitOptions(kLr).beta1(kBeta1).beta2(kBeta2).eps(kEps).weight_decay(kWd));
  std::vector<at::Tensor> out;
  for (int k = 0; k < kSteps; ++k) {
    p.mutable_grad() = c.grads[k].clone();
    opt->step();
    out.push_back(p.detach().clone());
  }
  if (keep) {
    *keep = opt;
    *param = p;
  } else {
    delete opt;
  }
  return out;
}

TEST(AdamW8bit, SameUpdatesAndStatesAsBitsandbytes) {
  const std::string dir = hf_scratch("adamw8bit");
  Case big = make_case(5000, 1), small = make_case(1000, 2);  // above / below min_8bit_size
  write_case(big, dir + "/big.safetensors");
  write_case(small, dir + "/small.safetensors");
  run_hf_reference({"bnb", dir + "/big.safetensors", dir + "/big_out.safetensors", ";", "bnb",
                    dir + "/small.safetensors", dir + "/small_out.safetensors"});
  for (const std::string name : {"big", "small"}) {
    SCOPED_TRACE(name);
    const Case& c = name == "big" ? big : small;
    auto want = read_tensors(dir + "/" + name + "_out.safetensors");
    fsdp::AdamW8bit* opt = nullptr;
    at::Tensor p;
    auto got = run_ours(c, &opt, &p);
    for (int k = 0; k < kSteps; ++k) {
      EXPECT_TRUE(at::equal(got[k], want.at("opt.p" + std::to_string(k))))
          << "step " << k << " max diff " << max_abs_diff(got[k], want.at("opt.p" + std::to_string(k)));
    }
    auto& st = static_cast<fsdp::AdamW8bitState&>(*opt->state().at(p.unsafeGetTensorImpl()));
    EXPECT_EQ(st.step(), kSteps);
    EXPECT_TRUE(at::equal(st.state1(), want.at("opt.state1")));
    EXPECT_TRUE(at::equal(st.state2(), want.at("opt.state2")));
    if (name == "big") {
      EXPECT_EQ(st.state1().scalar_type(), at::kByte);
      EXPECT_TRUE(at::equal(st.absmax1(), want.at("opt.absmax1")));
      EXPECT_TRUE(at::equal(st.absmax2(), want.at("opt.absmax2")));
      // 2 bytes + 2 fp32 absmaxes per 256 elements.
      EXPECT_EQ(opt->state_nbytes(), 2 * 5000 + 2 * 4 * ((5000 + 255) / 256));
    } else {
      EXPECT_EQ(st.state1().scalar_type(), at::kFloat);
    }
    delete opt;
  }
}

TEST(AdamW8bit, CloseToFp32AdamW) {
  Case c = make_case(20000, 3);
  auto ours = run_ours(c);
  at::Tensor p = c.p0.clone().requires_grad_(true);
  torch::optim::AdamW ref({p}, torch::optim::AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kWd));
  for (int k = 0; k < kSteps; ++k) {
    p.mutable_grad() = c.grads[k].clone();
    ref.step();
  }
  const double moved = max_abs_diff(p.detach(), c.p0);
  const double err = max_abs_diff(ours.back(), p.detach());
  EXPECT_GT(moved, 1e-3);
  EXPECT_LT(err, 0.05 * moved);  // the 8-bit moments cost a few percent of the update
}

TEST(AdamW8bit, PagedIsAcceptedAndIdentical) {
  Case c = make_case(5000, 4);
  at::Tensor a = c.p0.clone().requires_grad_(true), b = c.p0.clone().requires_grad_(true);
  fsdp::AdamW8bit plain({a}), paged({b}, fsdp::AdamW8bitOptions().paged(true));
  a.mutable_grad() = c.grads[0].clone();
  b.mutable_grad() = c.grads[0].clone();
  plain.step();
  paged.step();
  EXPECT_TRUE(at::equal(a, b));
}

}  // namespace
