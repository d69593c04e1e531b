// Launcher: spawning, adopting launcher environments, fsdp-run, failure behaviour, run_ranks.
// Multi-process cases run tests/helper_launch (see there) as real processes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <set>

#include "comm/launcher_detail.h"
#include "fsdp/launcher.h"
#include "launch_test_util.h"
#include "testing.h"

namespace {

using namespace fsdp::testing::launch;

using fsdp::testing::ProcResult;
using fsdp::testing::run_process;

// Sets or unsets environment variables for one test and restores them afterwards.
class EnvGuard {
 public:
  EnvGuard() {
    // A clean slate: no launcher variables from the environment ctest runs in.
    for (const char* k : kAll) unset(k);
  }
  void set(const std::string& k, const std::string& v) {
    remember(k);
    ::setenv(k.c_str(), v.c_str(), 1);
  }
  void unset(const std::string& k) {
    remember(k);
    ::unsetenv(k.c_str());
  }
  ~EnvGuard() {
    for (const auto& [k, v] : saved_) {
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
    }
  }

 private:
  void remember(const std::string& k) {
    if (saved_.count(k)) return;
    const char* v = std::getenv(k.c_str());
    saved_[k] = v ? std::optional<std::string>(v) : std::nullopt;
  }
  static constexpr const char* kAll[] = {"RANK",
                                         "WORLD_SIZE",
                                         "LOCAL_RANK",
                                         "LOCAL_WORLD_SIZE",
                                         "GROUP_RANK",
                                         "NODE_RANK",
                                         "MASTER_ADDR",
                                         "MASTER_PORT",
                                         "FSDP_LAUNCHER",
                                         "OMPI_COMM_WORLD_RANK",
                                         "OMPI_COMM_WORLD_SIZE",
                                         "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "OMPI_COMM_WORLD_LOCAL_SIZE",
                                         "OMPI_MCA_ess_base_jobid",
                                         "PMIX_NAMESPACE",
                                         "SLURM_PROCID",
                                         "SLURM_NTASKS",
                                         "SLURM_LOCALID",
                                         "SLURM_NNODES",
                                         "SLURM_JOB_NUM_NODES",
                                         "SLURM_NTASKS_PER_NODE",
                                         "SLURM_TASKS_PER_NODE",
                                         "SLURM_NODEID",
                                         "SLURM_JOB_NODELIST",
                                         "SLURM_NODELIST",
                                         "SLURM_JOB_ID"};
  std::map<std::string, std::optional<std::string>> saved_;
};

// The helper's ranks wait this long unless the launcher kills them; a run that ends well
// before it was ended by the launcher, not by the survivors giving up.
constexpr double kSurvivorWaitS = 120;

struct FailureCase {
  std::string how;
  int fail_rank;
  int world;
  bool collective;
  std::string expect_line;  // the launcher's line
  bool expect_rank_error;   // "[rank R] ..." printed by the failing rank itself
};

ProcResult run_failure(const FailureCase& c) {
  std::vector<std::string> argv = {helper(),
                                   "--devices",
                                   std::to_string(c.world),
                                   "--fail-rank",
                                   std::to_string(c.fail_rank),
                                   "--how",
                                   c.how,
                                   "--survivor-wait",
                                   std::to_string(kSurvivorWaitS)};
  if (c.collective) argv.push_back("--collective");
  return run_process(argv, {}, 2 * kSurvivorWaitS);
}

void check_failure(const FailureCase& c, const ProcResult& r) {
  SCOPED_TRACE("how=" + c.how + " rank=" + std::to_string(c.fail_rank) +
               " world=" + std::to_string(c.world) + (c.collective ? " collective" : ""));
  SCOPED_TRACE("stdout:\n" + r.out + "\nstderr:\n" + r.err);
  EXPECT_NE(r.exit_code, 0);
  // Ended by the launcher, not by the survivors' own wait running out.
  EXPECT_LT(r.seconds, kSurvivorWaitS / 2);
  EXPECT_EQ(count(r.err, "secondary error"), 0u);
  // The launcher's line, once.
  EXPECT_EQ(count(r.err, c.expect_line), 1u);
  std::string marker = "[rank " + std::to_string(c.fail_rank) + "]";
  if (c.expect_rank_error) {
    EXPECT_EQ(count(r.err, marker), 1u);
  }
  // Nobody else's error gets through.
  for (int rank = 0; rank < c.world; ++rank) {
    if (rank != c.fail_rank) {
      EXPECT_EQ(count(r.err, "[rank " + std::to_string(rank) + "]"), 0u);
    }
  }
  // Every rank that started is gone.
  std::vector<int> pids = printed_pids(r.out);
  EXPECT_GE(pids.size(), 1u);
  for (int pid : pids) EXPECT_TRUE(process_gone(pid)) << "pid " << pid << " survived";
}

}  // namespace

TEST(Launcher, CleanRunExitsZeroAndEveryRankSeesItsRank) {
  ProcResult r = run_process({helper(), "--devices", "3"}, {{"FSDP_NUM_THREADS", "2"}}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    std::string line = "rank " + std::to_string(rank) + " world 3 local " + std::to_string(rank) +
                       "/3 node 0/1 source spawn threads 2";
    EXPECT_EQ(count(r.out, line), 1u) << line << "\n" << r.out;
  }
  // All ranks agree on one master port.
  std::regex re("port ([0-9]+)");
  std::set<std::string> ports;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), re); it != std::sregex_iterator();
       ++it)
    ports.insert((*it)[1]);
  EXPECT_EQ(ports.size(), 1u);
  for (int pid : printed_pids(r.out)) EXPECT_TRUE(process_gone(pid));
}

// At most cores / local ranks each, fewer when other work keeps cores busy (the choice and its
// line: tests/test_thread_choice.cpp, tests/test_launch_threads.cpp).
TEST(Launcher, ThreadsAreAtMostCoresPerLocalRank) {
  ProcResult r = run_process({helper(), "--devices", "2"}, {{"FSDP_NUM_THREADS", ""}}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::regex re(" threads ([0-9]+) ");
  std::set<int> counts;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), re);
       it != std::sregex_iterator(); ++it)
    counts.insert(std::stoi((*it)[1]));
  ASSERT_EQ(counts.size(), 1u) << "both ranks run with one count\n" << r.out;
  EXPECT_GE(*counts.begin(), 1);
  EXPECT_LE(*counts.begin(), std::max(1, fsdp::detail::available_cores() / 2)) << r.out;
}

TEST(Launcher, RankThrows) {
  FailureCase c{"throw", 2, 3, false, "fsdp: rank 2 exited with status 1; stopping all 3 ranks",
                true};
  auto r = run_failure(c);
  check_failure(c, r);
  EXPECT_NE(r.err.find("[rank 2] error: uncaught exception: helper: rank 2 throws on purpose"),
            std::string::npos);
}

TEST(Launcher, RankAborts) {
  FailureCase c{"abort", 1, 3, false, "fsdp: rank 1 was killed by signal 6", true};
  check_failure(c, run_failure(c));
}

TEST(Launcher, RankIsSigkilled) {
  FailureCase c{"sigkill", 2, 3, false, "fsdp: rank 2 was killed by signal 9", false};
  check_failure(c, run_failure(c));
}

TEST(Launcher, RankExitsNonZeroAndItsStatusIsTheJobs) {
  FailureCase c{"exit", 1, 3, false, "fsdp: rank 1 exited with status 7; stopping all 3 ranks",
                false};
  auto r = run_failure(c);
  check_failure(c, r);
  EXPECT_EQ(r.exit_code, 7);
}

TEST(Launcher, FailRankUsesItsExitCode) {
  FailureCase c{"fail_rank", 2, 3, false, "fsdp: rank 2 exited with status 3; stopping all 3 ranks",
                true};
  auto r = run_failure(c);
  check_failure(c, r);
  EXPECT_EQ(r.exit_code, 3);
}

TEST(Launcher, RankZeroThrowsAndTakesTheChildrenDown) {
  FailureCase c{"throw", 0, 3, false, "fsdp: rank 0 exited with status 1; stopping all 3 ranks",
                true};
  check_failure(c, run_failure(c));
}

TEST(Launcher, RankZeroReturnsNonZero) {
  ProcResult r = run_process({helper(), "--devices", "3", "--rank0-status", "4"}, {}, 120);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_EQ(count(r.err, "fsdp: rank 0 exited with status 4; stopping all 3 ranks"), 1u) << r.err;
  for (int pid : printed_pids(r.out)) EXPECT_TRUE(process_gone(pid));
}

// Survivors blocked in a real collective: their "connection closed" errors must not show.
TEST(Launcher, RankThrowsWhileOthersWaitInABarrier) {
  FailureCase c{"throw", 1, 3, true, "fsdp: rank 1 exited with status 1; stopping all 3 ranks",
                true};
  check_failure(c, run_failure(c));
}

TEST(Launcher, RankIsSigkilledWhileOthersWaitInABarrier) {
  FailureCase c{"sigkill", 2, 4, true, "fsdp: rank 2 was killed by signal 9", false};
  check_failure(c, run_failure(c));
}

TEST(Launcher, CollectiveRunExitsZero) {
  ProcResult r = run_process({helper(), "--devices", "3", "--collective"}, {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "joined the group"), 3u) << r.out;
}

TEST(Launcher, MpiBackendGoesThroughMpirun) {
  ProcResult r =
      run_process({helper(), "--devices", "2", "--backend", "mpi", "--collective"}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "world 2"), 2u) << r.out;
  EXPECT_EQ(count(r.out, "source mpirun"), 2u) << r.out;
  EXPECT_EQ(count(r.out, "joined the group"), 2u) << r.out;
}

TEST(Launcher, MpiRankFailureEndsTheJob) {
  ProcResult r = run_process({helper(), "--devices", "3", "--backend", "mpi", "--fail-rank", "1",
                              "--how", "throw", "--survivor-wait", std::to_string(kSurvivorWaitS)},
                             {}, 2 * kSurvivorWaitS);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_LT(r.seconds, kSurvivorWaitS / 2);
  EXPECT_EQ(count(r.err, "[rank 1] error: uncaught exception"), 1u) << r.err;
  for (int pid : printed_pids(r.out)) EXPECT_TRUE(gone_within(pid, 10.0)) << "pid " << pid;
  remove_mpirun_log(r.err);
}

TEST(FsdpRun, EachRankSeesItsRank) {
  ProcResult r =
      run_process({fsdp::testing::bin_path("fsdp-run"), "-n", "3", "--", helper()}, {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  for (int rank = 0; rank < 3; ++rank) {
    std::string line = "rank " + std::to_string(rank) + " world 3 local " + std::to_string(rank) +
                       "/3 node 0/1 source fsdp-run";
    EXPECT_EQ(count(r.out, line), 1u) << line << "\n" << r.out;
  }
}

TEST(FsdpRun, NodeRankOffsetsGlobalRanks) {
  // Node 1 of 2 alone cannot rendezvous, but the helper without --collective only prints.
  ProcResult r = run_process({fsdp::testing::bin_path("fsdp-run"), "-n", "2", "--nnodes", "2",
                              "--node-rank", "1", "--master-port", "29999", "--", helper()},
                             {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(count(r.out, "rank 2 world 4 local 0/2 node 1/2"), 1u) << r.out;
  EXPECT_EQ(count(r.out, "rank 3 world 4 local 1/2 node 1/2"), 1u) << r.out;
}

TEST(FsdpRun, FailingRankStopsAll) {
  ProcResult r = run_process({fsdp::testing::bin_path("fsdp-run"), "-n", "3", "--", helper(),
                              "--fail-rank", "1", "--how", "throw", "--collective"},
                             {}, 2 * kSurvivorWaitS);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(r.seconds, kSurvivorWaitS / 2);
  EXPECT_EQ(count(r.err, "[rank 1] error"), 1u) << r.err;
  EXPECT_EQ(count(r.err, "[rank 0]") + count(r.err, "[rank 2]"), 0u) << r.err;
  EXPECT_EQ(count(r.err, "fsdp-run: rank 1 exited with status 1; stopping all 3 ranks"), 1u)
      << r.err;
  for (int pid : printed_pids(r.out)) EXPECT_TRUE(process_gone(pid));
}

// A rank the kernel's OOM killer ends is named as such (SIGKILL alone says nothing about why).
TEST(OomKill, ExplanationOnlyForAnUnsentSigkillWhileTheCountRose) {
  auto status_of = [](int sig) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::raise(sig);
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return status;
  };
  const int killed = status_of(SIGKILL), terminated = status_of(SIGTERM);
  const std::string text = fsdp::detail::oom_kill_explanation(killed, false, 3, 4);
  EXPECT_NE(text.find("OOM killer ran during this job (/proc/vmstat oom_kill 3 -> 4)"),
            std::string::npos) << text;
  EXPECT_NE(text.find("FSDP_MEMORY_BUDGET"), std::string::npos) << text;
  EXPECT_EQ(fsdp::detail::oom_kill_explanation(killed, true, 3, 4), "") << "we sent the SIGKILL";
  EXPECT_EQ(fsdp::detail::oom_kill_explanation(killed, false, 3, 3), "") << "no OOM kill";
  EXPECT_EQ(fsdp::detail::oom_kill_explanation(killed, false, -1, -1), "") << "count unknown";
  EXPECT_EQ(fsdp::detail::oom_kill_explanation(terminated, false, 3, 4), "") << "not SIGKILL";
  EXPECT_GE(fsdp::detail::kernel_oom_kills(), 0) << "this kernel has /proc/vmstat oom_kill";
}

// The real thing: fsdp-run and its ranks in a 256 MiB memory cgroup (v1, as on these machines),
// rank 1 allocating until the kernel kills it. Needs a writable memory cgroup (root); skipped
// with the reason otherwise.
TEST(OomKill, RankKilledByTheKernelIsNamedByFsdpRun) {
  const std::filesystem::path root = "/sys/fs/cgroup/memory";
  const std::filesystem::path cg = root / ("fsdp-test-oom-" + std::to_string(::getpid()));
  std::error_code ec;
  if (!std::filesystem::create_directory(cg, ec)) {
    GTEST_SKIP() << "[fsdp-skip] no writable memory cgroup at " << root << " (" << ec.message()
                 << ")";
  }
  { std::ofstream(cg / "memory.limit_in_bytes") << (256 << 20); }
  const std::string sh = "echo $$ > '" + (cg / "cgroup.procs").string() + "' && exec '" +
                         fsdp::testing::bin_path("fsdp-run") + "' -n 2 -- '" + helper() +
                         "' --fail-rank 1 --how oom --delay 0";
  ProcResult r = run_process({"/bin/sh", "-c", sh}, {}, 120);
  std::filesystem::remove(cg, ec);  // empty once every process in it has exited
  EXPECT_NE(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err.find("was not killed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("fsdp-run: rank 1 was killed by signal 9"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("the kernel's OOM killer ran during this job"), std::string::npos)
      << r.err;
}

TEST(FsdpRun, MultiNodeNeedsAPort) {
  ProcResult r = run_process({fsdp::testing::bin_path("fsdp-run"), "-n", "2", "--nnodes", "2",
                              "--node-rank", "0", "--", helper()},
                             {{"MASTER_PORT", ""}}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--master-port"), std::string::npos) << r.err;
}

TEST(LaunchEnv, NoLauncher) {
  EnvGuard env;
  auto info = fsdp::launch_info_from_env();
  EXPECT_EQ(info.source, "none");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
}

TEST(LaunchEnv, TorchrunStyle) {
  EnvGuard env;
  env.set("RANK", "5");
  env.set("WORLD_SIZE", "8");
  env.set("LOCAL_RANK", "1");
  env.set("LOCAL_WORLD_SIZE", "4");
  env.set("MASTER_ADDR", "10.1.2.3");
  env.set("MASTER_PORT", "29400");
  auto info = fsdp::launch_info_from_env();
  EXPECT_EQ(info.source, "env");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.num_nodes, 2);
  EXPECT_EQ(info.master_addr, "10.1.2.3");
  EXPECT_EQ(info.master_port, 29400);
  env.set("GROUP_RANK", "0");  // torchrun's node index wins over rank / local_world_size
  EXPECT_EQ(fsdp::launch_info_from_env().node_rank, 0);
}

TEST(LaunchEnv, TorchrunStyleRejectsBadValues) {
  EnvGuard env;
  env.set("RANK", "3");
  env.set("WORLD_SIZE", "2");
  EXPECT_THROW(fsdp::launch_info_from_env(), c10::Error);
  env.set("RANK", "one");
  try {
    fsdp::launch_info_from_env();
    ADD_FAILURE() << "no error for RANK=one";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("RANK='one'"), std::string::npos) << e.what();
  }
}

TEST(LaunchEnv, Slurm) {
  EnvGuard env;
  env.set("SLURM_PROCID", "6");
  env.set("SLURM_NTASKS", "8");
  env.set("SLURM_LOCALID", "2");
  env.set("SLURM_NNODES", "2");
  env.set("SLURM_NTASKS_PER_NODE", "4");
  env.set("SLURM_NODEID", "1");
  env.set("SLURM_JOB_NODELIST", "gpu[07-08]");
  env.set("SLURM_JOB_ID", "123456");
  auto info = fsdp::launch_info_from_env();
  EXPECT_EQ(info.source, "slurm");
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.num_nodes, 2);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_GT(info.master_port, 0);
  // Every rank of the job derives the same port from the job id.
  EXPECT_EQ(fsdp::launch_info_from_env().master_port, info.master_port);
  env.set("SLURM_NTASKS_PER_NODE", "");
  env.set("SLURM_TASKS_PER_NODE", "4(x2)");
  EXPECT_EQ(fsdp::launch_info_from_env().local_world_size, 4);
  env.set("MASTER_ADDR", "head");
  env.set("MASTER_PORT", "1234");
  info = fsdp::launch_info_from_env();
  EXPECT_EQ(info.master_addr, "head");
  EXPECT_EQ(info.master_port, 1234);
}

TEST(LaunchEnv, SlurmNodeList) {
  using fsdp::detail::first_slurm_host;
  EXPECT_EQ(first_slurm_host("node01"), "node01");
  EXPECT_EQ(first_slurm_host("a,b,c"), "a");
  EXPECT_EQ(first_slurm_host("node[03-05,07]"), "node03");
  EXPECT_EQ(first_slurm_host("node[3,5]-ib"), "node3-ib");
  EXPECT_EQ(first_slurm_host("rack[1-2]-node[01-04]"), "");  // not expanded: set MASTER_ADDR
}

TEST(LaunchEnv, Mpirun) {
  EnvGuard env;
  env.set("OMPI_COMM_WORLD_RANK", "3");
  env.set("OMPI_COMM_WORLD_SIZE", "4");
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "2");
  env.set("OMPI_MCA_ess_base_jobid", "1318060033");
  auto info = fsdp::launch_info_from_env();
  EXPECT_EQ(info.source, "mpirun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 4);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 2);
  EXPECT_EQ(info.node_rank, 1);
  EXPECT_EQ(info.num_nodes, 2);
  EXPECT_EQ(info.master_addr, "127.0.0.1");
  EXPECT_GT(info.master_port, 0);
}

TEST(LaunchEnv, MultiNodeWithoutLauncherIsAClearError) {
  EnvGuard env;
  fsdp::LaunchOptions o;
  o.devices = 2;
  o.num_nodes = 2;
  try {
    fsdp::launch(o);
    ADD_FAILURE() << "launch() accepted num_nodes=2 without a launcher";
  } catch (const c10::Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("fsdp-run"), std::string::npos) << msg;
    EXPECT_NE(msg.find("srun"), std::string::npos) << msg;
    EXPECT_NE(msg.find("mpirun"), std::string::npos) << msg;
  }
}

TEST(LaunchEnv, DevicesMustMatchTheLauncher) {
  EnvGuard env;
  env.set("RANK", "0");
  env.set("WORLD_SIZE", "2");
  env.set("LOCAL_RANK", "0");
  env.set("LOCAL_WORLD_SIZE", "2");
  fsdp::LaunchOptions o;
  o.devices = 3;
  try {
    fsdp::launch(o);
    ADD_FAILURE() << "launch() accepted devices=3 under a 2-rank launcher";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("devices=3"), std::string::npos) << e.what();
  }
}

// --- run_ranks ------------------------------------------------------------------------

TEST(RunRanks, EveryRankRunsTheBody) {
  for (int world : {1, 3}) {
    fsdp::testing::run_ranks(world, "gloo", [world](fsdp::ProcessGroup& pg) {
      EXPECT_EQ(pg.size(), world);
      EXPECT_EQ(std::to_string(pg.rank()), std::getenv("RANK") ? std::getenv("RANK") : "0");
      EXPECT_EQ(fsdp::testing::in_child_rank(), pg.rank() != 0);
      pg.barrier();
    });
  }
}

TEST(RunRanks, MpiRanks) {
  fsdp::testing::run_ranks(3, "mpi", [](fsdp::ProcessGroup& pg) {
    EXPECT_EQ(pg.size(), 3);
    EXPECT_EQ(pg.backend(), "mpi");
    EXPECT_TRUE(fsdp::testing::in_child_rank());
    pg.barrier();
  });
}

// Run by RunRanks.FailureNamesTheRank in a separate process (the test must fail there).
TEST(RunRanks, DISABLED_ChildFails) {
  std::string backend =
      std::getenv("FSDP_TEST_BACKEND") ? std::getenv("FSDP_TEST_BACKEND") : "gloo";
  fsdp::testing::run_ranks(3, backend, [](fsdp::ProcessGroup& pg) {
    pg.barrier();  // every rank is past init_process_group before any rank ends
    EXPECT_NE(pg.rank(), 1) << "rank one disagrees on purpose";
    if (pg.rank() == 2) throw std::runtime_error("rank two throws on purpose");
  });
}

TEST(RunRanks, FailureNamesTheRank) {
  for (std::string backend : {"gloo", "mpi"}) {
    ProcResult r =
        run_process({fsdp::detail::self_exe(), "--gtest_filter=RunRanks.DISABLED_ChildFails",
                     "--gtest_also_run_disabled_tests"},
                    {{"FSDP_TEST_BACKEND", backend}}, 300);
    SCOPED_TRACE(backend + "\nstdout:\n" + r.out + "\nstderr:\n" + r.err);
    EXPECT_NE(r.exit_code, 0);
    std::string all = r.out + r.err;
    bool one = all.find("rank one disagrees on purpose") != std::string::npos &&
               all.find("[rank 1] failed") != std::string::npos;
    bool two = all.find("rank two throws on purpose") != std::string::npos &&
               all.find("[rank 2] failed") != std::string::npos;
    if (backend == "gloo") {
      // Both failing ranks report (others are stopped only 3 s after the first failure).
      EXPECT_TRUE(one);
      EXPECT_TRUE(two);
      EXPECT_NE(all.find("rank(s) 1, 2 failed"), std::string::npos);
    } else {
      // mpirun aborts the job at the first non-zero exit: the other may not get to report.
      EXPECT_TRUE(one || two);
      EXPECT_NE(all.find("mpirun exited with code"), std::string::npos);
    }
  }
}

TEST(RunProcess, CapturesOutputAndExitCode) {
  auto r = run_process({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"}, {});
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_EQ(r.out, "out\n");
  EXPECT_EQ(r.err, "err\n");
  auto t = run_process({"/bin/sh", "-c", "echo $FSDP_X"}, {{"FSDP_X", "42"}});
  EXPECT_EQ(t.out, "42\n");
  auto k = run_process({"/bin/sleep", "30"}, {}, 0.5);
  EXPECT_EQ(k.exit_code, 128 + SIGKILL);
}
