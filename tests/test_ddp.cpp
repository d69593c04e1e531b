// DDPStrategy mechanics with real processes (tests/testing.h run_ranks): parameter broadcast,
// bucket layout, hand-written training loop against a single-process reference, no_sync,
// unused parameters, gradient_as_bucket_view, static_graph, the memory refusal.
// The Trainer / fsdp-train parity tests are in test_ddp_parity.cpp.
#include <gtest/gtest.h>

#include "fsdp/ddp.h"
#include "fsdp/memory.h"
#include "fsdp/models.h"
#include "ddp_test_util.h"
#include "testing.h"

#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

namespace {

using fsdp::ProcessGroup;
using fsdp::ProcessGroupPtr;

using fsdp::testing::flat_params;
using fsdp::testing::make_ddp;
using fsdp::testing::max_diff_from_rank0;

// Three 8x8 layers. `reversed` applies them in the reverse of registration order (l3 first),
// so gradients become ready in registration order: the opposite of DDP's default bucket guess.
// `extra` is used only when use_extra is true; `never` is never used.
struct Chain : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, extra{nullptr}, never{nullptr};
  bool reversed = false;
  bool use_extra = true;
  explicit Chain(bool with_never = false) {
    l1 = register_module("l1", torch::nn::Linear(8, 8));
    l2 = register_module("l2", torch::nn::Linear(8, 8));
    l3 = register_module("l3", torch::nn::Linear(8, 8));
    extra = register_module("extra", torch::nn::Linear(8, 8));
    if (with_never) never = register_module("never", torch::nn::Linear(8, 8));
  }
  at::Tensor forward(at::Tensor x) {
    if (reversed) x = l1(torch::tanh(l2(torch::tanh(l3(x)))));
    else x = l3(torch::tanh(l2(torch::tanh(l1(x)))));
    if (use_extra) x = extra(torch::tanh(x));
    return x;
  }
};

at::Tensor chain_loss(Chain& m, const at::Tensor& x) { return m.forward(x).pow(2).mean(); }

// ---------------------------------------------------------------------------------------------

TEST(DDP, BroadcastsRank0ParametersInOneCollectiveAndBucketsInReverseOrder) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    torch::manual_seed(100 + pg.rank());  // a different model on every rank
    Chain model;
    ASSERT_GT(max_diff_from_rank0(pg, flat_params(model)), 0.0);

    pg.reset_counters();
    auto ddp = make_ddp(pg);  // default 25 MB buckets: the whole model fits one flat buffer
    ddp->setup(model);
    const auto c = pg.counters();
    EXPECT_EQ(c.calls, 1) << "parameters must be broadcast through one flat buffer per bucket";
    EXPECT_EQ(c.broadcast_bytes, flat_params(model).numel() * 4);
    EXPECT_EQ(max_diff_from_rank0(pg, flat_params(model)), 0.0);

    // Small buckets: one per ~300 bytes, reverse registration order.
    Chain other;
    fsdp::DDPOptions opts;
    opts.bucket_cap_mb = 300.0 / (1024 * 1024);
    auto small = make_ddp(pg, opts);
    small->setup(other);
    auto buckets = small->buckets();
    ASSERT_EQ(buckets.size(), 3u);
    EXPECT_EQ(buckets.front().names.front(), "extra.bias");
    EXPECT_EQ(buckets.back().names.back(), "l1.weight");
    int64_t total = 0;
    for (const auto& b : buckets) {
      total += b.numel;
      // A bucket closes as soon as it reaches the cap.
      int64_t without_last = b.numel - other.named_parameters()[b.names.back()].numel();
      EXPECT_LT(without_last * 4, 300) << "bucket exceeded its cap before its last parameter";
    }
    EXPECT_EQ(total, flat_params(other).numel());
  });
}

// The hand-written loop users of the library write, against one process on the global batch.
// transformer-tiny, dropout 0, SGD with momentum; DDP rank r takes rows [r*B, (r+1)*B) of each global batch.
void run_hand_loop_parity(ProcessGroup& pg, int64_t accumulate, double clip) {
  const int64_t world = pg.size(), B = 2, T = 12, vocab = 64, steps = 5;
  torch::manual_seed(7);
  auto model = fsdp::demos::make_model("transformer-tiny", vocab, 0.0);
  torch::manual_seed(7);
  auto reference = fsdp::demos::make_model("transformer-tiny", vocab, 0.0);
  torch::manual_seed(1234);
  at::Tensor tokens = torch::randint(vocab, {steps, accumulate, world * B, T + 1}, at::kLong);

  auto ddp = make_ddp(pg);
  ddp->setup(*model);
  // See Note [Parity optimizer] in test_ddp_parity.cpp: SGD with momentum, not Adam.
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));

  auto loss_of = [](fsdp::nn::Module& m, const at::Tensor& batch) {
    at::Tensor input = batch.narrow(1, 0, batch.size(1) - 1).contiguous();
    at::Tensor target = batch.narrow(1, 1, batch.size(1) - 1).contiguous();
    return at::nll_loss(m(input, target), target.reshape(-1));
  };
  for (int64_t s = 0; s < steps; ++s) {
    double local_sum = 0, ref_sum = 0;
    for (int64_t m = 0; m < accumulate; ++m) {
      const bool sync = m == accumulate - 1;
      at::Tensor global = tokens[s][m];
      ddp->prepare_forward(sync);
      at::Tensor loss = loss_of(*model, global.narrow(0, pg.rank() * B, B)) / accumulate;
      loss.backward();
      ddp->finish_backward(sync);
      local_sum += loss.item<double>();
      at::Tensor ref_loss = loss_of(*reference, global) / accumulate;
      ref_loss.backward();
      ref_sum += ref_loss.item<double>();
    }
    if (clip > 0) {
      double norm = ddp->clip_grad_norm(clip);
      double ref_norm = torch::nn::utils::clip_grad_norm_(reference->parameters(), clip);
      EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "step " << s;
      EXPECT_EQ(max_diff_from_rank0(pg, at::tensor({static_cast<float>(norm)})), 0.0)
          << "gradients must be replicated after the all-reduce";
    }
    opt.step();
    ref_opt.step();
    ddp->zero_grad(opt);
    ref_opt.zero_grad();
    at::Tensor mean = at::tensor({static_cast<float>(local_sum)});
    pg.all_reduce(mean, fsdp::ReduceOp::kAvg);
    EXPECT_NEAR(mean.item<double>(), ref_sum, 1e-5 * std::abs(ref_sum)) << "step " << s;
  }
  double max_param_diff =
      (flat_params(*model) - flat_params(*reference)).abs().max().item<double>();
  EXPECT_LE(max_param_diff, 1e-5) << "parameters after " << steps << " steps";
  EXPECT_EQ(max_diff_from_rank0(pg, flat_params(*model)), 0.0) << "replicas diverged";
}

TEST(DDP, HandLoopMatchesSingleProcessGloo) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) { run_hand_loop_parity(pg, 1, 0); });
}

TEST(DDP, HandLoopMatchesSingleProcessMpi) {
  fsdp::testing::run_ranks(3, "mpi", [](ProcessGroup& pg) { run_hand_loop_parity(pg, 1, 0); });
}

TEST(DDP, HandLoopWithNoSyncAccumulationAndClippingMatchesSingleProcess) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) { run_hand_loop_parity(pg, 2, 0.5); });
}

TEST(DDP, NoSyncMicroBatchSendsNoAllReduce) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    torch::manual_seed(0);
    Chain model;
    auto ddp = make_ddp(pg);
    ddp->setup(model);
    at::Tensor x = torch::randn({4, 8}) + pg.rank();

    pg.reset_counters();
    ddp->prepare_forward(/*sync=*/false);
    chain_loss(model, x).backward();
    ddp->finish_backward(false);
    EXPECT_EQ(pg.counters().all_reduce_bytes, 0);
    EXPECT_EQ(pg.counters().calls, 0);
    // Local gradients differ per rank (different inputs, nothing averaged yet).
    EXPECT_GT(max_diff_from_rank0(pg, model.l1->weight.grad().reshape(-1)), 0.0);

    ddp->prepare_forward(/*sync=*/true);
    chain_loss(model, x).backward();
    ddp->finish_backward(true);
    EXPECT_EQ(pg.counters().all_reduce_bytes, flat_params(model).numel() * 4)
        << "the boundary micro-batch all-reduces every gradient once";
    EXPECT_EQ(max_diff_from_rank0(pg, model.l1->weight.grad().reshape(-1)), 0.0);
  });
}

TEST(DDP, UnusedParameterIsAnErrorThatNamesIt) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    torch::manual_seed(0);
    Chain model;
    model.use_extra = false;
    auto ddp = make_ddp(pg);
    ddp->setup(model);
    ddp->prepare_forward(true);
    std::string message;
    try {
      chain_loss(model, torch::randn({4, 8})).backward();
      ddp->finish_backward(true);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    EXPECT_NE(message.find("'extra.weight'"), std::string::npos) << message;
    EXPECT_NE(message.find("'extra.bias'"), std::string::npos) << message;
    EXPECT_NE(message.find("find_unused_parameters=true"), std::string::npos) << message;
    EXPECT_EQ(message.find("'l1.weight'"), std::string::npos) << message;
    pg.barrier();  // the group is still usable
  });
}

TEST(DDP, FindUnusedParametersAveragesWhatWasUsedAndLeavesTheRest) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    fsdp::DDPOptions opts;
    opts.find_unused_parameters = true;
    opts.bucket_cap_mb = 300.0 / (1024 * 1024);
    torch::manual_seed(0);
    Chain model(/*with_never=*/true);
    torch::manual_seed(0);
    Chain probe(/*with_never=*/true);  // computes rank 0's local gradient on every rank
    auto ddp = make_ddp(pg, opts);
    ddp->setup(model);

    auto input = [](int rank) {
      torch::manual_seed(50 + rank);
      return torch::randn({4, 8});
    };
    model.use_extra = pg.rank() == 0;  // `extra` is used on rank 0 only, `never` nowhere
    for (int step = 0; step < 2; ++step) {
      ddp->prepare_forward(true);
      chain_loss(model, input(pg.rank())).backward();
      ddp->finish_backward(true);
      EXPECT_FALSE(model.never->weight.grad().defined()) << "unused everywhere: left untouched";
      ASSERT_TRUE(model.extra->weight.grad().defined());
      probe.use_extra = true;
      probe.zero_grad();
      chain_loss(probe, input(0)).backward();
      EXPECT_TRUE(model.extra->weight.grad().allclose(probe.extra->weight.grad() / pg.size(),
                                                      1e-6, 1e-7))
          << "rank 0's gradient averaged with the zero contributions of ranks 1 and 2";
      EXPECT_EQ(max_diff_from_rank0(pg, model.l1->weight.grad().reshape(-1)), 0.0);
      model.zero_grad();
    }
  });
}

TEST(DDP, GradientAsBucketViewGivesTheSameResultsWithOneGradientCopyLess) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    fsdp::install_tracking_allocator();
    auto train = [&](bool as_view, int64_t* grown_bytes) {
      torch::manual_seed(3);
      auto model = fsdp::demos::make_model("transformer-tiny", 64, 0.0);
      fsdp::DDPOptions opts;
      opts.gradient_as_bucket_view = as_view;
      opts.bucket_cap_mb = 0.05;
      const int64_t before = fsdp::memory_stats().current_bytes;
      auto ddp = make_ddp(pg, opts);
      ddp->setup(*model);
      torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
      torch::manual_seed(11 + pg.rank());
      std::vector<const void*> grad_ptrs;
      for (int step = 0; step < 3; ++step) {
        at::Tensor tokens = torch::randint(64, {2, 9}, at::kLong);
        at::Tensor in = tokens.narrow(1, 0, 8).contiguous(), tg = tokens.narrow(1, 1, 8).contiguous();
        ddp->prepare_forward(true);
        at::nll_loss((*model)(in, tg), tg.reshape(-1)).backward();
        ddp->finish_backward(true);
        opt.step();
        // Measured before zero_grad: libtorch 2.x's Optimizer::zero_grad sets gradients to none
        // (as Python's), so without views the separate .grad copies live from backward to here.
        if (step == 0) *grown_bytes = fsdp::memory_stats().current_bytes - before;
        ddp->zero_grad(opt);
        if (as_view) {
          const void* ptr = model->parameters()[0].grad().data_ptr();
          if (step > 0) EXPECT_EQ(ptr, grad_ptrs.back()) << ".grad must stay the bucket view";
          grad_ptrs.push_back(ptr);
        }
      }
      int64_t grad_bytes = 0;
      for (const auto& p : model->parameters()) grad_bytes += p.numel() * 4;
      return std::make_pair(flat_params(*model), grad_bytes);
    };
    int64_t grown_copy = 0, grown_view = 0, warm_up = 0;
    train(false, &warm_up);  // first-use allocations of the process group stay out of the figures
    auto [copy_params, grad_bytes] = train(false, &grown_copy);
    auto [view_params, grad_bytes2] = train(true, &grown_view);
    EXPECT_TRUE(copy_params.equal(view_params)) << "same arithmetic, same results";
    if (fsdp::tracking_allocator_installed()) {
      // Memory held after one step: buckets + Adam state (+ separate .grad without views).
      const int64_t saved = grown_copy - grown_view;
      std::printf("[rank %d] gradient_as_bucket_view saves %lld bytes (gradients: %lld bytes)\n",
                  pg.rank(), static_cast<long long>(saved), static_cast<long long>(grad_bytes));
      // current_bytes is process-wide: the process group's communication threads allocate
      // small staging tensors concurrently (8 KiB seen in CI), hence the absolute slack.
      EXPECT_NEAR(static_cast<double>(saved), static_cast<double>(grad_bytes),
                  std::max(0.02 * grad_bytes, 16384.0));
    }
  });
}

TEST(DDP, StaticGraphRebuildsBucketsInGradientReadyOrder) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    auto run = [&](bool static_graph, std::vector<int64_t>* held) {
      fsdp::DDPOptions opts;
      opts.static_graph = static_graph;
      opts.bucket_cap_mb = 200.0 / (1024 * 1024);  // about one parameter per bucket
      torch::manual_seed(0);
      Chain model;
      model.reversed = true;  // gradients arrive in registration order
      auto ddp = make_ddp(pg, opts);
      ddp->setup(model);
      torch::optim::SGD opt(model.parameters(), 0.1);
      torch::manual_seed(20 + pg.rank());
      for (int step = 0; step < 3; ++step) {
        ddp->prepare_forward(true);
        chain_loss(model, torch::randn({4, 8})).backward();
        ddp->finish_backward(true);
        opt.step();
        ddp->zero_grad(opt);
        held->push_back(ddp->last_held_buckets());
        auto order = ddp->last_launch_order();
        for (size_t k = 0; k < order.size(); ++k) EXPECT_EQ(order[k], static_cast<int>(k));
      }
      if (static_graph) {  // rebuilt in ready order: extra, l1, l2, l3
        EXPECT_EQ(ddp->buckets().front().names.front().rfind("extra.", 0), 0u);
        EXPECT_EQ(ddp->buckets().back().names.back().rfind("l3.", 0), 0u);
      }
      return flat_params(model);
    };
    std::vector<int64_t> held_default, held_static;
    at::Tensor a = run(false, &held_default);
    at::Tensor b = run(true, &held_static);
    EXPECT_TRUE(a.equal(b)) << "rebuilding buckets must not change the arithmetic";
    for (int64_t h : held_default) EXPECT_GT(h, 0);
    EXPECT_GT(held_static[0], 0) << "first iteration uses the default layout";
    EXPECT_EQ(held_static[1], 0);
    EXPECT_EQ(held_static[2], 0);
  });
}

// static_graph with find_unused_parameters (PyTorch: dynamic_graph_find_unused() is false with
// static_graph): the "used" mask (4 bytes per parameter tensor) is all-reduced in the first
// iteration only; after it every step sends exactly the gradients. A parameter never used stays
// without a gradient throughout.
TEST(DDP, StaticGraphWithFindUnusedSendsTheUsedMaskOnlyInTheFirstStep) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    fsdp::DDPOptions opts;
    opts.static_graph = true;
    opts.find_unused_parameters = true;
    torch::manual_seed(0);
    Chain model(/*with_never=*/true);
    auto ddp = make_ddp(pg, opts);
    ddp->setup(model);
    const int64_t tensors = static_cast<int64_t>(model.parameters().size());
    const int64_t grad_bytes = flat_params(model).numel() * 4;
    torch::optim::SGD opt(model.parameters(), 0.1);
    torch::manual_seed(30 + pg.rank());
    for (int step = 0; step < 3; ++step) {
      pg.reset_counters();
      ddp->prepare_forward(true);
      chain_loss(model, torch::randn({4, 8})).backward();
      ddp->finish_backward(true);
      opt.step();
      ddp->zero_grad(opt);
      const auto c = pg.counters();
      if (step == 0) {  // gradients + the used mask (fp32 per tensor); the order broadcast
        EXPECT_EQ(c.all_reduce_bytes, grad_bytes + tensors * 4);
        EXPECT_EQ(c.broadcast_bytes, tensors * 8);
      } else {
        EXPECT_EQ(c.all_reduce_bytes, grad_bytes) << "step " << step;
        EXPECT_EQ(c.broadcast_bytes, 0) << "step " << step;
      }
      EXPECT_FALSE(model.never->weight.grad().defined()) << "step " << step;
    }
  });
}

TEST(DDP, StaticGraphReportsAParameterThatStopsGettingGradients) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    fsdp::DDPOptions opts;
    opts.static_graph = true;
    torch::manual_seed(0);
    Chain model;
    auto ddp = make_ddp(pg, opts);
    ddp->setup(model);
    ddp->prepare_forward(true);
    chain_loss(model, torch::randn({4, 8})).backward();
    ddp->finish_backward(true);
    model.use_extra = false;
    ddp->prepare_forward(true);
    std::string message;
    try {
      chain_loss(model, torch::randn({4, 8})).backward();
      ddp->finish_backward(true);
    } catch (const c10::Error& e) {
      message = e.what_without_backtrace();
    }
    EXPECT_NE(message.find("static_graph"), std::string::npos) << message;
    EXPECT_NE(message.find("'extra.weight'"), std::string::npos) << message;
  });
}

TEST(DDP, RefusesUpFrontWhatCannotFitTheMemoryBudget) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    fsdp::install_tracking_allocator();
    torch::manual_seed(0);
    torch::nn::Sequential model(torch::nn::Linear(512, 512), torch::nn::Linear(512, 512));
    const auto est = fsdp::estimate_ddp_memory(*model.ptr(), {});
    const int64_t param_bytes = 2 * (512 * 512 + 512) * 4;
    EXPECT_EQ(est.param_bytes, param_bytes);
    EXPECT_EQ(est.total_bytes(), 5 * param_bytes);  // params + grads + buckets + 2 Adam moments
    fsdp::DDPOptions view;
    view.gradient_as_bucket_view = true;
    EXPECT_EQ(fsdp::estimate_ddp_memory(*model.ptr(), view).total_bytes(), 4 * param_bytes);

    fsdp::set_memory_budget(fsdp::memory_stats().current_bytes + param_bytes);
    auto ddp = make_ddp(pg);
    std::string message;
    try {
      ddp->setup(*model.ptr());
    } catch (const fsdp::OutOfMemoryError& e) {
      message = e.what_without_backtrace();
    }
    fsdp::set_memory_budget(0);
    EXPECT_NE(message.find("DDP needs ~"), std::string::npos) << message;
    EXPECT_NE(message.find("per rank for 525.3K parameters"), std::string::npos) << message;
    EXPECT_NE(message.find("use strategy fsdp"), std::string::npos) << message;
  });
}

}  // namespace
