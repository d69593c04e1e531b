// Every collective x backend x dtype at world 1..4, with sizes that do not divide evenly, against
// expected values computed locally; async overlap; byte counters.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <tuple>

#include "fsdp/comm.h"
#include "testing.h"

namespace {

using fsdp::ProcessGroup;
using fsdp::ReduceOp;

// Element i on rank r: small integers in [-5, 8], exact in every dtype, different per rank.
at::Tensor rank_values(int r, int64_t n, at::ScalarType dtype, int64_t salt = 0) {
  auto i = at::arange(n, at::kLong);
  return ((i * 7 + r * 3 + salt) % 11 - 5 + r).to(dtype);
}

// The documented semantics, computed here for all ranks: sum/max in fp32 (int64 for int64),
// AVG = sum / world (fp32 division, or truncating integer division), one rounding at the end.
at::Tensor expected_reduce(int world, int64_t n, at::ScalarType dtype, ReduceOp op,
                           int64_t salt) {
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/false);
  const auto acc_type = integral ? at::kLong : at::kFloat;
  at::Tensor acc;
  for (int r = 0; r < world; ++r) {
    auto x = rank_values(r, n, dtype, salt).to(acc_type);
    if (r == 0) {
      acc = x.clone();
    } else if (op == ReduceOp::kMax) {
      acc = at::maximum(acc, x);
    } else {
      acc = acc + x;
    }
  }
  if (op == ReduceOp::kAvg) {
    acc = integral ? at::div(acc, world, "trunc") : at::div(acc, static_cast<double>(world));
  }
  return acc.to(dtype);
}

std::string name_of(at::ScalarType t) { return c10::toString(t); }

void check_every_op(ProcessGroup& pg) {
  const int w = pg.size();
  const int r = pg.rank();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf, at::kLong}) {
    SCOPED_TRACE("dtype " + name_of(dtype));
    {  // all-gather: 7 elements per rank
      auto in = rank_values(r, 7, dtype);
      auto out = at::empty({7 * w}, in.options());
      pg.all_gather_into_tensor(out, in);
      for (int q = 0; q < w; ++q) {
        EXPECT_TRUE(at::equal(out.narrow(0, q * 7, 7), rank_values(q, 7, dtype)))
            << "all_gather chunk " << q;
      }
    }
    {  // in-place all-gather: the input is this rank's chunk of the output (FSDP's copy-in)
      auto out = at::zeros({7 * w}, at::TensorOptions().dtype(dtype));
      out.narrow(0, r * 7, 7).copy_(rank_values(r, 7, dtype, 9));
      pg.all_gather_into_tensor(out, out.narrow(0, r * 7, 7));
      for (int q = 0; q < w; ++q) {
        EXPECT_TRUE(at::equal(out.narrow(0, q * 7, 7), rank_values(q, 7, dtype, 9)))
            << "in-place all_gather chunk " << q;
      }
    }
    for (auto op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      SCOPED_TRACE(std::string("op ") + fsdp::to_string(op));
      const int64_t salt = static_cast<int64_t>(op) + 1;
      {  // reduce-scatter: 5 elements per rank
        auto in = rank_values(r, 5 * w, dtype, salt);
        auto out = at::empty({5}, in.options());
        pg.reduce_scatter_tensor(out, in, op);
        auto expected = expected_reduce(w, 5 * w, dtype, op, salt).narrow(0, r * 5, 5);
        EXPECT_TRUE(at::equal(out, expected)) << "reduce_scatter\n" << out << "\n" << expected;
      }
      {  // all-reduce: 1003 = 17 * 59 elements, divisible by none of 2, 3, 4
        auto t = rank_values(r, 1003, dtype, salt);
        pg.all_reduce(t, op);
        auto expected = expected_reduce(w, 1003, dtype, op, salt);
        EXPECT_TRUE(at::equal(t, expected))
            << "all_reduce: " << (t != expected).sum().item<int64_t>() << " elements differ";
      }
    }
    for (int root = 0; root < w; ++root) {  // broadcast: 7 elements from every root
      auto t = rank_values(r, 7, dtype, 100 + root);
      pg.broadcast(t, root);
      EXPECT_TRUE(at::equal(t, rank_values(root, 7, dtype, 100 + root))) << "broadcast root "
                                                                          << root;
    }
    {  // all-to-all: 3 elements to each rank
      auto in = rank_values(r, 3 * w, dtype);
      auto out = at::empty_like(in);
      pg.all_to_all(out, in);
      for (int q = 0; q < w; ++q) {
        EXPECT_TRUE(at::equal(out.narrow(0, q * 3, 3), rank_values(q, 3 * w, dtype).narrow(0, r * 3, 3)))
            << "all_to_all chunk from rank " << q;
      }
    }
  }
  pg.barrier();
  // One large uneven case per path: native fp32 and emulated bf16.
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto t = rank_values(r, 1000003, dtype, 1);
    pg.all_reduce(t, ReduceOp::kSum);
    EXPECT_TRUE(at::equal(t, expected_reduce(w, 1000003, dtype, ReduceOp::kSum, 1)))
        << "all_reduce of 1000003 " << name_of(dtype);
  }
}

class CommCollectives : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CommCollectives, EveryOpEveryDtype) {
  const std::string backend = std::get<0>(GetParam());
  const int world = std::get<1>(GetParam());
  fsdp::testing::run_ranks(world, backend, [&](ProcessGroup& pg) {
    EXPECT_EQ(pg.size(), world);
    EXPECT_EQ(pg.backend(), backend);
    check_every_op(pg);
  });
}

INSTANTIATE_TEST_SUITE_P(
    Backends, CommCollectives,
    ::testing::Combine(::testing::Values(std::string("gloo"), std::string("mpi")),
                       ::testing::Values(1, 2, 3, 4)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_world" + std::to_string(std::get<1>(info.param));
    });

// Start three collectives, compute while they run, wait out of order: same results as blocking.
void check_async_overlap(ProcessGroup& pg) {
  const int w = pg.size();
  const int r = pg.rank();
  auto ag_in = rank_values(r, 4096, at::kBFloat16);
  auto ag_out = at::empty({4096 * w}, ag_in.options());
  auto rs_in = rank_values(r, 1000 * w, at::kFloat, 2);
  auto rs_out = at::empty({1000}, rs_in.options());
  auto ar = rank_values(r, 10001, at::kHalf, 3);
  auto w1 = pg.all_gather_into_tensor_async(ag_out, ag_in);
  auto w2 = pg.reduce_scatter_tensor_async(rs_out, rs_in, ReduceOp::kAvg);
  auto w3 = pg.all_reduce_async(ar, ReduceOp::kSum);
  auto a = at::rand({192, 192}) / 192;
  auto c = at::eye(192);
  for (int i = 0; i < 8; ++i) c = at::mm(c, a) + at::eye(192);  // compute meanwhile
  w3->wait();
  w1->wait();
  w2->wait();
  w2->wait();  // waiting twice is fine
  EXPECT_TRUE(w1->is_completed() && w2->is_completed() && w3->is_completed());
  EXPECT_TRUE(at::isfinite(c).all().item<bool>());
  for (int q = 0; q < w; ++q) {
    EXPECT_TRUE(at::equal(ag_out.narrow(0, q * 4096, 4096), rank_values(q, 4096, at::kBFloat16)));
  }
  EXPECT_TRUE(at::equal(rs_out, expected_reduce(w, 1000 * w, at::kFloat, ReduceOp::kAvg, 2)
                                    .narrow(0, r * 1000, 1000)));
  EXPECT_TRUE(at::equal(ar, expected_reduce(w, 10001, at::kHalf, ReduceOp::kSum, 3)));
}

class CommAsync : public ::testing::TestWithParam<std::string> {};

TEST_P(CommAsync, OverlapWithComputeGivesSameResults) {
  fsdp::testing::run_ranks(3, GetParam(), [](ProcessGroup& pg) { check_async_overlap(pg); });
}

// A finished collective keeps no reference to the tensors it was given: once wait() returns, the
// caller's handles are the only ones, so dropping them frees the memory. FSDP drops each
// all-gather's input right after the wait, before its copy-out allocates the unsharded
// parameters; a reference the comm thread kept a little longer put that input on every peak.
TEST_P(CommAsync, WaitReleasesTheTensorsItWasGiven) {
  fsdp::testing::run_ranks(2, GetParam(), [](ProcessGroup& pg) {
    for (int i = 0; i < 20; ++i) {
      at::Tensor in = at::ones({4096});
      at::Tensor out = at::empty({2 * 4096});
      pg.all_gather_into_tensor_async(out, in)->wait();
      EXPECT_EQ(in.use_count(), 1) << "all-gather input, iteration " << i;
      EXPECT_EQ(out.use_count(), 1) << "all-gather output, iteration " << i;
      at::Tensor rs_in = at::ones({2 * 4096});
      at::Tensor rs_out = at::empty({4096});
      pg.reduce_scatter_tensor_async(rs_out, rs_in, ReduceOp::kSum)->wait();
      EXPECT_EQ(rs_in.use_count(), 1) << "reduce-scatter input, iteration " << i;
      EXPECT_EQ(rs_out.use_count(), 1) << "reduce-scatter output, iteration " << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, CommAsync, ::testing::Values("gloo", "mpi"),
                         [](const auto& info) { return std::string(info.param); });

// Counters count input bytes per op: a bf16 all-gather moves half the bytes of an fp32 one.
TEST(CommCounters, CountInputBytesPerOp) {
  fsdp::testing::run_ranks(2, "gloo", [](ProcessGroup& pg) {
    pg.reset_counters();
    auto f32 = at::ones({1000});
    auto f32_out = at::empty({2000});
    pg.all_gather_into_tensor(f32_out, f32);
    const int64_t fp32_bytes = pg.counters().all_gather_bytes;
    auto b16 = at::ones({1000}, at::kBFloat16);
    auto b16_out = at::empty({2000}, at::kBFloat16);
    pg.all_gather_into_tensor(b16_out, b16);
    EXPECT_EQ(fp32_bytes, 4000);
    EXPECT_EQ(pg.counters().all_gather_bytes - fp32_bytes, 2000);
    auto t = at::ones({10}, at::kLong);
    pg.all_reduce(t);
    auto rs_out = at::empty({5});
    pg.reduce_scatter_tensor(rs_out, at::ones({10}), ReduceOp::kSum);
    EXPECT_EQ(pg.counters().all_reduce_bytes, 80);
    EXPECT_EQ(pg.counters().reduce_scatter_bytes, 40);
    EXPECT_EQ(pg.counters().calls, 4);
    pg.reset_counters();
    EXPECT_EQ(pg.counters().calls, 0);
  });
}

}  // namespace
