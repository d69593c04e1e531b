// Ownership of the disk tier's swap directories. See swap_owner.h.
//
// Note [Swap directory ownership]
// Swap files live in nvme_path/<job>/rank<r>/ and are truncated and rewritten by whoever opens
// them, so two processes in one rank directory corrupt each other silently (two jobs started
// with the same job id on one nvme_path did). Each rank directory therefore has an owner:
// the process holding an exclusive flock(2) on rank<r>/owner.lock, which also records its pid,
// host, job and start time for the messages. The lock is
//   - taken before any swap file is opened (SwapDir's constructor); a live holder is an error
//     naming it, so the second job stops at setup and the first never notices;
//   - shared by the swappers of one process (the optimizer's and the parameters' use the same
//     directory; flock conflicts between two opens even within one process);
//   - released by the kernel when its holder dies, however it dies. A directory whose lock
//     nobody holds is stale: the next run of the same job takes it over (its swap files are
//     scratch of that job: a restart after kill -9 reuses them, which is what resuming from a
//     checkpoint with the disk tier does), and other jobs' runs name it once at setup with the
//     command that removes it (`fsdp-ckpt swap --remove-stale PATH`);
//   - removed with the directory by its last holder (owner.lock is unlinked while still held,
//     so a process opening it meanwhile either finds the old, locked file and retries, or
//     creates a new one; the identity check below tells the two apart).
// A probe (listing, or the stale notice) holds a shared lock for a moment; a job starting at
// that instant retries for half a second before it calls the directory taken.
#include "offload/swap_owner.h"

#include "common/process.h"

#include "fsdp/memory.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

namespace fsdp::detail {

namespace {

namespace fs = std::filesystem;

constexpr const char* kOwnerFile = "owner.lock";

// The owner record: "pid=…\nhost=…\njob=…\nsince=…\n". Returns false when `fd` holds none.
bool read_owner(int fd, SwapOwner* out) {
  char buf[1024];
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return false;
  buf[n] = 0;
  std::istringstream in(buf);
  std::string line;
  bool any = false;
  while (std::getline(in, line)) {
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "pid") {
      out->pid = std::strtol(value.c_str(), nullptr, 10);
      any = true;
    } else if (key == "host") {
      out->host = value;
    } else if (key == "job") {
      out->job = value;
    } else if (key == "since") {
      out->since = value;
    }
  }
  return any;
}

void write_owner(int fd, const SwapOwner& o, const std::string& file) {
  const std::string text = "pid=" + std::to_string(o.pid) + "\nhost=" + o.host + "\njob=" +
                           o.job + "\nsince=" + o.since + "\n";
  const bool ok = ::ftruncate(fd, 0) == 0 &&
                  ::pwrite(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size());
  TORCH_CHECK(ok, "[nvme] cannot write the owner record '", file, "': ", std::strerror(errno),
              ". HINT: nvme_path must be a writable directory on a local disk");
}

// True when `fd` is still the file linked at `path` (not unlinked by a releasing owner).
bool still_linked(int fd, const std::string& path) {
  struct stat a {}, b {};
  return ::fstat(fd, &a) == 0 && ::stat(path.c_str(), &b) == 0 && a.st_ino == b.st_ino &&
         a.st_dev == b.st_dev;
}

// Whether some process holds the lock of `file` now; reads its record into `owner`.
bool probe_owner(const std::string& file, SwapOwner* owner, bool* has_owner) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *has_owner = false;
    return false;
  }
  *has_owner = read_owner(fd, owner);
  bool held = false;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    held = errno == EWOULDBLOCK;
  } else {
    ::flock(fd, LOCK_UN);
  }
  ::close(fd);
  return held;
}

// The live locks of this process, by directory.
std::mutex g_mu;
std::map<std::string, std::weak_ptr<SwapDirLock>>& live_locks() {
  static auto* m = new std::map<std::string, std::weak_ptr<SwapDirLock>>();
  return *m;
}

}  // namespace

std::string describe(const SwapOwner& o) {
  std::string s = "pid " + std::to_string(o.pid) + " on host " + (o.host.empty() ? "?" : o.host);
  if (!o.job.empty() || !o.since.empty()) {
    s += " (job " + (o.job.empty() ? std::string("?") : o.job);
    if (!o.since.empty()) s += ", since " + o.since;
    s += ")";
  }
  return s;
}

SwapDirLock::SwapDirLock(std::string dir, std::string file, int fd) noexcept
    : dir_(std::move(dir)), file_(std::move(file)), fd_(fd) {}

SwapDirLock::~SwapDirLock() {
  ::unlink(file_.c_str());  // while still held: see the Note
  ::close(fd_);
  ::rmdir(dir_.c_str());  // only when empty
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = live_locks().find(dir_);
  if (it != live_locks().end() && it->second.expired()) live_locks().erase(it);
}

bool SwapDirLock::held_here(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = live_locks().find(dir);
  return it != live_locks().end() && !it->second.expired();
}

std::shared_ptr<SwapDirLock> SwapDirLock::acquire(const std::string& dir, const std::string& job) {
  std::lock_guard<std::mutex> guard(g_mu);
  auto& live = live_locks();
  if (auto it = live.find(dir); it != live.end()) {
    if (auto held = it->second.lock()) return held;
  }
  const std::string file = (fs::path(dir) / kOwnerFile).string();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  for (int attempt = 0;; ++attempt) {
    TORCH_CHECK(attempt < 1000, "[nvme] cannot take the swap directory '", dir,
                "': it keeps being removed and recreated by another process");
    const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
      const int e = errno;
      // The directory was removed by its releasing owner between our mkdir and this open.
      if (e == ENOENT) {
        ::mkdir(fs::path(dir).parent_path().c_str(), 0700);
        if (::mkdir(dir.c_str(), 0700) == 0) continue;
      }
      TORCH_CHECK(false, "[nvme] cannot open the owner record '", file, "': ", std::strerror(e),
                  ". HINT: nvme_path must be a writable directory on a local disk");
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      SwapOwner other;
      const bool known = read_owner(fd, &other);
      ::close(fd);
      TORCH_CHECK(e == EWOULDBLOCK, "[nvme] cannot lock '", file, "': ", std::strerror(e),
                  ". HINT: nvme_path must be on a filesystem that supports flock");
      if (std::chrono::steady_clock::now() < deadline) {  // a probe's moment, or a release
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      TORCH_CHECK(false, "[nvme] the swap directory '", dir, "' is in use by another job: ",
                  known ? describe(other) : std::string("a process that left no owner record"),
                  ". Two jobs with the same job id must not share nvme_path; give this job its "
                  "own FSDP_JOB_ID (or NvmeOffloadOptions::job) or its own --nvme-path");
    }
    if (!still_linked(fd, file)) {  // we locked a record its owner had just unlinked
      ::close(fd);
      continue;
    }
    SwapOwner before;
    if (read_owner(fd, &before) && before.pid != ::getpid()) {
      std::cerr << "[nvme] taking over the swap directory '" << dir << "' left by an earlier run ("
                << describe(before) << ") that ended without removing it; its swap files are "
                << "rewritten" << std::endl;
    }
    SwapOwner me;
    me.pid = ::getpid();
    me.host = host_name();
    me.job = job;
    me.since = utc_now();
    try {
      write_owner(fd, me, file);
    } catch (...) {
      ::close(fd);  // not yet a SwapDirLock, whose destructor takes g_mu
      throw;
    }
    std::shared_ptr<SwapDirLock> lock(new SwapDirLock(dir, file, fd));
    live[dir] = lock;
    return lock;
  }
}

bool is_swap_file_name(const std::string& name) {
  auto numbered = [&](const std::string& prefix) {
    const std::string suffix = ".swp";
    if (name.size() <= prefix.size() + suffix.size()) return false;
    if (name.compare(0, prefix.size(), prefix) != 0) return false;
    if (name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) return false;
    for (size_t i = prefix.size(); i < name.size() - suffix.size(); ++i) {
      if (name[i] < '0' || name[i] > '9') return false;
    }
    return true;
  };
  return numbered("optimizer.subgroup") || numbered("params.unit");
}

std::vector<SwapDirEntry> list_swap_dirs(const std::string& nvme_path) {
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(nvme_path, ec), "[nvme] '", nvme_path,
              "' is not a directory; give the nvme_path the jobs were run with");
  std::vector<SwapDirEntry> out;
  for (const auto& job : fs::directory_iterator(nvme_path, ec)) {
    if (!job.is_directory(ec)) continue;
    for (const auto& rank : fs::directory_iterator(job.path(), ec)) {
      const std::string name = rank.path().filename().string();
      if (!rank.is_directory(ec) || name.rfind("rank", 0) != 0 || name.size() == 4 ||
          name.find_first_not_of("0123456789", 4) != std::string::npos) {
        continue;
      }
      SwapDirEntry e;
      e.path = rank.path().string();
      e.job = job.path().filename().string();
      e.running = probe_owner((rank.path() / kOwnerFile).string(), &e.owner, &e.has_owner);
      for (const auto& f : fs::directory_iterator(rank.path(), ec)) {
        const std::string fname = f.path().filename().string();
        if (fname == kOwnerFile) continue;
        if (f.is_regular_file(ec) && is_swap_file_name(fname)) {
          ++e.swap_files;
          e.swap_bytes += static_cast<int64_t>(f.file_size(ec));
        } else {
          e.other_files.push_back(f.path().string());
        }
      }
      // A rank directory of a dead job with no owner record and no swap files is not ours.
      if (!e.has_owner && e.swap_files == 0) continue;
      out.push_back(std::move(e));
    }
  }
  TORCH_CHECK(!ec, "[nvme] cannot read '", nvme_path, "': ", ec.message());
  std::sort(out.begin(), out.end(),
            [](const SwapDirEntry& a, const SwapDirEntry& b) { return a.path < b.path; });
  return out;
}

StaleSwapRemoval remove_stale_swap_dirs(const std::string& nvme_path) {
  StaleSwapRemoval out;
  for (const SwapDirEntry& e : list_swap_dirs(nvme_path)) {
    if (e.running) continue;
    // Own the directory while removing it: a job starting now waits, then finds it gone or
    // creates it afresh.
    const std::string file = (fs::path(e.path) / kOwnerFile).string();
    const int fd = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      if (fd >= 0) ::close(fd);
      continue;  // taken meanwhile: not stale any more
    }
    std::error_code ec;
    for (const auto& f : fs::directory_iterator(e.path, ec)) {
      const std::string fname = f.path().filename().string();
      if (fname == kOwnerFile || !is_swap_file_name(fname)) continue;
      const auto bytes = static_cast<int64_t>(f.file_size(ec));
      if (::unlink(f.path().c_str()) == 0) out.removed_bytes += bytes;
    }
    ::unlink(file.c_str());
    ::close(fd);
    if (::rmdir(e.path.c_str()) == 0) {
      out.removed_dirs.push_back(e.path);
      ::rmdir(fs::path(e.path).parent_path().c_str());  // the job directory, when empty
    }
    out.kept_files.insert(out.kept_files.end(), e.other_files.begin(), e.other_files.end());
  }
  return out;
}

std::string stale_swap_notice(const std::string& nvme_path, const std::string& own_job) {
  std::vector<SwapDirEntry> entries;
  try {
    entries = list_swap_dirs(nvme_path);
  } catch (const c10::Error&) {
    return "";  // a notice, never a reason to fail setup
  }
  std::vector<std::string> jobs;
  int64_t bytes = 0;
  int dirs = 0;
  for (const auto& e : entries) {
    if (e.running || e.job == own_job) continue;
    ++dirs;
    bytes += e.swap_bytes;
    if (jobs.empty() || jobs.back() != e.job) jobs.push_back(e.job);
  }
  if (dirs == 0) return "";
  std::string names;
  for (size_t i = 0; i < jobs.size() && i < 5; ++i) names += (i ? ", " : "") + jobs[i];
  if (jobs.size() > 5) names += ", ...";
  return "[nvme] " + std::to_string(dirs) + " swap director" + (dirs == 1 ? "y" : "ies") +
         " under '" + nvme_path + "' belong to jobs that are not running (" + names + "; " +
         format_bytes(bytes) + "); remove them with: fsdp-ckpt swap --remove-stale " + nvme_path;
}

}  // namespace fsdp::detail
