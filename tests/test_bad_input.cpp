// Bad input, from the outside: every row of docs/errors.md is a test here. Each runs the real
// programs and checks the exit code, the one sentence on stderr, and that nothing was lost
// (an existing checkpoint directory is byte-for-byte untouched).
#include <gtest/gtest.h>

#include "cli_test_util.h"
#include "testing.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <sstream>

namespace {
namespace fs = std::filesystem;
using fsdp::testing::ProcResult;
using fsdp::testing::run_process;

std::string bin(const std::string& name) { return fsdp::testing::bin_path(name); }

fs::path scratch() {
  static const fs::path p = fsdp::testing::fresh_scratch("fsdp_test_bad_input_");
  return p;
}

int lines(const std::string& s) { return fsdp::testing::count_lines(s); }

using fsdp::testing::snapshot;  // "nothing lost" compares two of these

// A directory holding a real checkpoint (made once): bad-input runs point --checkpoint-dir at
// it and must leave it as it was.
const fs::path& existing_checkpoint() {
  static fs::path dir = [] {
    fs::path d = scratch() / "ckpt";
    auto r = run_process({bin("fsdp-train"), "--max-steps", "2", "--batch-size", "2",
                          "--save-every-n-steps", "2", "--checkpoint-dir", d.string(),
                          "--no-progress-bar", "--num-tokens", "2000", "--default-root-dir",
                          (scratch() / "logs").string()});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return d;
  }();
  return dir;
}

struct Case {
  std::vector<std::string> argv;
  int exit_code;
  std::string message;  // must appear on stderr
};

// Runs `c` with --checkpoint-dir pointing at the existing checkpoint (fsdp-train only) and
// checks the code, the message, one line, and the checkpoint untouched.
void expect_refused(const Case& c, bool one_line = true,
                    const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> argv = c.argv;
  const bool train = argv[0] == "fsdp-train";
  argv[0] = bin(argv[0]);
  std::map<std::string, std::string> before;
  if (train) {
    before = snapshot(existing_checkpoint());
    ASSERT_FALSE(before.empty());
    argv.insert(argv.end(), {"--checkpoint-dir", existing_checkpoint().string(), "--save-every-n-steps",
                             "1", "--max-steps", "1", "--no-progress-bar"});
  }
  ProcResult r = run_process(argv, env, 120);
  std::string what = c.argv[0];
  for (size_t i = 1; i < c.argv.size(); ++i) what += " " + c.argv[i];
  EXPECT_EQ(r.exit_code, c.exit_code) << what << "\n" << r.err;
  EXPECT_NE(r.err.find(c.message), std::string::npos)
      << what << "\nexpected: " << c.message << "\ngot: " << r.err;
  if (one_line) EXPECT_EQ(lines(r.err), 1) << what << "\n" << r.err;
  EXPECT_EQ(r.err.find("frame #"), std::string::npos) << "no backtrace: " << r.err;
  EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
  if (train) EXPECT_EQ(snapshot(existing_checkpoint()), before) << what << ": checkpoint changed";
}

// --- flags ---------------------------------------------------------------------------------

TEST(BadInput, TrainFlagValues) {
  const std::vector<Case> cases = {
      {{"fsdp-train", "--devices", "0"}, 2, "--devices must be at least 1"},
      {{"fsdp-train", "--devices", "two"}, 2, "--devices: 'two' is not a number"},
      {{"fsdp-train", "--devices", "1.5"}, 2, "--devices: '1.5' is not a whole number"},
      {{"fsdp-train", "--devices", "99999999999"}, 2, "--devices: '99999999999' is out of range"},
      {{"fsdp-train", "--lr", "abc"}, 2, "--lr: 'abc' is not a number"},
      {{"fsdp-train", "--lr", "0"}, 2, "--lr must be greater than 0"},
      {{"fsdp-train", "--lr", "nan"}, 2, "--lr: 'nan' is not a finite number"},
      {{"fsdp-train", "--dropout", "1.5"}, 2, "--dropout must be between 0 and 1"},
      {{"fsdp-train", "--max-steps", "-2"}, 2, "--max-steps must be at least -1"},
      {{"fsdp-train", "--batch-size", "0"}, 2, "--batch-size must be at least 1"},
      {{"fsdp-train", "--seed", "-1"}, 2, "--seed must be at least 0"},
      {{"fsdp-train", "--model", "gpt5"}, 2, "--model: 'gpt5' is not one of: "},
      {{"fsdp-train", "--strategy", "dpp"}, 2, "--strategy: 'dpp' is not one of: "},
      {{"fsdp-train", "--precision", "bf17"}, 2, "--precision: 'bf17' is not one of: "},
      {{"fsdp-train", "--sharding-strategy", "FULL"}, 2, "--sharding-strategy: "},
      {{"fsdp-train", "--prefetch", "early"}, 2, "--prefetch: 'early' is not one of: pre, post, none"},
      // No bound of its own: the type check every numeric flag gets (Note [One sentence per
      // bad flag]).
      {{"fsdp-train", "--limit-train-batches", "all"}, 2,
       "--limit-train-batches: 'all' is not a number"},
      {{"fsdp-train", "--hybrid-shard-size", "-1"}, 2, "--hybrid-shard-size must be at least 0"},
      {{"fsdp-train", "--max-stepz", "3"}, 2, "--max-stepz"},
  };
  for (const auto& c : cases) expect_refused(c);
  // A flag at the end of the line without its value (nothing appended after it).
  auto r = run_process({bin("fsdp-train"), "--devices"});
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("--devices needs a value"), std::string::npos) << r.err;
}

TEST(BadInput, NoCli11RangeTextAnywhere) {
  // The text this suite exists to remove: CLI11's own range and number wording.
  for (const std::vector<std::string>& argv :
       std::vector<std::vector<std::string>>{{"fsdp-train", "--devices", "0"},
                                             {"fsdp-train", "--gradient-clip-val", "-1"},
                                             {"fsdp-run", "-n", "0", "--", "true"},
                                             {"fsdp-ckpt", "convert", "--world", "0", "a", "b"}}) {
    std::vector<std::string> a = argv;
    a[0] = bin(a[0]);
    auto r = run_process(a);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    for (const char* ugly : {"not in range", "17976931348623157", "Failed parsing",
                             "Number less or equal", "Value ", "not an allowed value"}) {
      EXPECT_EQ(r.err.find(ugly), std::string::npos) << argv[1] << ": " << r.err;
    }
  }
}

TEST(BadInput, LauncherAndToolFlagValues) {
  const std::vector<Case> cases = {
      {{"fsdp-run", "-n", "0", "--", "true"}, 2, "--nproc-per-node must be between 1 and 4096"},
      {{"fsdp-run", "-n", "x", "--", "true"}, 2, "--nproc-per-node: 'x' is not a number"},
      {{"fsdp-run", "-n", "1", "--master-port", "70000", "--", "true"}, 2,
       "--master-port must be between 1 and 65535"},
      {{"fsdp-run", "-n", "1", "--backend", "nccl", "--", "true"}, 2,
       "--backend: 'nccl' is not one of: gloo, mpi, auto"},
      {{"fsdp-run", "-n", "1", "--nnodes", "2", "--node-rank", "2", "--master-port", "29999",
        "--", "true"},
       2, "--node-rank 2 must be below --nnodes 2"},
      {{"fsdp-run", "--", "true"}, 2, "--nproc-per-node is required"},
      {{"fsdp-ckpt", "convert", "--world", "0", "a", "b"}, 2, "--world must be at least 1"},
      {{"fsdp-ckpt", "convert", "--to", "pickle", "a", "b"}, 2,
       "--to: 'pickle' is not one of: safetensors, sharded"},
  };
  for (const auto& c : cases) expect_refused(c);
  expect_refused({{"fsdp-run", "-n", "1", "--", "true"}, 2, "MASTER_PORT='abc' is not a TCP port"},
                 true, {{"MASTER_PORT", "abc"}});
}

// --- files ---------------------------------------------------------------------------------

fs::path data_dir_with(const std::string& name, const std::string& train_text) {
  fs::path d = scratch() / name;
  fs::create_directories(d);
  std::ofstream(d / "train.txt", std::ios::binary) << train_text;
  return d;
}

TEST(BadInput, DataFiles) {
  std::string binary = "hello world\n";
  binary += std::string("\x7f" "ELF\0\0\x01", 7);
  const std::string huge(2 << 20, 'x');  // one 2 MiB "word", no newline
  const std::vector<Case> cases = {
      {{"fsdp-train", "--data", "wikitext2", "--data-dir", (scratch() / "nowhere").string()}, 1,
       "data directory '" + (scratch() / "nowhere").string() + "' does not exist"},
      {{"fsdp-train", "--data", "wikitext2", "--data-dir", data_dir_with("empty", "").string()}, 1,
       "is empty: no text to train on"},
      {{"fsdp-train", "--data", "wikitext2", "--data-dir",
        data_dir_with("binary", binary).string()},
       1, "is not a text file (a NUL byte at offset 16)"},
      {{"fsdp-train", "--data", "wikitext2", "--data-dir", data_dir_with("huge", huge).string()},
       1, "line 1 of " + (scratch() / "huge" / "train.txt").string() + " is 2097152 bytes long"},
  };
  for (const auto& c : cases) expect_refused(c);
  fs::create_directories(scratch() / "notrain");
  std::ofstream(scratch() / "notrain" / "valid.txt") << "a b c\n";
  expect_refused({{"fsdp-train", "--data", "wikitext2", "--data-dir",
                   (scratch() / "notrain").string()},
                  1, "which does not exist (files present in"});
}

TEST(BadInput, CheckpointPaths) {
  expect_refused({{"fsdp-train", "--ckpt-path", (scratch() / "no-such-ckpt").string()}, 1,
                  (scratch() / "no-such-ckpt").string()});
  fs::path junk = scratch() / "junk-ckpt";
  fs::create_directories(junk);
  std::ofstream(junk / "meta.json") << "{not json";
  expect_refused({{"fsdp-train", "--ckpt-path", junk.string()}, 1, junk.string()});
}

// --- rendezvous ----------------------------------------------------------------------------

// stderr without the line `--backend auto` prints to say which backend it chose: that line is
// information, not part of the error.
std::string without_backend_choice(const std::string& err) {
  std::istringstream in(err);
  std::string line, out;
  while (std::getline(in, line)) {
    if (line.rfind("[fsdp] backend ", 0) != 0) out += line + "\n";
  }
  return out;
}

// `r` failed with `code` and `text` in its stderr, in one line unless `one_line` is false.
void expect_error(const ProcResult& r, int code, const std::string& text, bool one_line = true) {
  EXPECT_EQ(r.exit_code, code) << r.err;
  EXPECT_NE(r.err.find(text), std::string::npos) << "expected: " << text << "\ngot: " << r.err;
  if (one_line) {
    EXPECT_EQ(lines(without_backend_choice(r.err)), 1) << r.err;
  }
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// One rank of a `world`-rank job, one rank per "node", started by hand as a multi-host
// launcher would.
std::map<std::string, std::string> rank_env(int rank, int world, int port, const std::string& job,
                                            double rendezvous_s = 5) {
  return {{"RANK", std::to_string(rank)},         {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", "0"},                    {"LOCAL_WORLD_SIZE", "1"},
          {"GROUP_RANK", std::to_string(rank)},   {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},  {"FSDP_JOB_ID", job},
          {"FSDP_RENDEZVOUS_TIMEOUT_S", std::to_string(rendezvous_s)}};
}

std::vector<std::string> tiny_train(int world) {
  return {bin("fsdp-train"), "--num-nodes", std::to_string(world), "--max-steps", "2",
          "--batch-size", "2", "--num-tokens", "2000", "--no-progress-bar", "--default-root-dir",
          (scratch() / "logs").string()};
}

std::future<ProcResult> start(std::vector<std::string> argv, std::map<std::string, std::string> env) {
  return std::async(std::launch::async,
                    [argv, env] { return run_process(argv, env, 120); });
}

TEST(BadInput, PortInUse) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  auto r = run_process(tiny_train(2), rank_env(0, 2, port, "job-a"));
  ::close(fd);
  expect_error(r, 1, "cannot host the rendezvous on 127.0.0.1:" + std::to_string(port) +
                       ": the port is in use");
}

TEST(BadInput, UnreachableMasterTimesOutNamingHostAndPort) {
  const int port = free_port();  // nobody listens there
  auto r = run_process(tiny_train(2), rank_env(1, 2, port, "job-a", 2));
  expect_error(r, 1, "rank 1 could not reach the rendezvous at 127.0.0.1:" +
                       std::to_string(port) + " (rank 0's host) within 2 s");
}

TEST(BadInput, MismatchedWorldSizeFailsBothSides) {
  const int port = free_port();
  auto host = start(tiny_train(2), rank_env(0, 2, port, "job-a", 20));
  auto r1 = run_process(tiny_train(3), rank_env(1, 3, port, "job-a", 20));
  ProcResult r0 = host.get();
  expect_error(r1, 1, "was started with world size 3, rank 0 at 127.0.0.1:" +
                         std::to_string(port) + " with world size 2");
  // Rank 0 reads the refusal (after its timeout it would say "did not join" instead).
  expect_error(r0, 1, "[rank 0] error: [init_process_group] rank 0: rank 1");
}

// Security (docs/errors.md "Security"): a rank of another job reaching this job's port is
// refused at once and leaves the job undisturbed; the job's own rank then joins and it trains.
TEST(BadInput, SecondJobOnTheSamePortIsRefusedAndTheFirstRunsOn) {
  const int port = free_port();
  auto host = start(tiny_train(2), rank_env(0, 2, port, "job-a", 60));
  auto stray = run_process(tiny_train(2), rank_env(1, 2, port, "job-b", 60));
  expect_error(stray, 1, "the rendezvous at 127.0.0.1:" + std::to_string(port) +
                             " belongs to another job (job id 'job-a', this rank's is 'job-b')");
  auto own = run_process(tiny_train(2), rank_env(1, 2, port, "job-a", 60));
  ProcResult r0 = host.get();
  EXPECT_EQ(own.exit_code, 0) << own.err;
  EXPECT_EQ(r0.exit_code, 0) << r0.err;
}

TEST(BadInput, MissingRankIsNamedAfterTheRendezvousTimeout) {
  const int port = free_port();
  auto r = run_process(tiny_train(3), rank_env(0, 3, port, "job-a", 2));
  expect_error(r, 1, "2 of 2 ranks did not join the rendezvous at 127.0.0.1:" +
                         std::to_string(port) + " within 2 s (missing ranks 1,2)");
}

// Security: a one-host job's rendezvous listens on loopback only, never on every interface.
// Every listening socket on the port, IPv4 and IPv6, from /proc/net/tcp{,6} ("sl local rem st":
// hex address:port, state 0A = LISTEN).
std::vector<std::string> listeners_on(int port) {
  char port_hex[8];
  std::snprintf(port_hex, sizeof(port_hex), ":%04X", port);
  std::vector<std::string> out;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream tcp(table);
    std::string line;
    while (std::getline(tcp, line)) {
      std::istringstream in(line);
      std::string sl, local, remote, state;
      in >> sl >> local >> remote >> state;
      if (state == "0A" && local.size() > 5 && local.substr(local.size() - 5) == port_hex) {
        out.push_back(local.substr(0, local.size() - 5));
      }
    }
  }
  return out;
}

TEST(BadInput, OneHostRendezvousListensOnLoopbackOnly) {
  const int port = free_port();
  auto host = start(tiny_train(2), rank_env(0, 2, port, "job-a", 4));
  std::vector<std::string> listening;
  for (int i = 0; i < 300 && listening.empty(); ++i) {
    listening = listeners_on(port);
    if (listening.empty()) ::usleep(50000);
  }
  ProcResult r0 = host.get();  // gives up waiting for rank 1
  EXPECT_EQ(listening, std::vector<std::string>{"0100007F"})
      << "the rendezvous should listen on 127.0.0.1 (0100007F) only";
  EXPECT_EQ(r0.exit_code, 1) << r0.err;
}

}  // namespace
