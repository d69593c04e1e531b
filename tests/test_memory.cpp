// Memory accounting: the tracking CPU allocator, the budget, the summaries.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <thread>

#include "fsdp/comm.h"
#include "fsdp/memory.h"
#include "testing.h"

namespace {

class Memory : public ::testing::Test {
 protected:
  void SetUp() override {
    fsdp::install_tracking_allocator();
    fsdp::set_memory_budget(0);
  }
  void TearDown() override { fsdp::set_memory_budget(0); }
};

TEST_F(Memory, InstalledAsTheCpuAllocator) {
  EXPECT_TRUE(fsdp::tracking_allocator_installed());
  fsdp::install_tracking_allocator();  // idempotent
  at::Allocator* a = c10::GetCPUAllocator();
  // A lower-priority allocator (like the default one re-registering) does not replace it.
  c10::SetCPUAllocator(c10::GetDefaultCPUAllocator(), 0);
  EXPECT_EQ(c10::GetCPUAllocator(), a);
}

TEST_F(Memory, CountsAKnownAllocationExactly) {
  auto before = fsdp::memory_stats();
  at::Tensor t = at::empty({1000}, at::kFloat);
  auto during = fsdp::memory_stats();
  EXPECT_EQ(during.current_bytes - before.current_bytes, 4000);
  EXPECT_EQ(during.num_allocs - before.num_allocs, 1);
  EXPECT_GE(during.peak_bytes, during.current_bytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);  // c10's alignment
  t = at::Tensor();
  auto after = fsdp::memory_stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.num_frees - before.num_frees, 1);
}

TEST_F(Memory, PeakTracksTheHighWaterMark) {
  fsdp::reset_peak_memory_stats();
  auto base = fsdp::memory_stats();
  EXPECT_EQ(base.peak_bytes, base.current_bytes);
  EXPECT_EQ(base.num_allocs, 0);
  {
    at::Tensor a = at::empty({1 << 20}, at::kByte);    // 1 MiB
    at::Tensor b = at::empty({1 << 19}, at::kDouble);  // 4 MiB
  }
  at::Tensor c = at::empty({1 << 18}, at::kFloat);  // 1 MiB, after a and b were freed
  auto s = fsdp::memory_stats();
  EXPECT_EQ(s.peak_bytes - base.current_bytes, (1 << 20) + (1 << 19) * 8);
  EXPECT_EQ(s.current_bytes - base.current_bytes, (1 << 18) * 4);
  EXPECT_EQ(s.num_allocs, 3);
  EXPECT_EQ(s.num_frees, 2);
  fsdp::reset_peak_memory_stats();
  EXPECT_EQ(fsdp::memory_stats().peak_bytes, fsdp::memory_stats().current_bytes);
}

// Note [Memory categories]: allocations are charged to the thread's category, frees back to the
// category of the allocation, and the peak's breakdown is the per-category bytes at the peak.
TEST_F(Memory, CategoriesChargeAllocationsAndSplitThePeak) {
  using fsdp::MemoryCategory;
  auto sum = [](const std::array<int64_t, fsdp::kNumMemoryCategories>& v) {
    int64_t total = 0;
    for (int64_t x : v) total += x;
    return total;
  };
  auto idx = [](MemoryCategory c) { return static_cast<size_t>(c); };
  fsdp::reset_peak_memory_stats();
  const auto base = fsdp::memory_stats();
  EXPECT_EQ(sum(base.current_by_category), base.current_bytes);
  EXPECT_EQ(fsdp::current_memory_category(), MemoryCategory::kOther);
  at::Tensor a, b;
  {
    fsdp::MemoryCategoryGuard gathered(MemoryCategory::kGathered);
    a = at::empty({1 << 20}, at::kByte);  // 1 MiB
    {
      fsdp::MemoryCategoryGuard optimizer(MemoryCategory::kOptimizer);
      EXPECT_EQ(fsdp::current_memory_category(), MemoryCategory::kOptimizer);
      b = at::empty({1 << 19}, at::kFloat);  // 2 MiB
    }
    EXPECT_EQ(fsdp::current_memory_category(), MemoryCategory::kGathered);  // restored
  }
  EXPECT_EQ(fsdp::current_memory_category(), MemoryCategory::kOther);
  const auto s = fsdp::memory_stats();
  EXPECT_EQ(s.current_by_category[idx(MemoryCategory::kGathered)] -
                base.current_by_category[idx(MemoryCategory::kGathered)], 1 << 20);
  EXPECT_EQ(s.current_by_category[idx(MemoryCategory::kOptimizer)] -
                base.current_by_category[idx(MemoryCategory::kOptimizer)], 2 << 20);
  EXPECT_EQ(sum(s.current_by_category), s.current_bytes);
  // Freed under another category: charged back to the allocation's.
  {
    fsdp::MemoryCategoryGuard activations(MemoryCategory::kActivations);
    b = at::Tensor();
    at::Tensor c = at::empty({1 << 18}, at::kFloat);  // 1 MiB: below the peak
    EXPECT_EQ(fsdp::memory_stats().current_by_category[idx(MemoryCategory::kActivations)] -
                  base.current_by_category[idx(MemoryCategory::kActivations)], 1 << 20);
  }
  const auto t = fsdp::memory_stats();
  EXPECT_EQ(t.current_by_category[idx(MemoryCategory::kOptimizer)],
            base.current_by_category[idx(MemoryCategory::kOptimizer)]);
  EXPECT_EQ(t.current_by_category[idx(MemoryCategory::kActivations)],
            base.current_by_category[idx(MemoryCategory::kActivations)]);
  EXPECT_EQ(sum(t.current_by_category), t.current_bytes);
  // The peak (a and b alive) and its breakdown, unchanged by the later, smaller allocation.
  EXPECT_EQ(t.peak_bytes - base.current_bytes, 3 << 20);
  EXPECT_EQ(sum(t.peak_by_category), t.peak_bytes);
  EXPECT_EQ(t.peak_by_category[idx(MemoryCategory::kOptimizer)] -
                base.current_by_category[idx(MemoryCategory::kOptimizer)], 2 << 20);
  EXPECT_EQ(t.peak_by_category[idx(MemoryCategory::kGathered)] -
                base.current_by_category[idx(MemoryCategory::kGathered)], 1 << 20);
  EXPECT_EQ(t.peak_by_category[idx(MemoryCategory::kActivations)],
            base.current_by_category[idx(MemoryCategory::kActivations)]);
  auto named = fsdp::by_category_map(t.peak_by_category);
  EXPECT_GE(named.at("optimizer"), 2 << 20);
  EXPECT_EQ(std::string(fsdp::to_string(MemoryCategory::kDequantized)), "dequantized");
  a = at::Tensor();
  fsdp::reset_peak_memory_stats();
  const auto r = fsdp::memory_stats();
  EXPECT_EQ(r.peak_by_category, r.current_by_category);
}

TEST_F(Memory, ResizeAndOpsAreCounted) {
  auto before = fsdp::memory_stats().current_bytes;
  at::Tensor a = at::ones({256}, at::kFloat);
  at::Tensor b = a + a;  // the result storage comes from the allocator too
  EXPECT_EQ(fsdp::memory_stats().current_bytes - before, 2 * 256 * 4);
  a.resize_({512});
  EXPECT_EQ(fsdp::memory_stats().current_bytes - before, 256 * 4 + 512 * 4);
}

TEST_F(Memory, CountsAreThreadSafe) {
  auto before = fsdp::memory_stats();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([] {
      for (int i = 0; i < 2000; ++i) at::Tensor x = at::empty({16 + i % 7}, at::kFloat);
    });
  for (auto& t : threads) t.join();
  auto after = fsdp::memory_stats();
  EXPECT_EQ(after.current_bytes, before.current_bytes);
  EXPECT_EQ(after.num_allocs - before.num_allocs, 8000);
  EXPECT_EQ(after.num_frees - before.num_frees, 8000);
}

TEST_F(Memory, BudgetErrorFiresNamesTheNumbersAndIsCatchable) {
  at::Tensor held = at::empty({1 << 20}, at::kFloat);  // 4 MiB in use
  int64_t in_use = fsdp::memory_stats().current_bytes;
  fsdp::set_memory_budget(in_use + (8 << 20));  // 8 MiB of headroom
  EXPECT_EQ(fsdp::memory_budget(), in_use + (8 << 20));
  try {
    at::Tensor too_big = at::empty({4 << 20}, at::kFloat);  // 16 MiB
    ADD_FAILURE() << "allocation beyond the budget succeeded";
  } catch (const fsdp::OutOfMemoryError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("allocating 16.00 MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("with " + fsdp::format_bytes(in_use) + " in use"), std::string::npos) << msg;
    EXPECT_NE(msg.find("budget of " + fsdp::format_bytes(in_use + (8 << 20))), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("FSDP_MEMORY_BUDGET"), std::string::npos) << msg;
    EXPECT_NE(msg.find("sharding strategy"), std::string::npos) << msg;
  }
  // The refused allocation left no trace, and the process goes on within the budget.
  EXPECT_EQ(fsdp::memory_stats().current_bytes, in_use);
  at::Tensor fits = at::empty({1 << 20}, at::kFloat);  // 4 MiB
  EXPECT_EQ(fsdp::memory_stats().current_bytes, in_use + (4 << 20));
  // Also catchable as a plain c10::Error, through an op.
  EXPECT_THROW(at::zeros({8 << 20}, at::kFloat), c10::Error);
  fsdp::set_memory_budget(0);
  at::Tensor big = at::empty({4 << 20}, at::kFloat);
  EXPECT_EQ(big.numel(), 4 << 20);
}

TEST_F(Memory, NegativeBudgetIsRejected) {
  EXPECT_THROW(fsdp::set_memory_budget(-1), c10::Error);
}

// Run by Memory.BudgetFromTheEnvironment in a fresh process (the budget is read on install).
TEST(MemoryEnv, DISABLED_ReadsTheBudget) {
  fsdp::install_tracking_allocator();
  EXPECT_EQ(fsdp::memory_budget(), 64 << 20);
  try {
    at::Tensor t = at::empty({80 << 20}, at::kByte);
    ADD_FAILURE() << "80 MiB allocated under a 64 MiB budget";
  } catch (const fsdp::OutOfMemoryError& e) {
    std::printf("message: %s\n", e.what());
  }
}

TEST_F(Memory, BudgetFromTheEnvironment) {
  auto self = fsdp::testing::run_process(
      {"/proc/self/exe", "--gtest_filter=MemoryEnv.DISABLED_ReadsTheBudget",
       "--gtest_also_run_disabled_tests"},
      {{"FSDP_MEMORY_BUDGET", "64MiB"}}, 120);
  EXPECT_EQ(self.exit_code, 0) << self.out << self.err;
  EXPECT_NE(self.out.find("message: out of memory: allocating 80.00 MiB with "), std::string::npos)
      << self.out;
  auto bad = fsdp::testing::run_process(
      {"/proc/self/exe", "--gtest_filter=MemoryEnv.DISABLED_ReadsTheBudget",
       "--gtest_also_run_disabled_tests"},
      {{"FSDP_MEMORY_BUDGET", "lots"}}, 120);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE((bad.out + bad.err).find("FSDP_MEMORY_BUDGET='lots'"), std::string::npos)
      << bad.out << bad.err;
}

TEST_F(Memory, RssIsReported) {
  EXPECT_GT(fsdp::current_rss_bytes(), 0);
  EXPECT_GE(fsdp::peak_rss_bytes(), fsdp::current_rss_bytes() / 2);
  // Touching 32 MiB raises the peak RSS at least to what is now resident.
  at::Tensor t = at::ones({8 << 20}, at::kFloat);
  EXPECT_GE(fsdp::peak_rss_bytes(), fsdp::current_rss_bytes() - (1 << 20));
  EXPECT_GE(fsdp::current_rss_bytes(), 32 << 20);
}

TEST_F(Memory, SummaryTable) {
  fsdp::reset_peak_memory_stats();
  at::Tensor t = at::empty({3 << 20}, at::kByte);
  fsdp::set_memory_budget(int64_t(12) << 30);
  std::string s = fsdp::memory_summary();
  EXPECT_NE(s.find("peak allocated"), std::string::npos) << s;
  EXPECT_NE(s.find("peak RSS"), std::string::npos) << s;
  EXPECT_NE(s.find("12.00 GiB"), std::string::npos) << s;
  EXPECT_NE(s.find(fsdp::format_bytes(fsdp::memory_stats().peak_bytes)), std::string::npos) << s;
}

TEST(MemoryRanks, GatherAndSummaryOverTheGroup) {
  for (int world : {1, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [](fsdp::ProcessGroup& pg) {
      fsdp::install_tracking_allocator();
      // Rank r holds (r+1) MiB more than at the start.
      at::Tensor hold = at::empty({(pg.rank() + 1) << 20}, at::kByte);
      fsdp::RankMemory m = fsdp::gather_memory(pg);
      ASSERT_EQ(static_cast<int>(m.peak_bytes.size()), pg.size());
      for (int r = 0; r < pg.size(); ++r) {
        EXPECT_GE(m.current_bytes[r], int64_t(r + 1) << 20);
        EXPECT_GE(m.peak_bytes[r], m.current_bytes[r]);
        EXPECT_GT(m.peak_rss_bytes[r], 0);
      }
      EXPECT_EQ(m.current_bytes[pg.rank()] >= (int64_t(pg.rank() + 1) << 20), true);
      std::string table = fsdp::memory_summary(pg);
      if (pg.rank() == 0) {
        for (int r = 0; r < pg.size(); ++r)
          EXPECT_NE(table.find("\n" + std::to_string(r) + " "), std::string::npos) << table;
        EXPECT_NE(table.find("peak allocated"), std::string::npos) << table;
      } else {
        EXPECT_EQ(table, "");
      }
    });
  }
}

}  // namespace
