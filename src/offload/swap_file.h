// The disk tier's files: a per-rank swap directory nvme_path/<job>/rank<r>/ (removed when its
// owner goes away, at exit too), swap files reserved up front (a full disk fails at setup, with
// the bytes needed), and the integrity header every swap record starts with.
// See Note [Disk tier swapper] in docs/design.md.
#pragma once

#include "offload/swap_owner.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

// Free bytes for an unprivileged writer (statvfs f_bavail) on the filesystem holding `path` or
// its closest existing parent; -1 when none can be examined.
int64_t free_disk_bytes(const std::string& path);

class SwapDir {
 public:
  // Creates nvme_path/<job>/rank<rank>/ (parents included) and takes its ownership (Note [Swap
  // directory ownership] in src/offload/swap_owner.cpp): another live job in it is an error
  // naming that job's pid and host. An unwritable or read-only nvme_path is an error naming it.
  SwapDir(const std::string& nvme_path, const std::string& job, int rank);
  ~SwapDir();  // closes and removes every file, the rank directory, and the job directory if empty
  SwapDir(const SwapDir&) = delete;
  SwapDir& operator=(const SwapDir&) = delete;

  const std::string& path() const { return dir_; }
  // Creates `name` (O_DIRECT) and reserves `bytes` (fallocate): a full disk or a file size
  // limit is one error naming the file, the bytes needed and the free space. Returns the fd.
  int create(const std::string& name, int64_t bytes);
  const std::vector<std::string>& files() const { return files_; }

 private:
  void remove_all() noexcept;
  std::string dir_;
  std::string job_dir_;
  std::shared_ptr<SwapDirLock> lock_;
  std::vector<std::string> files_;
  std::vector<int> fds_;
};

// Note [Swap record integrity]: the first kAioAlignment bytes of every swap record.
struct SwapHeader {
  char magic[8];            // "FSDPSWP1"
  uint64_t generation = 0;  // how many times this record was written (1 = first write)
  uint64_t payload_bytes = 0;
  uint64_t numel = 0;
  uint64_t checksum = 0;         // of the payload
  uint64_t header_checksum = 0;  // of the fields above
};

// A 64-bit checksum of `bytes` (a multiple of 32) at `data`, computed in parallel 1 MiB blocks.
uint64_t swap_checksum(const void* data, int64_t bytes);

// Fills the header at `record` (payload follows at kAioAlignment).
void seal_swap_record(char* record, uint64_t generation, int64_t payload_bytes, int64_t numel);
// Checks the header at `record` against what was last written: magic, generation, sizes and
// checksum. A mismatch (torn write, stale or foreign data) is an error naming `path`.
void verify_swap_record(const char* record, uint64_t generation, int64_t payload_bytes,
                        int64_t numel, const std::string& path);

}  // namespace fsdp::detail
