// Threads per rank from the free cores (Note [Threads per rank] in src/comm/thread_choice.cpp):
// the choice, its line, and the /proc/stat arithmetic it is measured with. Real launches that
// print the line and run with the count: tests/test_launcher.cpp.
#include <gtest/gtest.h>

#include "comm/thread_choice.h"

namespace {

using fsdp::detail::busy_cores_between;
using fsdp::detail::choose_threads;
using fsdp::detail::CpuTimes;
using fsdp::detail::describe;
using fsdp::detail::parse_proc_stat;
using fsdp::detail::ThreadFacts;

ThreadFacts facts(int cores, int ranks, std::optional<double> busy,
                  std::optional<int> user = std::nullopt) {
  ThreadFacts f;
  f.cores = cores;
  f.local_ranks = ranks;
  f.busy_cores = busy;
  f.user_threads = user;
  return f;
}

int threads(const ThreadFacts& f) { return choose_threads(f).threads; }

TEST(ThreadChoice, IdleMachineSharesEveryCore) {
  EXPECT_EQ(threads(facts(2, 1, 0.0)), 2);
  EXPECT_EQ(threads(facts(16, 2, 0.0)), 8);
  EXPECT_EQ(threads(facts(16, 3, 0.0)), 5);
  // A little background noise does not cost a core.
  EXPECT_EQ(threads(facts(2, 1, 0.3)), 2);
  EXPECT_EQ(threads(facts(16, 4, 0.4)), 4);
}

TEST(ThreadChoice, BusyCoresAreLeftToTheirWork) {
  // One process, two cores, one kept busy by other work (a build, a busy loop).
  EXPECT_EQ(threads(facts(2, 1, 1.0)), 1);
  EXPECT_EQ(threads(facts(2, 1, 1.6)), 1);
  EXPECT_EQ(threads(facts(2, 2, 1.6)), 1);
  EXPECT_EQ(threads(facts(16, 2, 6.0)), 5);
  EXPECT_EQ(threads(facts(16, 3, 4.2)), 4);  // 12 free cores / 3 ranks
  // Whole cores free, divided down: 5 free cores for 3 ranks is 1 each, not 2.
  EXPECT_EQ(threads(facts(8, 3, 3.0)), 1);
  // Every core busy: still one thread (a rank cannot run on none).
  EXPECT_EQ(threads(facts(8, 2, 8.0)), 1);
  EXPECT_EQ(threads(facts(8, 2, 9.5)), 1);  // more than the cores (rounding in the kernel)
}

TEST(ThreadChoice, MoreRanksThanCoresGetOneThreadEach) {
  EXPECT_EQ(threads(facts(2, 3, 0.0)), 1);
  EXPECT_EQ(threads(facts(2, 8, 0.0)), 1);
  EXPECT_EQ(threads(facts(1, 4, std::nullopt)), 1);
}

TEST(ThreadChoice, NeverMoreThanTheCoresPerRank) {
  // Load measured below zero or cores free beyond the affinity cannot add threads.
  EXPECT_EQ(threads(facts(4, 2, -0.5)), 2);
  EXPECT_EQ(threads(facts(4, 3, 0.0)), 1);
}

TEST(ThreadChoice, UnmeasuredLoadIsCoresPerRank) {
  EXPECT_EQ(threads(facts(8, 2, std::nullopt)), 4);
  EXPECT_EQ(threads(facts(2, 1, std::nullopt)), 2);
}

TEST(ThreadChoice, FsdpNumThreadsWins) {
  auto c = choose_threads(facts(2, 2, 1.9, 6));
  EXPECT_EQ(c.threads, 6);
  EXPECT_TRUE(c.from_user);
  EXPECT_FALSE(choose_threads(facts(2, 2, 1.9)).from_user);
}

TEST(ThreadChoice, AffinityFewerThanHardwareCores) {
  // A process allowed 2 of the machine's CPUs counts those 2, and only their load.
  const std::string before =
      "cpu  400 0 0 400 0 0 0 0 0 0\n"
      "cpu0 100 0 0 100 0 0 0 0 0 0\n"
      "cpu1 100 0 0 100 0 0 0 0 0 0\n"
      "cpu2 100 0 0 100 0 0 0 0 0 0\n"
      "cpu3 100 0 0 100 0 0 0 0 0 0\n"
      "intr 1 2 3\n";
  // cpu0 and cpu1 (ours) idle; cpu2 and cpu3 (not ours) fully busy.
  const std::string after =
      "cpu  600 0 0 600 0 0 0 0 0 0\n"
      "cpu0 100 0 0 200 0 0 0 0 0 0\n"
      "cpu1 100 0 0 200 0 0 0 0 0 0\n"
      "cpu2 200 0 0 100 0 0 0 0 0 0\n"
      "cpu3 200 0 0 100 0 0 0 0 0 0\n";
  auto b = parse_proc_stat(before);
  auto a = parse_proc_stat(after);
  auto ours = busy_cores_between(b, a, {0, 1});
  ASSERT_TRUE(ours.has_value());
  EXPECT_DOUBLE_EQ(*ours, 0.0);
  EXPECT_EQ(threads(facts(2, 1, ours)), 2);
  auto theirs = busy_cores_between(b, a, {2, 3});
  ASSERT_TRUE(theirs.has_value());
  EXPECT_DOUBLE_EQ(*theirs, 2.0);
  EXPECT_EQ(threads(facts(2, 1, theirs)), 1);
}

TEST(ThreadChoice, ProcStatBusyIsEverythingButIdleAndIowait) {
  // user nice system idle iowait irq softirq steal guest guest_nice
  auto cpus = parse_proc_stat("cpu0 10 1 2 30 4 1 1 1 5 0\ncpu12 1 0 0 1\n");
  ASSERT_EQ(cpus.size(), 2u);
  EXPECT_EQ(cpus[0].total, 50u);  // guest time is already inside user
  EXPECT_EQ(cpus[0].busy, 16u);
  EXPECT_EQ(cpus[12].total, 2u);
  EXPECT_EQ(cpus[12].busy, 1u);
  // Half of one core's interval busy, and all of another's.
  std::map<int, CpuTimes> before = {{0, {0, 0}}, {1, {0, 0}}};
  std::map<int, CpuTimes> after = {{0, {10, 20}}, {1, {20, 20}}};
  EXPECT_DOUBLE_EQ(*busy_cores_between(before, after, {0, 1}), 1.5);
  // A CPU missing from a snapshot, or no time passing, is "not measured".
  EXPECT_FALSE(busy_cores_between(before, after, {0, 7}).has_value());
  EXPECT_FALSE(busy_cores_between(before, before, {0}).has_value());
  EXPECT_FALSE(busy_cores_between(before, after, {}).has_value());
}

TEST(ThreadChoice, TheLine) {
  auto line = [](const ThreadFacts& f) { return describe(f, choose_threads(f)); };
  EXPECT_EQ(line(facts(2, 2, 1.6)),
            "[fsdp] 2 ranks on 2 cores, 1.6 busy with other work: 1 intra-op thread per rank "
            "(set FSDP_NUM_THREADS to choose)");
  EXPECT_EQ(line(facts(16, 3, 0.04)),
            "[fsdp] 3 ranks on 16 cores, 0.0 busy with other work: 5 intra-op threads per rank "
            "(set FSDP_NUM_THREADS to choose)");
  EXPECT_EQ(line(facts(8, 2, std::nullopt)),
            "[fsdp] 2 ranks on 8 cores: 4 intra-op threads per rank (set FSDP_NUM_THREADS to "
            "choose)");
  EXPECT_EQ(line(facts(2, 3, 0.5, 2)),
            "[fsdp] 3 ranks on 2 cores: 2 intra-op threads per rank (from FSDP_NUM_THREADS)");
  // One process says something only when other work cost it threads.
  EXPECT_EQ(line(facts(2, 1, 1.0)),
            "[fsdp] 1 process on 2 cores, 1.0 busy with other work: 1 intra-op thread (set "
            "FSDP_NUM_THREADS to choose)");
  EXPECT_EQ(line(facts(2, 1, 0.2)), "");
  EXPECT_EQ(line(facts(1, 1, 1.0)), "");
  EXPECT_EQ(line(facts(8, 1, 7.0, 4)), "");
}

}  // namespace
