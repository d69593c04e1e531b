// Sub-groups, the 2-D mesh for hybrid sharding, and argument errors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>

#include "fsdp/comm.h"
#include "testing.h"

namespace {

using fsdp::ProcessGroup;
using fsdp::ReduceOp;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no error>";
}

#define EXPECT_ERROR_HAS(stmt, text)                                            \
  do {                                                                          \
    std::string msg_ = error_of([&] { stmt; });                                 \
    EXPECT_NE(msg_.find(text), std::string::npos) << "error was: " << msg_;     \
  } while (0)

class CommGroups : public ::testing::TestWithParam<std::string> {};

TEST_P(CommGroups, SubgroupAndTwoByTwoMesh) {
  fsdp::testing::run_ranks(4, GetParam(), [](ProcessGroup& pg) {
    const int r = pg.rank();
    auto world = fsdp::world_group();
    ASSERT_TRUE(world != nullptr);
    ASSERT_EQ(world.get(), &pg);

    // A subgroup of world ranks 1..3; rank 0 is not a member.
    auto sub = pg.new_subgroup({1, 2, 3});
    if (r == 0) {
      EXPECT_EQ(sub, nullptr);
    } else {
      ASSERT_NE(sub, nullptr);
      EXPECT_EQ(sub->size(), 3);
      EXPECT_EQ(sub->rank(), r - 1);
      EXPECT_EQ(sub->world_ranks(), (std::vector<int>{1, 2, 3}));
      auto t = at::full({5}, static_cast<float>(r));
      sub->all_reduce(t, ReduceOp::kSum);
      EXPECT_TRUE(at::equal(t, at::full({5}, 6.0f)));
      // bf16 reduce-scatter on the subgroup: chunk i of rank q's input holds q * 10 + i.
      auto in = (at::arange(9, at::kFloat).div(3, "floor") + 10 * r).to(at::kBFloat16);
      auto out = at::empty({3}, at::kBFloat16);
      sub->reduce_scatter_tensor(out, in, ReduceOp::kSum);
      float expected = 3.0f * (r - 1) + 10.0f * (1 + 2 + 3);
      EXPECT_TRUE(at::equal(out, at::full({3}, expected, at::kBFloat16))) << out;
      sub->broadcast(t, /*root=*/2);  // group rank 2 = world rank 3
    }
    // The world group is unaffected.
    auto all = at::ones({3}, at::kLong);
    pg.all_reduce(all);
    EXPECT_TRUE(at::equal(all, at::full({3}, 4, at::kLong)));

    // 2x2 mesh: shard groups {0,1}, {2,3}; replicate groups {0,2}, {1,3}.
    auto mesh = fsdp::make_2d_mesh(world, 2);
    EXPECT_EQ(mesh.shard_size, 2);
    EXPECT_EQ(mesh.replicate_size, 2);
    const int base = r / 2 * 2;
    EXPECT_EQ(mesh.shard_group->world_ranks(), (std::vector<int>{base, base + 1}));
    EXPECT_EQ(mesh.replicate_group->world_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
    EXPECT_EQ(mesh.shard_group->rank(), r % 2);
    EXPECT_EQ(mesh.replicate_group->rank(), r / 2);
    // HSDP gradient pattern: reduce-scatter in the shard group, all-reduce the shard across
    // the replicate group; issued async on both groups, waited together.
    auto grad = (at::arange(8, at::kFloat) * (r + 1)).to(at::kBFloat16);  // (8,)
    auto shard = at::empty({4}, at::kBFloat16);
    auto w1 = mesh.shard_group->reduce_scatter_tensor_async(shard, grad, ReduceOp::kAvg);
    auto rep = at::full({2}, static_cast<float>(r));
    auto w2 = mesh.replicate_group->all_reduce_async(rep, ReduceOp::kMax);
    w1->wait();
    w2->wait();
    // avg over (base+1, base+2) multipliers of arange chunk r%2
    auto chunk = at::arange(8, at::kFloat).narrow(0, (r % 2) * 4, 4);
    auto expected = (chunk * (base + 1) + chunk * (base + 2)) / 2;
    EXPECT_TRUE(at::equal(shard, expected.to(at::kBFloat16))) << shard;
    mesh.shard_group->all_reduce(shard, ReduceOp::kSum);  // still usable
    mesh.replicate_group->all_reduce(shard, ReduceOp::kSum);
    EXPECT_TRUE(at::equal(rep, at::full({2}, static_cast<float>(r % 2 + 2))));
    pg.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, CommGroups, ::testing::Values("gloo", "mpi"),
                         [](const auto& info) { return std::string(info.param); });

TEST(CommMesh, NeedsWorldDivisibleByShardSize) {
  fsdp::testing::run_ranks(3, "gloo", [](ProcessGroup& pg) {
    EXPECT_ERROR_HAS(fsdp::make_2d_mesh(fsdp::world_group(), 2),
                     "world size 3 is not divisible by shard_size 2; choose one of: 1, 3");
    auto mesh = fsdp::make_2d_mesh(fsdp::world_group(), 3);  // one shard group, replicas of 1
    EXPECT_EQ(mesh.replicate_group->size(), 1);
    EXPECT_EQ(mesh.shard_group->size(), 3);
    auto t = at::full({4}, 1.0f);
    mesh.replicate_group->all_reduce(t, ReduceOp::kAvg);
    mesh.shard_group->all_reduce(t, ReduceOp::kSum);
    EXPECT_TRUE(at::equal(t, at::full({4}, 3.0f)));
  });
}

// World 1 needs no environment and no network.
TEST(CommInit, WorldOneWithoutEnvironment) {
  fsdp::ProcessGroupOptions options;
  options.backend = "gloo";
  options.world_size = 1;
  options.rank = 0;
  auto pg = fsdp::init_process_group(options);
  EXPECT_EQ(fsdp::world_group(), pg);
  EXPECT_EQ(pg->size(), 1);
  auto in = at::arange(6, at::kBFloat16);
  auto out = at::empty({6}, at::kBFloat16);
  pg->reduce_scatter_tensor(out, in, ReduceOp::kAvg);
  EXPECT_TRUE(at::equal(out, in));
  auto mesh = fsdp::make_2d_mesh(pg, 1);
  EXPECT_EQ(mesh.shard_group->size(), 1);
  auto w = pg->all_reduce_async(in, ReduceOp::kMax);
  EXPECT_TRUE(w->is_completed());
  fsdp::destroy_process_group();
  EXPECT_EQ(fsdp::world_group(), nullptr);
}

TEST(CommInit, UnknownBackendListsValidOnes) {
  fsdp::ProcessGroupOptions options;
  options.backend = "ucc";
  EXPECT_ERROR_HAS(fsdp::init_process_group(options),
                   "unknown backend 'ucc'; valid backends: gloo, mpi, nccl (CUDA builds), auto");
  // nccl is known: in a CPU build it says how to get a CUDA build (tests/test_accelerator.cpp).
}

TEST(CommInit, BadArgumentsSayWhatToDo) {
  fsdp::ProcessGroupOptions options;
  options.backend = "gloo";
  options.world_size = 1;
  options.rank = 0;
  auto pg = fsdp::init_process_group(options);
  auto in = at::ones({4});
  EXPECT_ERROR_HAS(pg->all_gather_into_tensor(at::empty({5}), in),
                   "output has 5 elements but the group of 1 ranks needs 1 x input (4) = 4");
  EXPECT_ERROR_HAS(pg->all_reduce(at::ones({2}, at::kBool)), "cannot reduce bool tensors");
  EXPECT_ERROR_HAS(pg->broadcast(in, 1), "root 1 is not a rank of group world");
  EXPECT_ERROR_HAS(pg->all_gather_into_tensor(at::empty({4}, at::kHalf), in),
                   "output is float16 but input is float32");
  EXPECT_ERROR_HAS(pg->all_reduce(at::ones({4, 4}).t()), "must be contiguous");
  fsdp::destroy_process_group();
}

}  // namespace
