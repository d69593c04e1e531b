// detail::AioEngine: io_uring workers. See aio.h and Note [Disk tier swapper] in docs/design.md.
#include "offload/aio.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <liburing.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <deque>

namespace fsdp::detail {

namespace {

struct Piece {
  AioTicket req;
  int fd = -1;
  char* buf = nullptr;
  int64_t bytes = 0;
  int64_t offset = 0;
};

void finish_piece(const Piece& p, int64_t res) {
  std::string err;
  if (res < 0) {
    err = std::string(std::strerror(static_cast<int>(-res)));
  } else if (res != p.bytes) {
    err = "short " + std::string(p.req->write ? "write" : "read") + " (" + std::to_string(res) +
          " of " + std::to_string(p.bytes) + " bytes)";
  }
  std::lock_guard<std::mutex> lock(p.req->mu);
  if (!err.empty() && p.req->error.empty()) {
    const int64_t at = p.offset;
    if (p.req->write) {
      p.req->error = "[nvme] writing " + std::to_string(p.req->bytes) + " bytes to '" +
                     p.req->path + "' failed at offset " + std::to_string(at) + ": " + err +
                     ". The swap file needs " + std::to_string(p.req->offset + p.req->bytes) +
                     " bytes; free space on its filesystem (nvme_path), or point nvme_path "
                     "at a larger disk";
    } else {
      p.req->error = "[nvme] reading " + std::to_string(p.req->bytes) + " bytes from '" +
                     p.req->path + "' failed at offset " + std::to_string(at) + ": " + err +
                     " (a truncated or removed swap file?)";
    }
  }
  if (--p.req->pending == 0) p.req->cv.notify_all();
}

}  // namespace

// One ring and the thread that drives it.
struct AioEngine::Worker {
  AioOptions o;
  io_uring ring{};
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Piece> queue;
  bool stop = false;
  std::atomic<int64_t> done_bytes{0};

  explicit Worker(const AioOptions& options) : o(options) {
    const int rc = io_uring_queue_init(static_cast<unsigned>(o.queue_depth), &ring, 0);
    TORCH_CHECK(rc == 0, "[nvme] io_uring_queue_init(", o.queue_depth, ") failed: ",
                std::strerror(-rc), ". HINT: the disk tier needs io_uring (Linux >= 5.6, not "
                "disabled by kernel.io_uring_disabled or a seccomp profile)");
    thread = std::thread([this] { run(); });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
    io_uring_queue_exit(&ring);
  }

  void push(Piece p) {
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back(std::move(p));
    }
    cv.notify_all();
  }

  // Keeps up to queue_depth pieces in flight: overlap_events refills the queue as soon as a
  // piece completes; otherwise a wave of queue_depth is submitted and fully reaped first.
  void run() {
    std::vector<Piece*> slots(static_cast<size_t>(o.queue_depth), nullptr);
    std::vector<Piece> store(static_cast<size_t>(o.queue_depth));
    int inflight = 0;
    for (;;) {
      int queued = 0;
      {
        std::unique_lock<std::mutex> lock(mu);
        if (inflight == 0) cv.wait(lock, [&] { return stop || !queue.empty(); });
        if (stop && queue.empty() && inflight == 0) return;
        const bool may_submit = o.overlap_events || inflight == 0;
        while (may_submit && inflight < o.queue_depth && !queue.empty()) {
          size_t slot = 0;
          while (slots[slot]) ++slot;
          store[slot] = std::move(queue.front());
          queue.pop_front();
          slots[slot] = &store[slot];
          Piece& p = store[slot];
          io_uring_sqe* sqe = io_uring_get_sqe(&ring);
          TORCH_INTERNAL_ASSERT(sqe, "io_uring submission queue full");
          if (p.req->write) {
            io_uring_prep_write(sqe, p.fd, p.buf, static_cast<unsigned>(p.bytes), p.offset);
          } else {
            io_uring_prep_read(sqe, p.fd, p.buf, static_cast<unsigned>(p.bytes), p.offset);
          }
          io_uring_sqe_set_data64(sqe, slot);
          ++inflight;
          ++queued;
          if (o.single_submit) io_uring_submit(&ring);
        }
      }
      if (queued > 0 && !o.single_submit) io_uring_submit(&ring);
      if (inflight == 0) continue;
      // Reap at least one completion, then whatever else is ready.
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring, &cqe);
      while (rc == -EINTR) rc = io_uring_wait_cqe(&ring, &cqe);
      TORCH_INTERNAL_ASSERT(rc == 0, "io_uring_wait_cqe: ", std::strerror(-rc));
      while (cqe) {
        const size_t slot = static_cast<size_t>(io_uring_cqe_get_data64(cqe));
        const int64_t res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        Piece& p = *slots[slot];
        if (res > 0) done_bytes += res;
        finish_piece(p, res);
        p.req.reset();
        slots[slot] = nullptr;
        --inflight;
        cqe = nullptr;
        if (io_uring_peek_cqe(&ring, &cqe) != 0) cqe = nullptr;
      }
    }
  }
};

AioEngine::AioEngine(AioOptions options) : options_(options) {
  TORCH_CHECK(!options_.use_gds, "[nvme] aio.use_gds (GPUDirect Storage) needs a GPU; this "
              "build runs on the CPU. HINT: set use_gds to false");
  TORCH_CHECK(options_.block_size >= kAioAlignment && options_.block_size % kAioAlignment == 0,
              "[nvme] aio.block_size must be a positive multiple of ", kAioAlignment,
              " bytes (O_DIRECT alignment), got ", options_.block_size);
  TORCH_CHECK(options_.block_size <= kAioMaxBlockSize, "[nvme] aio.block_size must be at "
              "most 1 GiB per request, got ", options_.block_size);
  TORCH_CHECK(options_.queue_depth >= 1 && options_.queue_depth <= kAioMaxQueueDepth,
              "[nvme] aio.queue_depth must be in [1, ", kAioMaxQueueDepth, "], got ",
              options_.queue_depth);
  TORCH_CHECK(options_.intra_op_parallelism >= 1 &&
                  options_.intra_op_parallelism <= kAioMaxIntraOpParallelism,
              "[nvme] aio.intra_op_parallelism must be in [1, ", kAioMaxIntraOpParallelism,
              "], got ",
              options_.intra_op_parallelism);
  for (int i = 0; i < options_.intra_op_parallelism; ++i) {
    workers_.push_back(std::make_unique<Worker>(options_));
  }
}

AioEngine::~AioEngine() = default;  // each worker drains its queue before it stops

int64_t AioEngine::bytes_done() const {
  int64_t n = 0;
  for (const auto& w : workers_) n += w->done_bytes.load();
  return n;
}

AioTicket AioEngine::submit(bool write, int fd, void* buf, int64_t bytes, int64_t offset,
                            const std::string& path) {
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(buf) % kAioAlignment == 0 &&
                            bytes % kAioAlignment == 0 && offset % kAioAlignment == 0,
                        "unaligned O_DIRECT transfer of ", bytes, " bytes at offset ", offset);
  auto req = std::make_shared<AioRequest>();
  req->write = write;
  req->path = path;
  req->bytes = bytes;
  req->offset = offset;
  const int64_t bs = options_.block_size;
  const int64_t pieces = (bytes + bs - 1) / bs;
  req->pending = static_cast<int>(pieces);
  if (pieces == 0) return req;
  // Contiguous runs of pieces per ring, so each ring streams a sequential range.
  const int64_t nw = static_cast<int64_t>(workers_.size());
  const int64_t per = (pieces + nw - 1) / nw;
  for (int64_t i = 0; i < pieces; ++i) {
    Piece p;
    p.req = req;
    p.fd = fd;
    p.buf = static_cast<char*>(buf) + i * bs;
    p.offset = offset + i * bs;
    p.bytes = std::min(bs, bytes - i * bs);
    workers_[static_cast<size_t>(i / per)]->push(std::move(p));
  }
  return req;
}

AioTicket AioEngine::write(int fd, const void* buf, int64_t bytes, int64_t offset,
                           const std::string& path) {
  return submit(true, fd, const_cast<void*>(buf), bytes, offset, path);
}

AioTicket AioEngine::read(int fd, void* buf, int64_t bytes, int64_t offset,
                          const std::string& path) {
  return submit(false, fd, buf, bytes, offset, path);
}

namespace {
// fsdp::disk_wait_seconds: nanoseconds callers spent blocked in AioEngine::wait.
std::atomic<int64_t> g_disk_wait_ns{0};
}  // namespace

void AioEngine::wait(const AioTicket& t) {
  if (!t) return;
  std::unique_lock<std::mutex> lock(t->mu);
  if (t->pending != 0) {
    const auto t0 = std::chrono::steady_clock::now();
    t->cv.wait(lock, [&] { return t->pending == 0; });
    g_disk_wait_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - t0).count();
  }
  TORCH_CHECK(t->error.empty(), t->error);
}

bool AioEngine::done(const AioTicket& t) {
  if (!t) return true;
  std::lock_guard<std::mutex> lock(t->mu);
  return t->pending == 0;
}

AlignedBuffer::AlignedBuffer(int64_t bytes) : bytes_(bytes) {
  storage_ = at::zeros({bytes + kAioAlignment}, at::TensorOptions().dtype(at::kByte));
  const auto base = reinterpret_cast<uintptr_t>(storage_.data_ptr());
  data_ = reinterpret_cast<char*>((base + kAioAlignment - 1) / kAioAlignment * kAioAlignment);
}

}  // namespace fsdp::detail

namespace fsdp {
double disk_wait_seconds() { return static_cast<double>(detail::g_disk_wait_ns.load()) * 1e-9; }
}  // namespace fsdp
