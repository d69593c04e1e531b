// DDP with activation checkpointing where every trainable parameter sits inside a checkpointed
// block. The blocks' parameter gradients are then produced by nested backward runs (the
// checkpoint function's backward), so the first gradient DDP sees comes from a nested graph
// task; DDPStrategy::backward(loss) must still finish the reduction at the end of the *outer*
// backward. Compared with the plain model trained on the whole batch in one process.
#include <gtest/gtest.h>

#include "fsdp/activation_checkpointing.h"
#include "fsdp/ddp.h"
#include "fsdp/nn.h"
#include "testing.h"

#include <torch/torch.h>

#include <string>
#include <vector>

namespace {

using fsdp::ProcessGroup;
using fsdp::ProcessGroupPtr;

constexpr int64_t kWidth = 6;
constexpr int64_t kRowsPerRank = 2;

ProcessGroupPtr borrow(ProcessGroup& pg) { return ProcessGroupPtr(&pg, [](ProcessGroup*) {}); }

std::shared_ptr<fsdp::DDPStrategy> make_ddp(ProcessGroup& pg, fsdp::DDPOptions options) {
  auto ddp = std::make_shared<fsdp::DDPStrategy>(options);
  fsdp::LaunchInfo info;
  info.rank = pg.rank();
  info.world_size = pg.size();
  ddp->connect(borrow(pg), info);
  return ddp;
}

struct Block : fsdp::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Block() {
    a = register_module("a", torch::nn::Linear(kWidth, kWidth));
    b = register_module("b", torch::nn::Linear(kWidth, kWidth));
  }
  at::Tensor forward(const fsdp::nn::Inputs& in) override {
    return torch::tanh(b(torch::tanh(a(in.at(0)))));
  }
};

// No parameter outside the two blocks: every gradient comes from a block's backward.
struct Net : torch::nn::Module {
  std::shared_ptr<Block> b1, b2;
  Net() {
    b1 = register_module("b1", std::make_shared<Block>());
    b2 = register_module("b2", std::make_shared<Block>());
  }
  at::Tensor forward(const at::Tensor& x) { return (*b2)((*b1)(x)); }
};

std::shared_ptr<Net> make_net(bool checkpoint) {
  torch::manual_seed(0);
  auto net = std::make_shared<Net>();
  net->to(torch::kDouble);
  if (checkpoint) {
    EXPECT_EQ(fsdp::apply_activation_checkpointing(*net, fsdp::nn::module_types<Block>()), 2);
  }
  return net;
}

// Global batch of `world` * kRowsPerRank rows for `step`, the same on every rank.
std::pair<at::Tensor, at::Tensor> global_batch(int world, int step) {
  torch::manual_seed(1000 + step);
  auto opts = torch::TensorOptions().dtype(torch::kDouble);
  return {torch::randn({world * kRowsPerRank, kWidth}, opts),
          torch::randn({world * kRowsPerRank, kWidth}, opts)};
}

at::Tensor flat_params(torch::nn::Module& m) {
  std::vector<at::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().reshape(-1));
  return at::cat(parts);
}

double max_diff_from_rank0(ProcessGroup& pg, const at::Tensor& local) {
  at::Tensor all = at::empty({pg.size() * local.numel()}, local.options());
  pg.all_gather_into_tensor(all, local.contiguous());
  all = all.view({pg.size(), local.numel()});
  return (all - all[0]).abs().max().item<double>();
}

// Checkpointed DDP model (each rank its shard of the batch, backward through
// DDPStrategy::backward) against the plain model on the whole batch in one process: gradients
// after every backward and parameters after every SGD step.
void checkpointed_parity(ProcessGroup& pg, fsdp::DDPOptions options, int steps = 3) {
  auto reference = make_net(false);
  auto model = make_net(true);
  auto ddp = make_ddp(pg, options);
  ddp->setup(*model);
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  const int r = pg.rank();
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(pg.size(), s);
    ref_opt.zero_grad();
    torch::mse_loss(reference->forward(x), y).backward();

    ddp->prepare_forward(/*sync=*/true);
    at::Tensor loss = torch::mse_loss(model->forward(x.narrow(0, r * kRowsPerRank, kRowsPerRank)),
                                      y.narrow(0, r * kRowsPerRank, kRowsPerRank));
    ddp->backward(loss);
    ddp->finish_backward(/*sync=*/true);
    EXPECT_EQ(ddp->num_synced_backwards(), s + 1);

    auto ref_params = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      const at::Tensor& got = p.value().grad();
      const at::Tensor& want = ref_params[p.key()].grad();
      ASSERT_TRUE(got.defined()) << p.key() << " step " << s;
      EXPECT_LE((got - want).abs().max().item<double>(), 1e-6)
          << p.key() << " step " << s << ": averaged gradient differs from the whole batch's";
    }
    ref_opt.step();
    opt.step();
    ddp->zero_grad(opt);
  }
  EXPECT_LE((flat_params(*model) - flat_params(*reference)).abs().max().item<double>(), 1e-6)
      << "parameters after " << steps << " SGD steps";
  EXPECT_EQ(max_diff_from_rank0(pg, flat_params(*model)), 0.0) << "replicas diverged";
}

// ---------------------------------------------------------------------------------------------

TEST(DDPCheckpointing, AllParametersInCheckpointedBlocksMatchPlainModelWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) { checkpointed_parity(pg, {}); });
}

TEST(DDPCheckpointing, AllParametersInCheckpointedBlocksMatchPlainModelWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) { checkpointed_parity(pg, {}); });
}

TEST(DDPCheckpointing, FindUnusedParametersWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    fsdp::DDPOptions opts;
    opts.find_unused_parameters = true;
    checkpointed_parity(pg, opts);
  });
}

// One bucket per Linear layer (4 buckets), gradients as bucket views, static graph: the bucket
// bookkeeping across several nested backwards.
TEST(DDPCheckpointing, SmallBucketsBucketViewsAndStaticGraphWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    fsdp::DDPOptions opts;
    opts.bucket_cap_mb = (kWidth * kWidth + kWidth) * 8.0 / (1024 * 1024);
    opts.gradient_as_bucket_view = true;
    opts.static_graph = true;
    checkpointed_parity(pg, opts, 4);
  });
}

// A no_sync micro-batch then a synchronized one through DDPStrategy::backward: the gradients
// accumulated over both are averaged once, as for the plain model.
TEST(DDPCheckpointing, NoSyncAccumulationWorld2) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    auto reference = make_net(false);
    auto model = make_net(true);
    auto ddp = make_ddp(pg, {});
    ddp->setup(*model);
    const int r = pg.rank();
    for (int micro = 0; micro < 2; ++micro) {
      auto [x, y] = global_batch(pg.size(), micro);
      torch::mse_loss(reference->forward(x), y).backward();
      const bool sync = micro == 1;
      ddp->prepare_forward(sync);
      ddp->backward(torch::mse_loss(model->forward(x.narrow(0, r * kRowsPerRank, kRowsPerRank)),
                                    y.narrow(0, r * kRowsPerRank, kRowsPerRank)));
      ddp->finish_backward(sync);
    }
    EXPECT_EQ(ddp->num_synced_backwards(), 1);
    auto ref_params = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      EXPECT_LE((p.value().grad() - ref_params[p.key()].grad()).abs().max().item<double>(), 1e-6)
          << p.key();
    }
  });
}

// The fallback for loops that call loss.backward() directly queues the end of backward from
// the first gradient hook, i.e. in the first block's nested backward: that is reported as an
// error that names the fix (with and without find_unused_parameters), not as wrong gradients.
TEST(DDPCheckpointing, LossBackwardDirectlyIsAnErrorThatNamesStrategyBackward) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    for (bool find_unused : {false, true}) {
      fsdp::DDPOptions opts;
      opts.find_unused_parameters = find_unused;
      auto model = make_net(true);
      auto ddp = make_ddp(pg, opts);
      ddp->setup(*model);
      auto [x, y] = global_batch(pg.size(), 0);
      ddp->prepare_forward(true);
      std::string message;
      try {
        torch::mse_loss(model->forward(x), y).backward();
        ddp->finish_backward(true);
      } catch (const c10::Error& e) {
        message = e.what_without_backtrace();
      }
      EXPECT_NE(message.find("strategy.backward(loss)"), std::string::npos)
          << "find_unused_parameters=" << find_unused << ": " << message;
      EXPECT_NE(message.find("activation checkpointing"), std::string::npos) << message;
      pg.barrier();  // the group is still usable
    }
  });
}

}  // namespace
