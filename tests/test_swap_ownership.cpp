// Ownership of the disk tier's swap directories (Note [Swap directory ownership] in
// src/offload/swap_owner.cpp): a second job with the same job id on the same nvme_path is
// refused at setup, naming the first; the swappers of one process share their directory; the
// directories of killed jobs are taken over by the same job, named to the others, and removed
// by `fsdp-ckpt swap --remove-stale` (nothing else is).
#include "offload/swap_file.h"
#include "offload/swap_owner.h"
#include "testing.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using fsdp::detail::SwapDir;

fs::path test_root() {
  return fs::temp_directory_path() / ("fsdp_swap_owner_tests-" + std::to_string(::getpid()));
}

std::string fresh_dir(const std::string& name) {
  const fs::path d = test_root() / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

// Removes this run's directories once every test ran.
class RemoveTestRoot : public ::testing::Environment {
 public:
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(test_root(), ec);
  }
};
const auto* const g_cleanup = ::testing::AddGlobalTestEnvironment(new RemoveTestRoot);

std::string host() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A job killed with SIGKILL while it owned nvme_path/<job>/rank0/ with one swap file: its pid.
pid_t killed_owner(const std::string& nvme, const std::string& job) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    SwapDir d(nvme, job, 0);
    d.create("params.unit0.swp", 8192);
    ::raise(SIGKILL);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  return pid;
}

std::vector<std::string> train_argv(const std::string& nvme, int devices = 2) {
  return {fsdp::testing::bin_path("fsdp-train"), "--model", "transformer-tiny", "--data",
          "synthetic", "--vocab-size", "1024", "--max-steps", "3", "--no-progress-bar",
          "--devices", std::to_string(devices), "--backend", "gloo", "--strategy",
          "deepspeed_stage_2", "--offload-optimizer-device", "nvme", "--nvme-path", nvme,
          "--default-root-dir", nvme + "/../logs"};
}

// Whether another process (fsdp-train, one rank, job `job`) can take nvme_path/<job>/rank0/
// now. (A forked child would not do: it inherits this process's lock.)
bool another_process_can_take(const std::string& nvme, const std::string& job) {
  const auto r = fsdp::testing::run_process(train_argv(nvme, 1), {{"FSDP_JOB_ID", job}});
  if (r.exit_code != 0 && r.err.find("in use by another job") == std::string::npos) {
    ADD_FAILURE() << "fsdp-train failed for another reason:\n" << r.err;
  }
  return r.exit_code == 0;
}


}  // namespace

// Two jobs started with one FSDP_JOB_ID on one --nvme-path used to truncate and rewrite each
// other's swap files (wrong losses in one, a "corrupt" swap file in the other). Here the first
// "job" is this test process owning rank 0's directory with a swap file in it: fsdp-train is
// refused at setup with one error naming this process's pid and host, and the swap file is
// untouched.
TEST(SwapOwnership, SecondJobWithTheSameIdIsRefusedNamingTheFirst) {
  const std::string nvme = fresh_dir("same-id");
  {
    SwapDir first(nvme, "exp1", 0);
    first.create("optimizer.subgroup0.swp", 4096);
    const std::string swap = first.files()[0];
    // O_DIRECT files take plain writes too when not opened O_DIRECT here.
    {
      std::fstream f(swap, std::ios::in | std::ios::out | std::ios::binary);
      f << "the first job's moments";
    }
    const auto r = fsdp::testing::run_process(train_argv(nvme), {{"FSDP_JOB_ID", "exp1"}});
    EXPECT_NE(r.exit_code, 0) << r.err;
    const std::string want = "in use by another job: pid " + std::to_string(::getpid()) +
                             " on host " + host() + " (job exp1";
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("FSDP_JOB_ID"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("Exception raised from"), std::string::npos) << r.err;
    EXPECT_EQ(read_file(swap).substr(0, 23), "the first job's moments")
        << "the second job wrote into the first job's swap file";
    EXPECT_EQ(fs::file_size(swap), 4096u);
  }
  EXPECT_TRUE(fs::is_empty(nvme)) << "files left under " << nvme;
  // A second job with its own id on the same path trains.
  const auto r = fsdp::testing::run_process(train_argv(nvme), {{"FSDP_JOB_ID", "exp2"}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_empty(nvme)) << "files left under " << nvme;
}

// The optimizer's and the parameters' swappers of one rank open one directory: they share its
// lock; it is held until the last of them goes, and the directory then disappears.
TEST(SwapOwnership, SwappersOfOneProcessShareTheDirectory) {
  const std::string nvme = fresh_dir("shared");
  {
    auto a = std::make_unique<SwapDir>(nvme, "job", 0);
    auto b = std::make_unique<SwapDir>(nvme, "job", 0);
    a->create("optimizer.subgroup0.swp", 4096);
    b->create("params.unit0.swp", 4096);
    EXPECT_FALSE(another_process_can_take(nvme, "job"));
    a.reset();
    EXPECT_FALSE(another_process_can_take(nvme, "job")) << "released while b still uses it";
    EXPECT_TRUE(fs::exists(b->files()[0]));
    b.reset();
  }
  EXPECT_TRUE(fs::is_empty(nvme)) << "files left under " << nvme;
  EXPECT_TRUE(another_process_can_take(nvme, "job"));
  EXPECT_TRUE(fs::is_empty(nvme)) << "files left under " << nvme;
}

// A job killed with SIGKILL leaves its directory; a restart of the same job takes it over (the
// disk tier's resume path), other jobs' runs name it with the command that removes it, and that
// command removes only swap files of jobs that are not running.
TEST(SwapOwnership, StaleDirectoriesAreTakenOverNamedAndRemovedByOneCommand) {
  const std::string nvme = fresh_dir("stale");
  const pid_t dead = killed_owner(nvme, "same");
  ASSERT_TRUE(fs::exists(nvme + "/same/rank0/params.unit0.swp"));
  {  // the same job restarted: no error; it rewrites its swap files
    SwapDir again(nvme, "same", 0);
    again.create("params.unit0.swp", 8192);
  }
  EXPECT_FALSE(fs::exists(nvme + "/same")) << "the restarted job did not remove its directory";

  const pid_t old = killed_owner(nvme, "old");
  write_file(nvme + "/old/rank0/notes.txt", "a user's file");
  write_file(nvme + "/readme.txt", "another user's file");
  auto entries = fsdp::detail::list_swap_dirs(nvme);
  ASSERT_EQ(entries.size(), 1u);
  EXPECT_FALSE(entries[0].running);
  EXPECT_EQ(entries[0].owner.pid, old);
  EXPECT_EQ(entries[0].swap_files, 1);

  // Another job's run names the stale directory and the command, and trains.
  const auto run = fsdp::testing::run_process(train_argv(nvme), {{"FSDP_JOB_ID", "new"}});
  EXPECT_EQ(run.exit_code, 0) << run.err;
  EXPECT_NE(run.err.find("belong to jobs that are not running (old;"), std::string::npos)
      << run.err;
  EXPECT_NE(run.err.find("fsdp-ckpt swap --remove-stale " + nvme), std::string::npos) << run.err;

  SwapDir live(nvme, "live", 0);  // a running job: listed, never removed
  live.create("optimizer.subgroup0.swp", 4096);
  const auto list = fsdp::testing::run_process({fsdp::testing::bin_path("fsdp-ckpt"), "swap", nvme});
  EXPECT_EQ(list.exit_code, 0) << list.err;
  EXPECT_NE(list.out.find(nvme + "/old/rank0: stale, left by pid " + std::to_string(old)),
            std::string::npos) << list.out;
  EXPECT_NE(list.out.find(nvme + "/live/rank0: in use by pid " + std::to_string(::getpid())),
            std::string::npos) << list.out;
  EXPECT_NE(list.out.find("2 swap directories, 1 stale"), std::string::npos) << list.out;

  const auto rm = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-ckpt"), "swap", "--remove-stale", nvme});
  EXPECT_EQ(rm.exit_code, 0) << rm.err;
  EXPECT_NE(rm.out.find("kept " + nvme + "/old/rank0/notes.txt"), std::string::npos) << rm.out;
  EXPECT_FALSE(fs::exists(nvme + "/old/rank0/params.unit0.swp"));
  EXPECT_FALSE(fs::exists(nvme + "/old/rank0/owner.lock"));
  EXPECT_EQ(read_file(nvme + "/old/rank0/notes.txt"), "a user's file");
  EXPECT_EQ(read_file(nvme + "/readme.txt"), "another user's file");
  EXPECT_TRUE(fs::exists(live.files()[0])) << "a running job's swap file was removed";
  EXPECT_FALSE(another_process_can_take(nvme, "live"));
  (void)dead;

  const auto bad = fsdp::testing::run_process(
      {fsdp::testing::bin_path("fsdp-ckpt"), "swap", nvme + "/missing"});
  EXPECT_EQ(bad.exit_code, 2);  // refused when the command line is parsed
  EXPECT_NE(bad.err.find(nvme + "/missing' does not exist"), std::string::npos) << bad.err;
}
