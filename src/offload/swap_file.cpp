// Swap directory, reserved swap files and record integrity. See swap_file.h and
// Note [Disk tier swapper] in docs/design.md.
#include "offload/swap_file.h"

#include "offload/aio.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>

namespace fsdp::detail {

namespace {

namespace fs = std::filesystem;

std::string format_gib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

// Note [Swap cleanup at exit]
// Swap files are removed by ~SwapDir. A rank that ends through exit() (an error path that does
// not unwind) or SIGTERM (the launcher stops the other ranks when one fails) removes them too:
// the live files and directories are listed in fixed slots that an atexit handler and a
// SIGTERM handler (async-signal-safe: unlink/rmdir only, then the default action) walk.
// SIGKILL leaves them: the same job's next run takes them over, and `fsdp-ckpt swap
// --remove-stale nvme_path` removes them (Note [Swap directory ownership]).
constexpr int kSlots = 256;
constexpr int kPathMax = 1024;
char g_paths[kSlots][kPathMax];
std::atomic<int> g_kind[kSlots];  // 0 free, 1 file, 2 directory
std::mutex g_slots_mu;
struct sigaction g_old_term;

void remove_registered() {
  // Files first, then directories (rank dir before job dir: registration order, reversed).
  for (int pass = 1; pass <= 2; ++pass) {
    for (int i = kSlots - 1; i >= 0; --i) {
      if (g_kind[i].load() != pass) continue;
      if (pass == 1) {
        ::unlink(g_paths[i]);
      } else {
        ::rmdir(g_paths[i]);
      }
    }
  }
}

void on_sigterm(int sig) {
  remove_registered();
  ::sigaction(SIGTERM, &g_old_term, nullptr);
  ::raise(sig);
}

void install_handlers_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::atexit(remove_registered);
    struct sigaction sa {};
    sa.sa_handler = on_sigterm;
    sigemptyset(&sa.sa_mask);
    struct sigaction old {};
    ::sigaction(SIGTERM, nullptr, &old);
    // Only when nobody else handles SIGTERM (the default action would leave the files).
    if (old.sa_handler == SIG_DFL) {
      g_old_term = old;
      ::sigaction(SIGTERM, &sa, nullptr);
    }
  });
}

int register_path(const std::string& p, int kind) {
  install_handlers_once();
  if (p.size() + 1 > static_cast<size_t>(kPathMax)) return -1;
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (int i = 0; i < kSlots; ++i) {
    if (g_kind[i].load() != 0) continue;
    std::memcpy(g_paths[i], p.c_str(), p.size() + 1);
    g_kind[i].store(kind);
    return i;
  }
  return -1;  // out of slots: ~SwapDir still removes it
}

void unregister_path(const std::string& p) {
  std::lock_guard<std::mutex> lock(g_slots_mu);
  for (int i = 0; i < kSlots; ++i) {
    if (g_kind[i].load() != 0 && p == g_paths[i]) g_kind[i].store(0);
  }
}

// XXH64's constants and round: a fast, well-mixed 64-bit hash, here per 32-byte stripe.
constexpr uint64_t kP1 = 11400714785074694791ULL;
constexpr uint64_t kP2 = 14029467366897019727ULL;
constexpr uint64_t kP3 = 1609587929392839161ULL;
constexpr uint64_t kP4 = 9650029242287828579ULL;
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t round64(uint64_t acc, uint64_t in) { return rotl(acc + in * kP2, 31) * kP1; }

uint64_t hash_block(const uint64_t* w, int64_t words, uint64_t seed) {
  uint64_t a = seed + kP1 + kP2, b = seed + kP2, c = seed, d = seed - kP1;
  for (int64_t i = 0; i + 4 <= words; i += 4) {
    a = round64(a, w[i]);
    b = round64(b, w[i + 1]);
    c = round64(c, w[i + 2]);
    d = round64(d, w[i + 3]);
  }
  uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18);
  h ^= static_cast<uint64_t>(words) * kP4;
  h = (h ^ (h >> 33)) * kP2;
  h = (h ^ (h >> 29)) * kP3;
  return h ^ (h >> 32);
}

uint64_t header_hash(const SwapHeader& h) {
  uint64_t w[8] = {0, h.generation, h.payload_bytes, h.numel, h.checksum, 0, 0, 0};
  std::memcpy(&w[0], h.magic, 8);
  return hash_block(w, 8, 0x5157);
}

}  // namespace

int64_t free_disk_bytes(const std::string& path) {
  fs::path p = path.empty() ? fs::path(".") : fs::path(path);
  std::error_code ec;
  while (!p.empty() && !fs::exists(p, ec)) p = p.parent_path();
  if (p.empty()) p = ".";
  struct statvfs st {};
  if (::statvfs(p.c_str(), &st) != 0) return -1;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

SwapDir::SwapDir(const std::string& nvme_path, const std::string& job, int rank) {
  TORCH_CHECK(!nvme_path.empty(), "[nvme] nvme_path is empty; set it to a directory on the disk "
              "that should hold the swap files");
  job_dir_ = (fs::path(nvme_path) / job).string();
  dir_ = (fs::path(job_dir_) / ("rank" + std::to_string(rank))).string();
  // Create level by level, so that the error names the directory that could not be made.
  const bool job_existed = fs::exists(job_dir_);
  for (const std::string& d : {nvme_path, job_dir_, dir_}) {
    if (::mkdir(d.c_str(), 0700) != 0 && errno != EEXIST) {
      const int e = errno;
      TORCH_CHECK(false, "[nvme] cannot create the swap directory '", d, "': ",
                  std::strerror(e), ". HINT: nvme_path must be a writable directory on a "
                  "local disk (read-only or missing permissions?)");
    }
  }
  if (!job_existed) register_path(job_dir_, 2);
  register_path(dir_, 2);
  // A writable check up front: mkdir succeeds on an existing directory we may not write.
  TORCH_CHECK(::access(dir_.c_str(), W_OK) == 0, "[nvme] the swap directory '", dir_,
              "' is not writable: ", std::strerror(errno),
              ". HINT: point nvme_path at a writable directory");
  // Note [Swap directory ownership]: no swap file is opened before this process owns dir_.
  const bool first_holder = !SwapDirLock::held_here(dir_);
  lock_ = SwapDirLock::acquire(dir_, job);
  register_path(lock_->file(), 1);
  if (first_holder && rank == 0) {
    if (std::string notice = stale_swap_notice(nvme_path, job); !notice.empty()) {
      std::cerr << notice << std::endl;
    }
  }
}

SwapDir::~SwapDir() { remove_all(); }

void SwapDir::remove_all() noexcept {
  for (int fd : fds_) ::close(fd);
  fds_.clear();
  for (const auto& f : files_) {
    ::unlink(f.c_str());
    unregister_path(f);
  }
  files_.clear();
  if (lock_ && lock_.use_count() == 1) unregister_path(lock_->file());
  lock_.reset();  // the last holder removes the owner record and dir_ (when empty)
  ::rmdir(dir_.c_str());
  unregister_path(dir_);
  ::rmdir(job_dir_.c_str());  // only when empty: other ranks may still use it
  unregister_path(job_dir_);
}

int SwapDir::create(const std::string& name, int64_t bytes) {
  const std::string path = (fs::path(dir_) / name).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int e = errno;
    TORCH_CHECK(false, "[nvme] cannot open swap file '", path, "' with O_DIRECT: ",
                std::strerror(e),
                e == EINVAL ? ". HINT: this filesystem does not support O_DIRECT (tmpfs on an "
                              "old kernel?); point nvme_path at a disk"
                            : ". HINT: point nvme_path at a writable directory on a local disk");
  }
  files_.push_back(path);
  fds_.push_back(fd);
  register_path(path, 1);
  // Reserve every block now: a full disk fails here, before training, not in the middle of a
  // step. EOPNOTSUPP (a filesystem without fallocate) falls back to ftruncate.
  int rc = ::posix_fallocate(fd, 0, bytes);
  if (rc == EOPNOTSUPP || rc == EINVAL) rc = ::ftruncate(fd, bytes) == 0 ? 0 : errno;
  if (rc != 0) {
    const int64_t free_bytes = free_disk_bytes(dir_);
    TORCH_CHECK(false, "[nvme] cannot reserve ", bytes, " bytes (", format_gib(bytes),
                ") for swap file '", path, "': ", std::strerror(rc), ". Free space under '",
                dir_, "': ", free_bytes < 0 ? std::string("unknown") : format_gib(free_bytes),
                rc == EFBIG ? " (the process's file size limit, ulimit -f, is lower)" : "",
                ". HINT: free space, point nvme_path at a larger disk, or lower the state "
                "per rank (more ranks)");
  }
  return fd;
}

uint64_t swap_checksum(const void* data, int64_t bytes) {
  TORCH_INTERNAL_ASSERT(bytes % 32 == 0, "swap_checksum: ", bytes, " is not a multiple of 32");
  constexpr int64_t kBlock = int64_t{1} << 20;
  const int64_t blocks = (bytes + kBlock - 1) / kBlock;
  std::vector<uint64_t> parts(static_cast<size_t>(std::max<int64_t>(blocks, 1)), 0);
  const auto* base = static_cast<const char*>(data);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = std::min(kBlock, bytes - b * kBlock);
      parts[b] = hash_block(reinterpret_cast<const uint64_t*>(base + b * kBlock), n / 8,
                            static_cast<uint64_t>(b));
    }
  });
  parts.resize(align_up(static_cast<int64_t>(parts.size()), 4));
  return hash_block(parts.data(), static_cast<int64_t>(parts.size()), 0xF5D9);
}

void seal_swap_record(char* record, uint64_t generation, int64_t payload_bytes, int64_t numel) {
  auto* h = reinterpret_cast<SwapHeader*>(record);
  std::memset(record, 0, kAioAlignment);
  std::memcpy(h->magic, "FSDPSWP1", 8);
  h->generation = generation;
  h->payload_bytes = static_cast<uint64_t>(payload_bytes);
  h->numel = static_cast<uint64_t>(numel);
  h->checksum = swap_checksum(record + kAioAlignment, payload_bytes);
  h->header_checksum = header_hash(*h);
}

void verify_swap_record(const char* record, uint64_t generation, int64_t payload_bytes,
                        int64_t numel, const std::string& path) {
  const auto* h = reinterpret_cast<const SwapHeader*>(record);
  const char* what = nullptr;
  if (std::memcmp(h->magic, "FSDPSWP1", 8) != 0) {
    what = "no swap header (overwritten or never written)";
  } else if (h->header_checksum != header_hash(*h)) {
    what = "its header checksum does not match (torn or corrupted header)";
  } else if (h->generation != generation) {
    what = "it holds an older or newer write than the last one (a write that did not land)";
  } else if (h->payload_bytes != static_cast<uint64_t>(payload_bytes) ||
             h->numel != static_cast<uint64_t>(numel)) {
    what = "its sizes differ from this run's (a foreign file)";
  } else if (h->checksum != swap_checksum(record + kAioAlignment, payload_bytes)) {
    what = "its data checksum does not match (a torn or corrupted write)";
  }
  TORCH_CHECK(what == nullptr, "[nvme] swap file '", path, "' is corrupt: ", what,
              " (expected write #", generation, ", found #", h->generation, "). The optimizer "
              "state it held is lost; training stops rather than use it. HINT: resume from the "
              "last checkpoint, and check the disk under nvme_path");
}

}  // namespace fsdp::detail
