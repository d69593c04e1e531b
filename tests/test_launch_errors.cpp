// What a user reads when a launch fails: a wildcard rendezvous address refused with a sentence
// that says what to give. See Note [Rendezvous handshake].
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

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
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
