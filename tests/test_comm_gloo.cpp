// The gloo backend calls Debian's libgloo directly; libtorch exports a private copy of Gloo, so
// the link order decides which one our calls reach (Note [Gloo backend] in docs/design.md).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>

#include "fsdp/comm.h"
#include "testing.h"

namespace {

TEST(GlooBackend, ProgramLinkedTorchFirstFailsWithTheLinkOrderError) {
  const std::string helper = std::string(FSDP_BIN_DIR) + "/../tests/helper_gloo_link_order";
  auto res = fsdp::testing::run_process({helper}, {}, 60);
  ASSERT_EQ(res.exit_code, 3) << "the gloo world must refuse to start\n" << res.out << res.err;
  EXPECT_NE(res.out.find("libtorch"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("link order"), std::string::npos) << res.out;
  EXPECT_NE(res.out.find("Note [Gloo backend]"), std::string::npos) << res.out;
}

// Every op through Gloo's own algorithms at an odd world size, with a dtype that Gloo reduces
// natively (fp32) and one it only moves (bf16): values are checked exactly.
TEST(GlooBackend, NativeOpsAtWorld3) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup& pg) {
    const int r = pg.rank();
    auto in = at::arange(5, at::kFloat) + 10 * r;
    auto gathered = at::empty({15}, at::kFloat);
    pg.all_gather_into_tensor(gathered, in);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(gathered.narrow(0, 5 * i, 5).equal(at::arange(5, at::kFloat) + 10 * i));
    }
    auto sum = in.clone();
    pg.all_reduce(sum, fsdp::ReduceOp::kSum);
    EXPECT_TRUE(sum.equal(at::arange(5, at::kFloat) * 3 + 30));
    auto mx = in.to(at::kLong);
    pg.all_reduce(mx, fsdp::ReduceOp::kMax);
    EXPECT_TRUE(mx.equal((at::arange(5, at::kFloat) + 20).to(at::kLong)));
    auto b = r == 1 ? at::full({7}, 0.5, at::kBFloat16) : at::zeros({7}, at::kBFloat16);
    pg.broadcast(b, 1);
    EXPECT_TRUE(b.equal(at::full({7}, 0.5, at::kBFloat16)));
    auto a2a_in = at::arange(6, at::kInt) + 100 * r;  // chunk j goes to rank j
    auto a2a_out = at::empty({6}, at::kInt);
    pg.all_to_all(a2a_out, a2a_in);
    for (int j = 0; j < 3; ++j) {
      EXPECT_EQ(a2a_out[2 * j].item<int>(), 100 * j + 2 * r);
      EXPECT_EQ(a2a_out[2 * j + 1].item<int>(), 100 * j + 2 * r + 1);
    }
    pg.barrier();
  });
}

}  // namespace
