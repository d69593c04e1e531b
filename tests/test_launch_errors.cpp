// What a user reads when a launch fails: one line per failure (plus the log path) under every
// launcher, and a wildcard rendezvous address refused with a sentence that says what to give.
// See Note [MPI launch output] in src/comm/mpirun_output.cpp and Note [Rendezvous handshake].
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "launch_test_util.h"
#include "testing.h"

namespace {

using fsdp::testing::ProcResult;
using fsdp::testing::run_process;
using namespace fsdp::testing::launch;

// The lines of `text`, without empty ones and without the line the launch printed when it
// started about its threads per rank (information, not part of any failure).
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && !std::regex_match(line, thread_choice_line())) out.push_back(line);
  }
  return out;
}

// A rank throws; the others wait (in a barrier, or asleep). stderr holds the failing rank's line
// and at most one line of the launcher (its summary, or where mpirun's messages went), besides
// the launch's line about its threads.
void expect_one_clean_error(const std::vector<std::string>& argv, bool mpirun) {
  const ProcResult r = run_process(argv, {}, 120);
  SCOPED_TRACE("stdout:\n" + r.out + "\nstderr:\n" + r.err);
  EXPECT_NE(r.exit_code, 0);
  const auto lines = lines_of(r.err);
  EXPECT_LE(lines.size(), 2u);
  EXPECT_LE(count(r.err, "intra-op thread"), 1u);
  EXPECT_EQ(count(r.err, "[rank 1] error: uncaught exception: helper: rank 1 throws on purpose"),
            1u);
  EXPECT_EQ(count(r.err, "frame #"), 0u);
  EXPECT_EQ(count(r.err, "Read -1"), 0u);
  EXPECT_EQ(count(r.err, "-----"), 0u);
  for (int pid : printed_pids(r.out)) EXPECT_TRUE(gone_within(pid, 10.0)) << "pid " << pid;
  if (!mpirun) return;
  // mpirun's messages are kept, in the file the last line names.
  const std::string path = mpirun_log_named_in(r.err);
  ASSERT_FALSE(path.empty());
  std::ifstream log(path);
  ASSERT_TRUE(log.good()) << path;
  std::stringstream text;
  text << log.rdbuf();
  EXPECT_NE(text.str().find("-----"), std::string::npos) << text.str();
  std::filesystem::remove(path);
}

TEST(LaunchErrors, OneLinePerFailureUnderMpirun) {
  // fsdp::launch re-running itself under mpirun (backend mpi, as auto picks it), world 3, the
  // others in a barrier; and fsdp-run --backend mpi, world 2, the others asleep.
  expect_one_clean_error({helper(), "--devices", "3", "--backend", "mpi", "--collective",
                          "--fail-rank", "1", "--how", "throw", "--survivor-wait", "120"},
                         true);
  expect_one_clean_error({fsdp::testing::bin_path("fsdp-run"), "-n", "2", "--backend", "mpi",
                          "--", helper(), "--fail-rank", "1", "--how", "throw",
                          "--survivor-wait", "120"},
                         true);
}

TEST(LaunchErrors, OneLinePerFailureUnderGloo) {
  expect_one_clean_error({helper(), "--devices", "3", "--collective", "--fail-rank", "1", "--how",
                          "throw", "--survivor-wait", "120"},
                         false);
  expect_one_clean_error({fsdp::testing::bin_path("fsdp-run"), "-n", "2", "--", helper(),
                          "--fail-rank", "1", "--how", "throw", "--survivor-wait", "120"},
                         false);
}

// The rendezvous never listens on every interface (docs/errors.md "Security"): a wildcard
// address is refused, by fsdp-run before any rank starts and by rank 0 of any other launch.
TEST(LaunchErrors, WildcardMasterAddrIsRefused) {
  struct Case {
    std::string addr;
    int world;
  };
  for (const Case& c : {Case{"0", 2}, Case{"0.0.0.0", 3}, Case{"::", 2}, Case{"[::]", 3}}) {
    SCOPED_TRACE("--master-addr " + c.addr);
    const ProcResult r =
        run_process({fsdp::testing::bin_path("fsdp-run"), "-n", std::to_string(c.world),
                     "--master-addr", c.addr, "--", helper(), "--collective"},
                    {}, 60);
    SCOPED_TRACE("stdout:\n" + r.out + "\nstderr:\n" + r.err);
    EXPECT_EQ(r.exit_code, 2);
    EXPECT_EQ(lines_of(r.err).size(), 1u);
    EXPECT_NE(r.err.find("[fsdp-run] --master-addr (or MASTER_ADDR) '" + c.addr +
                         "' is the wildcard address"),
              std::string::npos);
    EXPECT_NE(r.err.find("give rank 0's host's concrete address"), std::string::npos);
    EXPECT_EQ(count(r.out, "joined the group"), 0u);  // no rank ever ran
  }
  // fsdp::launch's spawner (rank 0 hosts the rendezvous), world 3.
  const ProcResult r = run_process({helper(), "--devices", "3", "--collective"},
                                   {{"MASTER_ADDR", "0.0.0.0"}}, 60);
  SCOPED_TRACE("stdout:\n" + r.out + "\nstderr:\n" + r.err);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(count(r.err, "[init_process_group] MASTER_ADDR '0.0.0.0' is the wildcard address"),
            1u);
  EXPECT_EQ(count(r.out, "joined the group"), 0u);
  for (int pid : printed_pids(r.out)) EXPECT_TRUE(gone_within(pid, 10.0)) << "pid " << pid;
}

}  // namespace
