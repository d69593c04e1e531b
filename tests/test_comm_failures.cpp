// Collective timeouts name the op, its sequence number and the missing ranks; FSDP_DEBUG=detail
// names both sides of a mismatched call.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "fsdp/comm.h"
#include "testing.h"

namespace {

using fsdp::ProcessGroup;
using fsdp::ReduceOp;

struct ScopedSetenv {
  ScopedSetenv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedSetenv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  const char* name_;
  bool had_ = false;
  std::string old_;
};

class CommFailures : public ::testing::TestWithParam<std::string> {};

TEST_P(CommFailures, TimeoutNamesOpSequenceAndMissingRank) {
  ScopedSetenv timeout("FSDP_COLLECTIVE_TIMEOUT_S", "2");
  fsdp::testing::run_ranks(3, GetParam(), [](ProcessGroup& pg) {
    pg.barrier();  // #1 on every rank
    auto t = at::ones({16});
    if (pg.rank() == 2) {
      // Skips all_reduce #2 while the others wait for it.
      std::this_thread::sleep_for(std::chrono::seconds(5));
      // An MPI collective cannot be abandoned, and ranks 0 and 1 must reach MPI_Finalize:
      // join late so theirs completes. Gloo ranks just leave.
      if (pg.backend() == "mpi") pg.all_reduce(t);
      return;
    }
    std::string msg = "<no error>";
    try {
      pg.all_reduce(t);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    const std::string expected = "all_reduce #2 on group world (" + pg.backend() +
                                 ") timed out after 2 s: ranks 2 did not join (rank 2 last "
                                 "called barrier #1)";
    EXPECT_NE(msg.find(expected), std::string::npos) << "error was: " << msg;
    // The group is poisoned: later calls fail at once, citing the first error.
    std::string again = "<no error>";
    try {
      pg.barrier();
    } catch (const std::exception& e) {
      again = e.what();
    }
    EXPECT_NE(again.find("unusable after an earlier failure"), std::string::npos) << again;
  });
}

// Work queued behind a hung collective (gloo: same group; mpi: another group sharing the one
// MPI thread) fails with the hung collective's timeout instead of waiting forever.
TEST_P(CommFailures, WorkQueuedBehindAHungCollectiveFails) {
  ScopedSetenv timeout("FSDP_COLLECTIVE_TIMEOUT_S", "2");
  fsdp::testing::run_ranks(2, GetParam(), [](ProcessGroup& pg) {
    auto sub = pg.new_subgroup({0, 1});  // world #1
    pg.barrier();                        // world #2
    auto t = at::ones({8});
    if (pg.rank() == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(5));
      if (pg.backend() == "mpi") pg.all_reduce(t);  // join late so rank 0 can finalize
      return;
    }
    auto hung = pg.all_reduce_async(t, ReduceOp::kSum);  // world #3, never waited
    ProcessGroup& next = pg.backend() == "mpi" ? *sub : pg;
    std::string msg = "<no error>";
    try {
      next.barrier();
    } catch (const std::exception& e) {
      msg = e.what();
    }
    const std::string expected = "all_reduce #3 on group world (" + pg.backend() +
                                 ") timed out after 2 s: ranks 1 did not join";
    EXPECT_NE(msg.find(expected), std::string::npos) << "error was: " << msg;
  });
}

TEST_P(CommFailures, DebugDetailNamesBothSidesOfAMismatch) {
  ScopedSetenv debug("FSDP_DEBUG", "detail");
  fsdp::testing::run_ranks(2, GetParam(), [](ProcessGroup& pg) {
    std::string msg = "<no error>";
    try {
      if (pg.rank() == 0) {
        auto in = at::zeros({1024});
        auto out = at::empty({2048});
        pg.all_gather_into_tensor(out, in);
      } else {
        auto t = at::zeros({512}, at::kBFloat16);
        pg.all_reduce(t);
      }
    } catch (const std::exception& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("rank 0 called all_gather #1 [1024] float32 but rank 1 called "
                       "all_reduce #1 [512] bfloat16 sum"),
              std::string::npos)
        << "error was: " << msg;
    // Nothing moved, so the group stays usable, and matching calls pass the check.
    auto t = at::full({3}, static_cast<float>(pg.rank()));
    pg.all_reduce(t, ReduceOp::kSum);
    EXPECT_TRUE(at::equal(t, at::full({3}, 1.0f)));
  });
}

INSTANTIATE_TEST_SUITE_P(Backends, CommFailures, ::testing::Values("gloo", "mpi"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
