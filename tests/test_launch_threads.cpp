// Threads per rank in real launches (Note [Threads per rank] in src/comm/thread_choice.cpp): each
// way ranks start prints the choice once and every rank runs with it. The choice itself:
// tests/test_thread_choice.cpp. The suite pins FSDP_NUM_THREADS (tests/CMakeLists.txt); these
// tests unset it to see the choice made from the load.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "comm/launcher_detail.h"
#include "launch_test_util.h"
#include "testing.h"

namespace {

using namespace fsdp::testing::launch;
using fsdp::testing::ProcResult;
using fsdp::testing::run_process;

const std::map<std::string, std::string> kChosen = {{"FSDP_NUM_THREADS", ""}};

// The lines about the choice in `err`, and the thread count the first one names.
struct Announced {
  int lines = 0;
  int threads = -1;
  std::string text;
};

Announced announced(const std::string& err) {
  Announced a;
  const std::regex& re = thread_choice_line();
  for (auto it = std::sregex_iterator(err.begin(), err.end(), re); it != std::sregex_iterator();
       ++it) {
    if (a.lines++ == 0) {
      a.threads = std::stoi((*it)[2]);
      a.text = (*it)[0];
    }
  }
  return a;
}

// Every rank printed "threads <announced>"; none printed another count.
void expect_ranks_run_with(const ProcResult& r, int world, const std::string& how) {
  Announced a = announced(r.err);
  ASSERT_EQ(a.lines, 1) << how << ": the choice is printed once per job\n" << r.err;
  EXPECT_NE(a.text.find("[fsdp] " + std::to_string(world) + " ranks on "), std::string::npos)
      << how << ": " << a.text;
  EXPECT_NE(r.err.find("(set FSDP_NUM_THREADS to choose)"), std::string::npos) << r.err;
  EXPECT_EQ(count(r.out, "threads " + std::to_string(a.threads) + " "),
            static_cast<size_t>(world))
      << how << ": " << a.text << "\n" << r.out;
  EXPECT_EQ(count(r.out, " threads "), static_cast<size_t>(world)) << r.out;
  const int most = std::max(1, fsdp::detail::available_cores() / world);
  EXPECT_GE(a.threads, 1);
  EXPECT_LE(a.threads, most) << a.text;
}

TEST(LaunchThreads, SpawnedRanksPrintTheChoiceOnceAndRunWithIt) {
  for (int world : {2, 3}) {
    ProcResult r = run_process({helper(), "--devices", std::to_string(world)}, kChosen, 120);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    expect_ranks_run_with(r, world, "fsdp::launch, world " + std::to_string(world));
  }
}

TEST(LaunchThreads, FsdpRunPrintsTheChoiceOnceAndItsRanksRunWithIt) {
  for (int world : {2, 3}) {
    ProcResult r = run_process(
        {fsdp::testing::bin_path("fsdp-run"), "-n", std::to_string(world), "--", helper()},
        kChosen, 120);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    expect_ranks_run_with(r, world, "fsdp-run, world " + std::to_string(world));
  }
}

TEST(LaunchThreads, MpirunRanksPrintTheChoiceOnceAndRunWithIt) {
  if (fsdp::detail::find_on_path("mpirun").empty()) GTEST_SKIP() << "[fsdp-skip] no mpirun";
  for (int world : {2, 3}) {
    // fsdp::launch re-running the program through mpirun: the first process chooses.
    ProcResult r = run_process(
        {helper(), "--devices", std::to_string(world), "--backend", "mpi"}, kChosen, 120);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    expect_ranks_run_with(r, world, "backend mpi, world " + std::to_string(world));
    // mpirun started by the user: each rank chooses, rank 0 says so.
    std::vector<std::string> argv = fsdp::detail::mpirun_prefix(world);
    argv.push_back(helper());
    r = run_process(argv, kChosen, 120);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    expect_ranks_run_with(r, world, "outside mpirun, world " + std::to_string(world));
  }
}

TEST(LaunchThreads, FsdpNumThreadsIsTheUsersAndSaysSo) {
  ProcResult r = run_process({helper(), "--devices", "3"}, {{"FSDP_NUM_THREADS", "2"}}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count(r.err, "[fsdp] 3 ranks on "), 1u) << r.err;
  EXPECT_EQ(count(r.err, ": 2 intra-op threads per rank (from FSDP_NUM_THREADS)"), 1u) << r.err;
  EXPECT_EQ(count(r.out, " threads 2 "), 3u) << r.out;
}

// A program that launches twice (two Trainers) says its choice once, under each launcher.
TEST(LaunchThreads, LaunchingTwiceSaysTheChoiceOnce) {
  const std::map<std::string, std::string> user = {{"FSDP_NUM_THREADS", "2"}};
  std::vector<std::vector<std::string>> launches = {{helper(), "--devices", "2", "--launch-twice"},
                                                    {helper(), "--devices", "1", "--launch-twice"}};
  if (!fsdp::detail::find_on_path("mpirun").empty()) {
    launches.push_back(fsdp::detail::mpirun_prefix(2));
    launches.back().insert(launches.back().end(), {helper(), "--launch-twice"});
  }
  for (const auto& argv : launches) {
    ProcResult r = run_process(argv, user, 120);
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    const bool one = argv[1] == "--devices" && argv[2] == "1";
    EXPECT_EQ(count(r.err, "intra-op thread"), one ? 0u : 1u) << argv[0] << "\n" << r.err;
    EXPECT_EQ(count(r.out, " threads 2 "), one ? 1u : 2u) << r.out;
  }
}

// Other work on every core this process may use: a process launched now gets one thread, not one
// per core, and says why.
TEST(LaunchThreads, OneProcessOnBusyCoresGetsOneThread) {
  const int cores = fsdp::detail::available_cores();
  if (cores < 2) GTEST_SKIP() << "[fsdp-skip] needs 2 cores; this process may use " << cores;
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (int i = 0; i < cores; ++i) {
    spinners.emplace_back([&stop] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  ProcResult r = run_process({helper(), "--devices", "1"}, kChosen, 120);
  stop = true;
  for (auto& t : spinners) t.join();
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, " threads 1 "), 1u) << r.out;
  Announced a = announced(r.err);
  EXPECT_EQ(a.lines, 1) << r.err;
  EXPECT_EQ(a.threads, 1) << r.err;
  EXPECT_NE(a.text.find("[fsdp] 1 process on " + std::to_string(cores) + " cores, "),
            std::string::npos)
      << a.text;
  EXPECT_NE(r.err.find("busy with other work"), std::string::npos) << r.err;
}

}  // namespace
