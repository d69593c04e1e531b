// --backend auto: the choice table (Note [Backend auto]) and one real run of each outcome.
#include "comm/backend_choice.h"
#include "comm/mpi_transport.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace {

using fsdp::detail::BackendChoice;
using fsdp::detail::BackendFacts;
using fsdp::detail::choose_backend;

BackendFacts one_host_not_launched() {
  BackendFacts f;
  f.mpi_built = true;
  f.mpirun_found = true;
  f.launcher = "none";
  f.num_nodes = 1;
  f.world_size = 2;
  return f;
}

TEST(BackendChoice, OneHostWithMpiBuiltAndMpirunPicksMpiAndRelaunches) {
  BackendChoice c = choose_backend(one_host_not_launched());
  EXPECT_EQ(c.backend, "mpi");
  EXPECT_TRUE(c.relaunch_through_mpirun);
  EXPECT_NE(c.reason.find("one host"), std::string::npos) << c.reason;
}

TEST(BackendChoice, MissingMpiBuildOrMpirunFallsBackToGlooAndSaysWhy) {
  BackendFacts f = one_host_not_launched();
  f.mpi_built = false;
  BackendChoice c = choose_backend(f);
  EXPECT_EQ(c.backend, "gloo");
  EXPECT_FALSE(c.relaunch_through_mpirun);
  EXPECT_NE(c.reason.find("FSDP_WITH_MPI=OFF"), std::string::npos) << c.reason;

  f = one_host_not_launched();
  f.mpirun_found = false;
  c = choose_backend(f);
  EXPECT_EQ(c.backend, "gloo");
  EXPECT_NE(c.reason.find("mpirun"), std::string::npos) << c.reason;
}

TEST(BackendChoice, SeveralHostsWithoutMpirunPickGloo) {
  BackendFacts f = one_host_not_launched();
  f.num_nodes = 2;
  f.world_size = 4;
  EXPECT_EQ(choose_backend(f).backend, "gloo");
  for (std::string launcher : {"fsdp-run", "env", "slurm", "spawn"}) {
    f.launcher = launcher;
    BackendChoice c = choose_backend(f);
    EXPECT_EQ(c.backend, "gloo") << launcher;
    EXPECT_FALSE(c.relaunch_through_mpirun) << launcher;
    EXPECT_NE(c.reason.find(launcher), std::string::npos) << c.reason;
  }
}

TEST(BackendChoice, LaunchedByMpirunPicksMpiOnAnyNumberOfHosts) {
  for (int nodes : {1, 3}) {
    BackendFacts f = one_host_not_launched();
    f.launcher = "mpirun";
    f.num_nodes = nodes;
    f.world_size = 2 * nodes;
    f.mpirun_found = false;  // the ranks need not see mpirun themselves
    BackendChoice c = choose_backend(f);
    EXPECT_EQ(c.backend, "mpi") << nodes;
    EXPECT_FALSE(c.relaunch_through_mpirun);
    f.mpi_built = false;
    EXPECT_EQ(choose_backend(f).backend, "gloo") << nodes;
  }
}

TEST(BackendChoice, OneRankAndExplicitRequestsAreNotChanged) {
  BackendFacts f = one_host_not_launched();
  f.world_size = 1;
  EXPECT_EQ(choose_backend(f).backend, "gloo");
  EXPECT_FALSE(choose_backend(f).relaunch_through_mpirun);
  f = one_host_not_launched();
  f.requested = "gloo";
  EXPECT_EQ(choose_backend(f).backend, "gloo");
  EXPECT_EQ(choose_backend(f).reason, "requested");
  f.requested = "mpi";
  f.num_nodes = 2;
  f.launcher = "fsdp-run";
  EXPECT_EQ(choose_backend(f).backend, "mpi");
}

// The real thing: a plain two-rank fsdp-train with the default backend.
TEST(BackendChoice, FsdpTrainDefaultPrintsItsChoiceAndTrains) {
  using fsdp::testing::run_process;
  const std::vector<std::string> args = {
      fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny", "--max-steps", "2",
      "--batch-size", "2", "--devices", "2", "--strategy", "fsdp", "--no-progress-bar",
      "--default-root-dir",
      (std::filesystem::temp_directory_path() / "fsdp_backend_choice_logs").string()};
  auto r = run_process(args, {{"FSDP_BACKEND", ""}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string expected = fsdp::detail::mpi_built() ? "[fsdp] backend mpi (auto: one host"
                                                         : "[fsdp] backend gloo (auto: one host";
  EXPECT_NE(r.err.find(expected), std::string::npos) << r.err;
  // Said once per job, not once per rank.
  EXPECT_EQ(r.err.find("[fsdp] backend", r.err.find(expected) + 1), std::string::npos) << r.err;

  // FSDP_BACKEND (or --backend) decides: no auto, no line.
  r = run_process(args, {{"FSDP_BACKEND", "gloo"}});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(r.err.find("[fsdp] backend"), std::string::npos) << r.err;
}

}  // namespace
