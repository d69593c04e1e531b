// Note [Block cache]: large freed blocks are reused, bounded by the limit, invisible to the
// tensor accounting; and a process that reuses them faults fewer pages in.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <sys/resource.h>

#include "fsdp/memory.h"
#include "memory/block_cache.h"

namespace {

using fsdp::detail::block_cache_stats;
using fsdp::detail::set_block_cache_limit;

class BlockCache : public ::testing::Test {
 protected:
  void SetUp() override {
    fsdp::install_tracking_allocator();
    set_block_cache_limit(int64_t{64} << 20);
  }
  void TearDown() override { set_block_cache_limit(int64_t{512} << 20); }
};

constexpr int64_t kFloats2MiB = (int64_t{2} << 20) / 4;

TEST_F(BlockCache, AFreedLargeBlockIsReusedAndTensorBytesDoNotSeeIt) {
  void* first = nullptr;
  const auto before = fsdp::memory_stats();
  {
    at::Tensor t = at::empty({kFloats2MiB}, at::kFloat);
    first = t.data_ptr();
  }
  const auto stats = block_cache_stats();
  EXPECT_GE(stats.cached_bytes, int64_t{2} << 20);
  // The cached block is not a live tensor.
  EXPECT_EQ(fsdp::memory_stats().current_bytes, before.current_bytes);
  at::Tensor again = at::empty({kFloats2MiB}, at::kFloat);
  EXPECT_EQ(again.data_ptr(), first);
  EXPECT_EQ(block_cache_stats().hits, stats.hits + 1);
  EXPECT_EQ(fsdp::memory_stats().current_bytes - before.current_bytes, kFloats2MiB * 4);
}

TEST_F(BlockCache, SmallBlocksAndOtherSizesAreNotServedFromIt) {
  { at::Tensor t = at::empty({kFloats2MiB}, at::kFloat); }
  const auto stats = block_cache_stats();
  at::Tensor small = at::empty({1000}, at::kFloat);
  at::Tensor other = at::empty({kFloats2MiB * 2}, at::kFloat);
  EXPECT_EQ(block_cache_stats().hits, stats.hits);
  EXPECT_EQ(block_cache_stats().misses, stats.misses + 1);  // `other`; `small` bypasses it
}

TEST_F(BlockCache, TheLimitBoundsWhatIsHeldOldestGoesFirst) {
  set_block_cache_limit(int64_t{5} << 20);  // room for two 2 MiB blocks
  void* ptrs[3];
  {
    at::Tensor a = at::empty({kFloats2MiB}, at::kFloat);
    at::Tensor b = at::empty({kFloats2MiB}, at::kFloat);
    at::Tensor c = at::empty({kFloats2MiB}, at::kFloat);
    ptrs[0] = a.data_ptr(), ptrs[1] = b.data_ptr(), ptrs[2] = c.data_ptr();
  }  // freed c, b, a (reverse order of declaration): c is the oldest
  EXPECT_LE(block_cache_stats().cached_bytes, int64_t{5} << 20);
  at::Tensor x = at::empty({kFloats2MiB}, at::kFloat);
  at::Tensor y = at::empty({kFloats2MiB}, at::kFloat);
  // The two kept are a and b, most recently freed first.
  EXPECT_EQ(x.data_ptr(), ptrs[0]);
  EXPECT_EQ(y.data_ptr(), ptrs[1]);
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
  set_block_cache_limit(0);  // off: frees and keeps nothing
  { at::Tensor z = at::empty({kFloats2MiB}, at::kFloat); }
  EXPECT_EQ(block_cache_stats().cached_bytes, 0);
}

int64_t minor_faults() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// What the cache is for: the same 64 MiB buffer allocated, written and freed 10 times.
int64_t faults_of_ten_steps() {
  const int64_t before = minor_faults();
  for (int i = 0; i < 10; ++i) {
    at::Tensor t = at::empty({int64_t{16} << 20}, at::kFloat);
    t.fill_(1.0f);
  }
  return minor_faults() - before;
}

TEST_F(BlockCache, ReuseAvoidsThePageFaultsOfFreshMemory) {
  set_block_cache_limit(0);
  const int64_t without = faults_of_ten_steps();
  set_block_cache_limit(int64_t{128} << 20);
  const int64_t with = faults_of_ten_steps();
  // 64 MiB = 16384 pages (fewer with transparent huge pages): fresh memory faults every step,
  // a cached block only the first time.
  EXPECT_LT(with * 4, without) << "with cache " << with << " faults, without " << without;
}

}  // namespace
