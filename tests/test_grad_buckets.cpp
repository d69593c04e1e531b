// The gradient-bucket utility on its own (src/ddp/grad_buckets.h, src/common/liveness.h): bucket
// layouts under both cap conventions, launches in bucket order whatever order the gradients
// arrive in, the in-flight window, and hooks and callbacks that stay silent once their owner is
// gone. The strategies that use it are tested in test_ddp*.cpp, test_deepspeed.cpp and
// test_backward_after_teardown.cpp.
#include "ddp/grad_buckets.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace {

using fsdp::detail::AliveRef;
using fsdp::detail::assign_buckets;
using fsdp::detail::BucketCap;
using fsdp::detail::BucketItem;
using fsdp::detail::BucketLayout;
using fsdp::detail::GradBuckets;
using fsdp::detail::GradReadyHooks;
using fsdp::detail::Liveness;
using fsdp::detail::reverse_order;

std::vector<BucketItem> items(const std::vector<int64_t>& numels, double cap) {
  std::vector<BucketItem> out;
  for (int64_t n : numels) out.push_back(BucketItem{n, 0, cap});
  return out;
}

std::vector<std::vector<int>> params_of(const BucketLayout& layout) {
  std::vector<std::vector<int>> out;
  for (const auto& b : layout.buckets) out.push_back(b.params);
  return out;
}

using Buckets = std::vector<std::vector<int>>;

TEST(GradBuckets, ReverseOrderAndBothCapConventions) {
  EXPECT_EQ(reverse_order(4), (std::vector<int>{3, 2, 1, 0}));
  EXPECT_TRUE(reverse_order(0).empty());
  // Sizes by parameter index; taken in reverse order: 1, 20, 3, 6, 6.
  const std::vector<int64_t> numels = {6, 6, 3, 20, 1};
  // PyTorch DDP: a bucket closes once it reaches the cap; the parameter reaching it stays in.
  BucketLayout ddp = assign_buckets(items(numels, 10), reverse_order(5), BucketCap::kCloseAtCap);
  EXPECT_EQ(params_of(ddp), (Buckets{{4, 3}, {2, 1, 0}}));
  EXPECT_EQ(ddp.buckets[0].numel, 21);
  EXPECT_EQ(ddp.buckets[1].numel, 15);
  // DeepSpeed: a parameter that would take a non-empty bucket past the cap opens the next one;
  // a larger one is a bucket of its own.
  BucketLayout ds = assign_buckets(items(numels, 10), reverse_order(5), BucketCap::kStayUnderCap);
  EXPECT_EQ(params_of(ds), (Buckets{{4}, {3}, {2, 1}, {0}}));
  // Where each parameter sits.
  EXPECT_EQ(ds.bucket_of, (std::vector<int>{3, 2, 2, 1, 0}));
  EXPECT_EQ(ds.offset_of, (std::vector<int64_t>{0, 3, 0, 0, 0}));
  EXPECT_EQ(ddp.offset_of, (std::vector<int64_t>{9, 3, 0, 1, 0}));
  // Exactly at the cap: DDP closes, DeepSpeed keeps filling up to it.
  EXPECT_EQ(params_of(assign_buckets(items({5, 5, 5}, 10), reverse_order(3), BucketCap::kCloseAtCap)),
            (Buckets{{2, 1}, {0}}));
  EXPECT_EQ(params_of(assign_buckets(items({5, 5, 5}, 10), reverse_order(3), BucketCap::kStayUnderCap)),
            (Buckets{{2, 1}, {0}}));
  EXPECT_EQ(params_of(assign_buckets(items({4, 4, 4}, 10), reverse_order(3), BucketCap::kCloseAtCap)),
            (Buckets{{2, 1, 0}}));
}

TEST(GradBuckets, KindsNeverShareABucket) {
  // Kinds 0 and 1 interleaved (DDP: two dtypes): one open bucket per kind.
  std::vector<BucketItem> its = {{4, 0, 8}, {4, 1, 8}, {4, 0, 8}, {4, 1, 8}, {4, 0, 8}};
  BucketLayout layout = assign_buckets(its, reverse_order(5), BucketCap::kCloseAtCap);
  EXPECT_EQ(params_of(layout), (Buckets{{4, 2}, {3, 1}, {0}}));
  // A given order (DDP's static_graph) instead of the reverse one.
  layout = assign_buckets(its, {0, 1, 2, 3, 4}, BucketCap::kCloseAtCap);
  EXPECT_EQ(params_of(layout), (Buckets{{0, 2}, {1, 3}, {4}}));
}

// Records the owner's operations in order.
struct Recorder {
  std::vector<std::string> log;
  GradBuckets::Ops ops() {
    return {[this](int b) { log.push_back("copy_in " + std::to_string(b)); },
            [this](int b) { log.push_back("issue " + std::to_string(b)); },
            [this](int b) { log.push_back("finish " + std::to_string(b)); }};
  }
};

using Log = std::vector<std::string>;

TEST(GradBuckets, LaunchesInBucketOrderWhateverOrderGradientsArriveIn) {
  // Three buckets of two parameters: {5, 4}, {3, 2}, {1, 0}.
  BucketLayout layout =
      assign_buckets(items({1, 1, 1, 1, 1, 1}, 2), reverse_order(6), BucketCap::kCloseAtCap);
  ASSERT_EQ(params_of(layout), (Buckets{{5, 4}, {3, 2}, {1, 0}}));
  Recorder rec;
  GradBuckets buckets(layout, GradBuckets::kUnbounded, rec.ops());
  buckets.arm();
  // Bucket 2 completes first: held until 0 and 1 have launched.
  for (int p : {1, 0}) {
    buckets.mark_ready(p);
    buckets.launch_ready();
  }
  EXPECT_TRUE(rec.log.empty());
  EXPECT_EQ(buckets.held(), 1);
  buckets.mark_ready(5);
  buckets.launch_ready();
  EXPECT_TRUE(rec.log.empty()) << "bucket 0 is not complete";
  buckets.mark_ready(4);
  buckets.launch_ready();
  EXPECT_EQ(rec.log, (Log{"copy_in 0", "issue 0"}));
  buckets.mark_ready(3);
  buckets.mark_ready(2);
  buckets.launch_ready();
  // Unbounded: nothing is finished before finish_all, which goes in launch order.
  EXPECT_EQ(rec.log, (Log{"copy_in 0", "issue 0", "copy_in 1", "issue 1", "copy_in 2", "issue 2"}));
  EXPECT_TRUE(buckets.all_launched());
  EXPECT_EQ(buckets.launch_order(), (std::vector<int>{0, 1, 2}));
  rec.log.clear();
  buckets.finish_all();
  EXPECT_EQ(rec.log, (Log{"finish 0", "finish 1", "finish 2"}));

  // A new backward starts from scratch; the end of backward launches what is left, in order.
  rec.log.clear();
  buckets.arm();
  EXPECT_FALSE(buckets.ready(4));
  EXPECT_EQ(buckets.held(), 0);
  buckets.mark_ready(2);  // bucket 1 is still incomplete: nothing launches
  buckets.launch_ready();
  EXPECT_TRUE(rec.log.empty());
  buckets.launch_remaining();
  buckets.finish_all();
  EXPECT_EQ(rec.log, (Log{"copy_in 0", "issue 0", "copy_in 1", "issue 1", "copy_in 2", "issue 2",
                          "finish 0", "finish 1", "finish 2"}));
  // A gradient for a bucket launched without it changes nothing (its owner reduces it late).
  rec.log.clear();
  buckets.mark_ready(5);
  buckets.launch_ready();
  EXPECT_TRUE(buckets.ready(5));
  EXPECT_TRUE(rec.log.empty());
}

TEST(GradBuckets, OneInFlightFinishesThePreviousBucketAfterTheNextCopyIn) {
  BucketLayout layout = assign_buckets(items({1, 1, 1}, 1), reverse_order(3), BucketCap::kCloseAtCap);
  Recorder rec;
  GradBuckets buckets(layout, /*max_in_flight=*/1, rec.ops());
  buckets.arm();
  for (int p : {2, 1, 0}) {
    buckets.mark_ready(p);
    buckets.launch_ready();
  }
  buckets.finish_all();
  // At most one collective in flight: bucket k-1 finishes between k's copy-in and k's issue.
  EXPECT_EQ(rec.log, (Log{"copy_in 0", "issue 0", "copy_in 1", "finish 0", "issue 1",
                          "copy_in 2", "finish 1", "issue 2", "finish 2"}));
  // Launches outside the readiness order (ZeRO stage 1 at the step's boundary) share the window.
  rec.log.clear();
  buckets.launch(1);
  buckets.launch(0);
  buckets.finish_all();
  EXPECT_EQ(rec.log, (Log{"copy_in 1", "issue 1", "copy_in 0", "finish 1", "issue 0", "finish 0"}));
}

// An owner of hooks, as the reducer and the partitioner are.
struct Owner {
  std::vector<int>* seen;
  Liveness alive;
  GradReadyHooks hooks;
  Owner(std::vector<int>* s, const std::vector<at::Tensor>& params) : seen(s) {
    hooks = GradReadyHooks(params, alive.ref(this), &Owner::on_ready);
  }
  ~Owner() { alive.expire(); }
  void on_ready(int index) { seen->push_back(index); }
};

TEST(GradBuckets, ReadyHooksRunAfterAccumulationAndOnlyWhileTheOwnerLives) {
  at::Tensor a = torch::ones({3}, torch::requires_grad());
  at::Tensor b = torch::ones({2}, torch::requires_grad());
  std::vector<int> seen;
  auto owner = std::make_unique<Owner>(&seen, std::vector<at::Tensor>{a, b});
  // b is used last, so its gradient is ready first.
  (a.sum() * 2 + (a.sum() * b).sum()).backward();
  EXPECT_EQ(seen, (std::vector<int>{1, 0}));
  EXPECT_TRUE(a.grad().defined());

  // Token expired, hooks still installed: the check alone keeps them silent.
  seen.clear();
  at::Tensor loss = (a * 3).sum() + b.sum();
  owner->alive.expire();
  loss.backward();
  EXPECT_TRUE(seen.empty());

  // Owner destroyed (hooks removed) while a graph built under it is kept: backward is plain
  // autograd.
  seen.clear();
  owner = std::make_unique<Owner>(&seen, std::vector<at::Tensor>{a, b});
  loss = (a * 3).sum() + b.sum();
  owner.reset();
  a.mutable_grad() = at::Tensor();
  loss.backward();
  EXPECT_TRUE(seen.empty());
  EXPECT_TRUE(a.grad().equal(torch::full({3}, 3.0)));
}

TEST(GradBuckets, CallbacksAndTensorHooksAreCheckedAtEveryUse) {
  struct Target {
    int alive_calls = 0;
  };
  EXPECT_FALSE(AliveRef<Target>().if_alive([](Target&) {})) << "a default ref is dead";

  at::Tensor w = torch::ones({2}, torch::requires_grad());
  for (bool expire : {false, true}) {
    SCOPED_TRACE(expire ? "expired" : "alive");
    Target target;
    auto alive = std::make_unique<Liveness>();
    std::vector<std::string> events;
    at::Tensor loss = (w * 2).sum();
    fsdp::detail::on_gradient_of(
        loss, alive->ref(&target),
        [&](Target& t) {
          ++t.alive_calls;
          events.push_back("hook");
          // From inside backward: the callback runs when this backward ends.
          fsdp::detail::queue_end_of_backward(alive->ref(&t), [&](Target& t2) {
            ++t2.alive_calls;
            events.push_back(w.grad().defined() ? "end, gradient there" : "end, no gradient");
          });
          if (expire) alive->expire();  // gone before the callback runs
        },
        [&] { events.push_back("hook, owner gone"); });
    loss.backward();
    if (expire) {
      EXPECT_EQ(events, (std::vector<std::string>{"hook"}));
      EXPECT_EQ(target.alive_calls, 1);
    } else {
      EXPECT_EQ(events, (std::vector<std::string>{"hook", "end, gradient there"}));
      EXPECT_EQ(target.alive_calls, 2);
    }
    // A second backward through the kept loss after the owner is gone: only on_dead runs.
    events.clear();
    alive.reset();
    loss = (w * 2).sum();  // a fresh graph, hooked under a dead owner below
    Liveness dead;
    auto ref = dead.ref(&target);
    dead.expire();
    fsdp::detail::on_gradient_of(loss, ref, [&](Target&) { events.push_back("hook"); },
                                 [&] { events.push_back("hook, owner gone"); });
    loss.backward();
    EXPECT_EQ(events, (std::vector<std::string>{"hook, owner gone"}));
    w.mutable_grad() = at::Tensor();
  }
}

}  // namespace
