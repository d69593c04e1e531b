// detail::AioEngine: asynchronous O_DIRECT reads and writes through io_uring (liburing), the
// disk tier's I/O (the role of DeepSpeed's libaio handle, csrc/aio). A transfer is split into
// block_size pieces spread over intra_op_parallelism rings, each driven by its own thread that
// keeps up to queue_depth pieces in flight; the caller gets a ticket and overlaps its own work
// until wait(). See Note [Disk tier swapper] in docs/design.md.
#pragma once

#include "fsdp/offload.h"

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdp::detail {

// O_DIRECT needs the buffer address, the file offset and the length aligned to the logical
// block size of the device (512 B or 4 KiB); 4 KiB covers both.
constexpr int64_t kAioAlignment = 4096;
inline int64_t align_up(int64_t n, int64_t a = kAioAlignment) { return (n + a - 1) / a * a; }
// The bounds of AioOptions the engine accepts (checked again by the DeepSpeed config parser, so
// a bad "aio" block is refused when the config is read rather than when the disk tier starts).
constexpr int64_t kAioMaxBlockSize = int64_t{1} << 30;  // bytes per request
constexpr int kAioMaxQueueDepth = 4096;                 // requests in flight per ring
constexpr int kAioMaxIntraOpParallelism = 64;           // rings (threads)

// One transfer in flight: done when every piece has completed; the first failure is kept.
struct AioRequest {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  std::string error;  // empty: no failure
  bool write = false;
  std::string path;
  int64_t bytes = 0;
  int64_t offset = 0;
};
using AioTicket = std::shared_ptr<AioRequest>;

class AioEngine {
 public:
  explicit AioEngine(AioOptions options);
  ~AioEngine();  // waits for every transfer in flight
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Starts a transfer of `bytes` between `buf` and file `fd` at `offset` (all multiples of
  // kAioAlignment; `path` names the file in errors).
  AioTicket write(int fd, const void* buf, int64_t bytes, int64_t offset, const std::string& path);
  AioTicket read(int fd, void* buf, int64_t bytes, int64_t offset, const std::string& path);
  // Blocks until the transfer completed; throws its error (path, offset, bytes, errno text).
  static void wait(const AioTicket& ticket);
  // True when the transfer has completed (or there is none); never blocks. wait() then
  // returns at once (and throws its error, if any).
  static bool done(const AioTicket& ticket);

  const AioOptions& options() const { return options_; }
  // Bytes moved since construction (completed pieces), for the benchmark.
  int64_t bytes_done() const;

 private:
  struct Worker;
  AioTicket submit(bool write, int fd, void* buf, int64_t bytes, int64_t offset,
                   const std::string& path);
  AioOptions options_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

// A page-aligned host buffer allocated through the CPU allocator (so the tracking allocator
// and the memory budget count it). Zero-filled.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(int64_t bytes);
  char* data() const { return data_; }
  int64_t size() const { return bytes_; }

 private:
  at::Tensor storage_;  // the allocation (bytes + alignment slack)
  char* data_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace fsdp::detail
