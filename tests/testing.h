// Test helpers: multi-rank tests as real processes on loopback.
//
//   TEST(Collectives, AllGather) {
//     fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup& pg) { ... EXPECT_...; });
//   }
//
// run_ranks re-executes this test binary once per extra rank with --gtest_filter set to the
// current test (for "mpi", all ranks run under `mpirun`). Every rank runs `body` with the world
// group; a rank with a failed expectation or an exception exits non-zero and the test fails
// in the parent, naming the rank.
#pragma once

#include "fsdp/comm.h"

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::testing {

void run_ranks(int world_size, const std::string& backend,
               const std::function<void(ProcessGroup& world)>& body);

// True in the re-executed child ranks (and in every rank under mpirun).
bool in_child_rank();

struct ProcResult {
  int exit_code = -1;  // 128+signal when killed by a signal
  std::string out;
  std::string err;
  double seconds = 0;
};
// Runs a program to completion (kills it after timeout_s), capturing stdout/stderr.
ProcResult run_process(const std::vector<std::string>& argv,
                       const std::map<std::string, std::string>& env = {},
                       double timeout_s = 300);

// The value of this test binary's own command-line flag `--name=value`, or nullopt. A test that
// runs its binary again (run_process on /proc/self/exe) passes such flags to the child, and the
// ranks a Trainer launches in that child inherit them with the rest of its argv: the way a child
// learns which injected hooks to install (src/common/injected_hooks.h), since the library reads
// no environment variable for them.
std::optional<std::string> command_line_flag(const std::string& name);

// The message (without the C++ backtrace) of the c10::Error `f` throws; "" when it throws none.
std::string error_of(const std::function<void()>& f);

// Sets an environment variable while it lives, then restores it (or unsets it).
class ScopedSetenv {
 public:
  ScopedSetenv(const std::string& name, const std::string& value);
  ~ScopedSetenv();
  ScopedSetenv(const ScopedSetenv&) = delete;
  ScopedSetenv& operator=(const ScopedSetenv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// Path of a program built under build/bin (e.g. "fsdp-train").
std::string bin_path(const std::string& program);
// fsdp-train on transformer-tiny (synthetic data, dropout 0, seed 7, 10 steps, no progress bar)
// followed by `extra` flags: its --summary-json object, or an empty object after a failed
// expectation when the run fails. `tag` makes the run's temporary directory unique.
nlohmann::json fsdp_train_summary(const std::vector<std::string>& extra, const std::string& tag);
// ../shared/data/wikitext-2 relative to the source tree, or "" when absent.
std::string wikitext2_dir();

}  // namespace fsdp::testing
