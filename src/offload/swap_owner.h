// Who owns a disk-tier swap directory, and which ones outlived their job.
// See Note [Swap directory ownership] in src/offload/swap_owner.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

// The owner record in a rank's swap directory: nvme_path/<job>/rank<r>/owner.lock.
struct SwapOwner {
  long pid = 0;
  std::string host;
  std::string job;
  std::string since;  // UTC, when the owner took the directory
};

// "pid 1234 on host node7 (job exp1, since 2026-11-27T22:10:00Z)".
std::string describe(const SwapOwner& owner);

// An exclusive flock on dir/owner.lock, held while it lives and shared by every holder in this
// process (the optimizer's and the parameters' swappers of one rank use one directory).
class SwapDirLock {
 public:
  // Takes the lock of `dir` (an existing directory) for `job`. Another live process holding it
  // is an error naming that process's pid, host and job. The record of an owner that ended
  // without removing it (killed) is taken over with one line on stderr.
  static std::shared_ptr<SwapDirLock> acquire(const std::string& dir, const std::string& job);
  ~SwapDirLock();  // removes owner.lock, then the directory when it is empty
  SwapDirLock(const SwapDirLock&) = delete;
  SwapDirLock& operator=(const SwapDirLock&) = delete;

  const std::string& file() const { return file_; }
  // Whether this process holds the lock of `dir` now.
  static bool held_here(const std::string& dir);

 private:
  SwapDirLock(std::string dir, std::string file, int fd) noexcept;
  std::string dir_;
  std::string file_;
  int fd_ = -1;
};

// One rank directory nvme_path/<job>/rank<r>/ and what holds it.
struct SwapDirEntry {
  std::string path;
  std::string job;
  bool running = false;    // its owner holds the lock now
  bool has_owner = false;  // an owner record was found (directories of older versions have none)
  SwapOwner owner;
  int64_t swap_files = 0;
  int64_t swap_bytes = 0;
  std::vector<std::string> other_files;  // anything that is not a swap file or the owner record
};

// True for the names the disk tier gives its swap files (src/offload/nvme_adam.cpp:
// optimizer.subgroup<g>.swp; src/offload/param_swapper.cpp: params.unit<i>.swp).
bool is_swap_file_name(const std::string& name);

// Every rank directory under nvme_path/*/rank<r>/, sorted by path; an unreadable or missing
// nvme_path is an error naming it.
std::vector<SwapDirEntry> list_swap_dirs(const std::string& nvme_path);

struct StaleSwapRemoval {
  std::vector<std::string> removed_dirs;
  int64_t removed_bytes = 0;
  std::vector<std::string> kept_files;  // files in stale directories that are not swap files
};
// Removes the swap files and owner records of every rank directory whose owner is not running
// (each taken under its lock first, so a job starting meanwhile is never touched), and those
// directories and their job directories once empty. Files the disk tier did not write are kept
// and listed.
StaleSwapRemoval remove_stale_swap_dirs(const std::string& nvme_path);

// One line naming the swap directories under nvme_path (other than job `own_job`'s) whose jobs
// are not running, their size and the command that removes them; "" when there are none.
std::string stale_swap_notice(const std::string& nvme_path, const std::string& own_job);

}  // namespace fsdp::detail
