// NCCL backend: see src/cuda/nccl_process_group.h.
#include "cuda/nccl_process_group.h"

#include "comm/process_group_impl.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <optional>
#include <sstream>
#include <thread>

namespace fsdp::detail {

// Note [NCCL streams]
// ~~~~~~~~~~~~~~~~~~~
// As FSDP2 does it: every group owns two streams from c10's pool, one for all-gathers (and
// broadcasts) and one for reduce-scatters (and all-reduces, all-to-alls, barriers). A collective
// is issued as
//   1. record `ready` on the caller's current stream (the compute stream that wrote the input);
//   2. the collective's stream waits on `ready` (cudaStreamWaitEvent: a device-side wait);
//   3. the NCCL call is enqueued on the collective's stream; record `done` there;
//   4. Work::wait() makes the caller's *current* stream wait on `done` (device-side again).
// The host never synchronizes on this path: it only enqueues. The exception is barrier(), whose
// meaning is host-side (every rank reached it), so its wait() synchronizes `done`.
// NCCL runs the kernels of one communicator in the order they were issued, whatever the stream:
// the two streams order copy-in/copy-out and compute against each collective separately (an
// all-gather does not wait behind a reduce-scatter's producer), while all-gather and
// reduce-scatter kernels of one group overlap only across two communicators (not done here).
//
// Note [NCCL memory protection]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The caching allocator hands a freed block to the next allocation on the block's stream
// without asking other streams. A collective's input and output belong to the caller's stream
// but are read and written on a collective stream, so the rule here is FSDP2's deferred free:
// the Work holds a reference to every tensor of the collective until wait() has made the
// caller's current stream wait on `done`. A block freed after that is reused only by work
// queued on the caller's stream behind the collective. record_stream is used only as a safety
// net, for a Work destroyed without wait(): then the tensors are recorded on the collective's
// stream before the references drop. Why not record_stream everywhere: it delays the reuse of
// a block until the allocator polls the event at some later allocation, so the peak depends on
// timing; the deferred free costs nothing (the wait is needed anyway) and keeps peaks
// reproducible. See docs/design.md, "Device memory across streams".
//
// Note [NCCL watchdog]
// ~~~~~~~~~~~~~~~~~~~~
// NCCL kernels wait for their peers on the device, for ever: a rank that stops (SIGSTOP, a
// hung host) leaves the others' kernels spinning and, at the next host synchronization, their
// processes blocked. So a group of 2+ ranks has a watchdog thread, as c10d's ProcessGroupNCCL
// does. Every collective is registered with its `done` event and the time it was issued (a
// blocking host call, ncclCommSplit, with none until it returns). Every period (timeout / 4,
// between 0.1 and 1 s) the watchdog drops the completed ones; one older than the timeout
// (FSDP_COLLECTIVE_TIMEOUT_S, from its issue: NCCL starts it when the streams reach it) makes it
//   1. ask the Monitor which ranks did not join (the same heartbeats and words as Gloo and MPI:
//      Note [Collective timeouts], Note [Culprit path deadlines] in src/comm/);
//   2. take the issue lock for at most 2 s: a launch that holds it longer is blocked inside
//      NCCL waiting for a peer, and only the abort releases it (a launch about to start holds
//      it for microseconds, so the abort never frees a communicator a launch is about to use);
//   3. record the message, mark the group aborted, print the message (this rank's main thread
//      may be blocked in a host synchronization until the abort lands) and ncclCommAbort,
//      which ends the spinning kernels so blocked streams and host waits return.
// From then on every call on the group (issue, wait, check_async_error) throws that message
// instead of touching the communicator; the launchers end the job as for any failing rank. A
// group of one rank has no peers to wait for and no watchdog.

namespace {

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') s += std::string(" (") + last + ")";
  return s;
}

#define FSDP_NCCL_CHECK(call, comm, what)                                                    \
  do {                                                                                       \
    ncclResult_t fsdp_r_ = (call);                                                           \
    TORCH_CHECK(fsdp_r_ == ncclSuccess, "[nccl] ", what, " failed: ", nccl_error(fsdp_r_, comm)); \
  } while (0)

ncclDataType_t nccl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kDouble: return ncclFloat64;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kChar: return ncclInt8;
    case at::kByte:
    case at::kBool: return ncclUint8;
    default:
      TORCH_CHECK(false, "[nccl] dtype ", t, " is not supported; use float32, float64, float16, ",
                  "bfloat16, int8, uint8, int32, int64 or bool");
  }
}

bool is_floating(at::ScalarType t) { return at::isFloatingType(t); }

ncclRedOp_t nccl_op(ReduceOp op, at::ScalarType t) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kMax: return ncclMax;
    // Integer AVG is SUM then a truncating division (ReduceOp's contract), see reduce_launch.
    case ReduceOp::kAvg: return is_floating(t) ? ncclAvg : ncclSum;
  }
  TORCH_CHECK(false, "[nccl] unknown reduce op");
}

// The truncating division of an integer AVG, on the collective's stream after the NCCL call.
void finish_integer_avg(const at::Tensor& t, ReduceOp op, int size, cudaStream_t stream,
                        c10::Device device) {
  if (op != ReduceOp::kAvg || is_floating(t.scalar_type())) return;
  c10::cuda::CUDAStreamGuard guard(
      c10::cuda::getStreamFromExternal(stream, device.index()));
  t.div_(size, "trunc");
}

struct Event {
  cudaEvent_t event = nullptr;
  Event() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }
  ~Event() {
    if (event != nullptr) cudaEventDestroy(event);  // freed once the event has completed
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

class NcclWork final : public Work {
 public:
  // Holds the group: its communicator outlives every Work.
  NcclWork(std::shared_ptr<NcclGroup> group, c10::Device device,
           c10::cuda::CUDAStream stream, std::vector<at::Tensor> tensors, bool host_wait)
      : group_(std::move(group)),
        device_(device), stream_(stream), tensors_(std::move(tensors)), host_wait_(host_wait),
        done_(std::make_shared<Event>()) {}

  ~NcclWork() override {
    if (waited_) return;
    // See Note [NCCL memory protection]: dropped without wait().
    for (const auto& t : tensors_) {
      if (t.defined() && t.is_cuda()) {
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
      }
    }
  }

  const std::shared_ptr<Event>& done() const { return done_; }

  void wait() override {
    c10::cuda::CUDAGuard guard(device_);
    group_->check_async_error();
    if (host_wait_) {
      C10_CUDA_CHECK(cudaEventSynchronize(done_->event));
      group_->check_async_error();
    } else {
      auto current = c10::cuda::getCurrentCUDAStream(device_.index());
      C10_CUDA_CHECK(cudaStreamWaitEvent(current.stream(), done_->event, 0));
    }
    waited_ = true;
    tensors_.clear();  // the deferred free: see Note [NCCL memory protection]
  }

  bool is_completed() override {
    const cudaError_t r = cudaEventQuery(done_->event);
    if (r == cudaErrorNotReady) {
      (void)cudaGetLastError();  // cudaEventQuery's "not ready" is not a sticky error
      return false;
    }
    C10_CUDA_CHECK(r);
    return true;
  }

 private:
  std::shared_ptr<NcclGroup> group_;
  c10::Device device_;
  c10::cuda::CUDAStream stream_;
  std::vector<at::Tensor> tensors_;
  bool host_wait_;
  bool waited_ = false;
  std::shared_ptr<Event> done_;  // shared with the watchdog (Note [NCCL watchdog])
};

using Clock = std::chrono::steady_clock;

int64_t op_code(CollectiveOp op) { return static_cast<int64_t>(op); }

std::string seconds_of(std::chrono::milliseconds ms) {
  std::ostringstream out;
  out << static_cast<double>(ms.count()) / 1000.0 << " s";
  return out.str();
}

}  // namespace

struct NcclGroup::Watch {
  struct Pending {
    int64_t seq = 0;
    const char* op = "";  // a string literal: "all_reduce"
    Clock::time_point issued;
    std::shared_ptr<Event> done;  // null: a host call in progress (ncclCommSplit)
  };
  std::mutex mutex;  // guards everything but `aborted`
  std::condition_variable cv;
  std::deque<Pending> pending;
  bool stopping = false;
  std::string failure;  // the timeout message, set before `aborted`
  std::atomic<bool> aborted{false};
  std::thread thread;
};

NcclGroup::NcclGroup(ncclComm_t comm, int rank, std::vector<int> world_ranks, c10::Device device,
                     std::string name, NcclWatchOptions watch)
    : comm_(comm), rank_(rank), world_ranks_(std::move(world_ranks)), device_(device),
      name_(std::move(name)),
      all_gather_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())),
      reduce_scatter_stream_(
          c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())),
      watch_options_(std::move(watch)),
      issued_(std::make_shared<std::atomic<int64_t>>(0)),
      watch_(std::make_shared<Watch>()) {
  // See Note [NCCL watchdog]: only a group with peers can wait for ever.
  if (size() < 2 || watch_options_.timeout.count() <= 0) return;
  if (watch_options_.monitor) watch_options_.monitor->add_group(watch_options_.uid, issued_);
  watch_->thread = std::thread([this] { this->watch(); });
}

NcclGroup::~NcclGroup() {
  {
    std::lock_guard<std::mutex> lock(watch_->mutex);
    watch_->stopping = true;
  }
  watch_->cv.notify_all();
  if (watch_->thread.joinable()) watch_->thread.join();
  if (size() >= 2 && watch_options_.monitor) {
    watch_options_.monitor->remove_group(watch_options_.uid);
  }
  if (watch_->aborted.load()) return;  // the watchdog aborted the communicator
  if (comm_ == nullptr) return;
  // A destructor must not hang on a peer that is gone: abort after an error, else destroy
  // (which waits for this communicator's queued kernels).
  if (aborted_) {
    ncclCommAbort(comm_);
  } else {
    ncclCommDestroy(comm_);
  }
}

void NcclGroup::check_not_aborted() const {
  if (!watch_->aborted.load()) return;
  std::string failure;
  {
    std::lock_guard<std::mutex> lock(watch_->mutex);
    failure = watch_->failure;
  }
  TORCH_CHECK(false, failure);
}

void NcclGroup::check_async_error() {
  // Under the issue lock: the watchdog aborts the communicator only while holding it (or while
  // a launch is blocked inside NCCL, which is not here). See Note [NCCL watchdog].
  std::lock_guard<std::timed_mutex> issue_lock(issue_mutex_);
  check_not_aborted();
  if (comm_ == nullptr) {
    TORCH_CHECK(false, "[nccl] group ", name_, ": the group is unusable: an earlier collective "
                "failed and its communicator was aborted");
  }
  ncclResult_t async = ncclSuccess;
  FSDP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async), comm_, "ncclCommGetAsyncError");
  if (async == ncclSuccess || async == ncclInProgress) return;
  aborted_ = true;
  const std::string why = nccl_error(async, comm_);
  ncclCommAbort(comm_);
  comm_ = nullptr;
  TORCH_CHECK(false, "[nccl] group ", name_, " (rank ", rank_, " of ", size(),
              ") failed asynchronously: ", why, "; the communicator is aborted");
}

void NcclGroup::check_tensor(const char* op, const char* what, const at::Tensor& t) const {
  TORCH_CHECK(t.device() == device_, "[nccl] ", op, " on group ", name_, ": the ", what,
              " is on ", t.device(), " but this group's device is ", device_,
              "; move it there first (.to(", device_, "))");
  TORCH_CHECK(t.is_contiguous(), "[nccl] ", op, " on group ", name_, ": the ", what,
              " must be contiguous; call .contiguous() first");
}

WorkPtr NcclGroup::issue(const char* op, int64_t code, Lane lane, std::vector<at::Tensor> tensors,
                         const std::function<void(cudaStream_t)>& launch, bool host_wait) {
  c10::cuda::CUDAGuard guard(device_);
  auto stream = lane == Lane::kAllGather ? all_gather_stream_ : reduce_scatter_stream_;
  auto current = c10::cuda::getCurrentCUDAStream(device_.index());
  auto work = std::make_shared<NcclWork>(shared_from_this(), device_, stream,
                                         std::move(tensors), host_wait);
  {
    std::lock_guard<std::timed_mutex> lock(issue_mutex_);
    check_not_aborted();  // Note [NCCL watchdog]
    TORCH_CHECK(comm_ != nullptr, "[nccl] ", op, " on group ", name_, ": the group is unusable: "
                "an earlier collective failed and its communicator was aborted");
    const int64_t seq = ++seq_;
    issued_->store((seq << 4) | code, std::memory_order_relaxed);
    try {
      Event ready;  // step 1-2 of Note [NCCL streams]
      C10_CUDA_CHECK(cudaEventRecord(ready.event, current.stream()));
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), ready.event, 0));
      launch(stream.stream());
      C10_CUDA_CHECK(cudaEventRecord(work->done()->event, stream.stream()));
    } catch (...) {
      check_not_aborted();  // a launch the watchdog's abort ended says why
      throw;
    }
    if (watch_->thread.joinable()) {
      std::lock_guard<std::mutex> w(watch_->mutex);
      watch_->pending.push_back(
          {seq, op, Clock::now(), work->done()});
    }
  }
  counters_.calls += 1;
  return work;
}

// The watchdog thread: see Note [NCCL watchdog].
void NcclGroup::watch() {
  c10::cuda::CUDAGuard guard(device_);  // event queries on this group's device
  Watch& w = *watch_;
  const auto timeout = watch_options_.timeout;
  const auto period = std::clamp<std::chrono::milliseconds>(
      timeout / 4, std::chrono::milliseconds(100), std::chrono::milliseconds(1000));
  std::unique_lock<std::mutex> lock(w.mutex);
  while (!w.stopping) {
    w.cv.wait_for(lock, period, [&] { return w.stopping; });
    if (w.stopping) return;
    const auto now = Clock::now();
    std::optional<Watch::Pending> late;
    for (auto it = w.pending.begin(); it != w.pending.end();) {
      if (it->done) {
        const cudaError_t r = cudaEventQuery(it->done->event);
        if (r != cudaErrorNotReady) {
          // Done, or a device error that the next wait() reports itself.
          if (r != cudaSuccess) (void)cudaGetLastError();
          it = w.pending.erase(it);
          continue;
        }
      }
      if (!late && now - it->issued > timeout) late = *it;
      ++it;
    }
    if (!late) continue;
    lock.unlock();
    const std::string missing =
        watch_options_.monitor
            ? watch_options_.monitor->describe_missing(watch_options_.uid, world_ranks_,
                                                       late->seq, timeout)
            : std::string("no monitor to tell which ranks are missing");
    std::ostringstream out;
    out << "[nccl] " << late->op << " #" << late->seq << " on group " << name_ << " (rank "
        << rank_ << " of " << size() << ", " << device_ << ") did not complete within "
        << seconds_of(timeout)
        << ": " << missing << "; the communicator is aborted.";
    if (missing.find(kSilentRanks) != std::string::npos) {
      out << " ---> HINT: check that host and its network; then restart from the last "
             "checkpoint (--ckpt-path DIR/last), at a smaller world size if the host is gone.";
    } else {
      out << " ---> HINT: every rank of a group must call the same collectives in the same "
             "order; if the ranks are only slow, raise FSDP_COLLECTIVE_TIMEOUT_S (seconds).";
    }
    abort_after_timeout(out.str());
    return;
  }
}

void NcclGroup::abort_after_timeout(const std::string& message) {
  // A launch holding the lock for 2 s is blocked inside NCCL: only the abort ends it.
  std::unique_lock<std::timed_mutex> issue_lock(issue_mutex_, std::defer_lock);
  (void)issue_lock.try_lock_for(std::chrono::seconds(2));
  {
    std::lock_guard<std::mutex> lock(watch_->mutex);
    watch_->failure = message;
  }
  watch_->aborted.store(true);
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // Null after an asynchronous error already aborted it (check_async_error, under the lock).
  if (comm_ != nullptr) ncclCommAbort(comm_);
}

WorkPtr NcclGroup::all_gather_into_tensor_async(at::Tensor output, at::Tensor input) {
  check_tensor("all_gather", "input", input);
  check_tensor("all_gather", "output", output);
  TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                  output.numel() == input.numel() * size(),
              "[nccl] all_gather on group ", name_, ": output must be ", size(), " x ",
              input.numel(), " elements of ", input.scalar_type(), ", got ", output.numel(),
              " of ", output.scalar_type());
  counters_.all_gather_bytes += input.nbytes();
  const auto dtype = nccl_dtype(input.scalar_type());
  return issue("all_gather", op_code(CollectiveOp::kAllGather), Lane::kAllGather, {output, input},
               [&](cudaStream_t s) {
    FSDP_NCCL_CHECK(ncclAllGather(input.data_ptr(), output.data_ptr(),
                                  static_cast<size_t>(input.numel()), dtype, comm_, s),
                    comm_, "ncclAllGather");
  });
}

WorkPtr NcclGroup::reduce_scatter_tensor_async(at::Tensor output, at::Tensor input, ReduceOp op) {
  check_tensor("reduce_scatter", "input", input);
  check_tensor("reduce_scatter", "output", output);
  TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                  input.numel() == output.numel() * size(),
              "[nccl] reduce_scatter on group ", name_, ": input must be ", size(), " x ",
              output.numel(), " elements of ", output.scalar_type(), ", got ", input.numel(),
              " of ", input.scalar_type());
  counters_.reduce_scatter_bytes += input.nbytes();
  const auto dtype = nccl_dtype(input.scalar_type());
  const auto red = nccl_op(op, input.scalar_type());
  return issue("reduce_scatter", op_code(CollectiveOp::kReduceScatter), Lane::kReduceScatter,
               {output, input}, [&](cudaStream_t s) {
    FSDP_NCCL_CHECK(ncclReduceScatter(input.data_ptr(), output.data_ptr(),
                                      static_cast<size_t>(output.numel()), dtype, red, comm_, s),
                    comm_, "ncclReduceScatter");
    finish_integer_avg(output, op, size(), s, device_);
  });
}

WorkPtr NcclGroup::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  check_tensor("all_reduce", "tensor", tensor);
  counters_.all_reduce_bytes += tensor.nbytes();
  const auto dtype = nccl_dtype(tensor.scalar_type());
  const auto red = nccl_op(op, tensor.scalar_type());
  return issue("all_reduce", op_code(CollectiveOp::kAllReduce), Lane::kReduceScatter, {tensor},
               [&](cudaStream_t s) {
    FSDP_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(),
                                  static_cast<size_t>(tensor.numel()), dtype, red, comm_, s),
                    comm_, "ncclAllReduce");
    finish_integer_avg(tensor, op, size(), s, device_);
  });
}

WorkPtr NcclGroup::broadcast_async(at::Tensor tensor, int root) {
  check_tensor("broadcast", "tensor", tensor);
  TORCH_CHECK(root >= 0 && root < size(), "[nccl] broadcast on group ", name_, ": root ", root,
              " is not a rank of this group (size ", size(), ")");
  counters_.broadcast_bytes += tensor.nbytes();
  const auto dtype = nccl_dtype(tensor.scalar_type());
  return issue("broadcast", op_code(CollectiveOp::kBroadcast), Lane::kAllGather, {tensor},
               [&](cudaStream_t s) {
    FSDP_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(),
                                  static_cast<size_t>(tensor.numel()), dtype, root, comm_, s),
                    comm_, "ncclBroadcast");
  });
}

WorkPtr NcclGroup::all_to_all_async(at::Tensor output, at::Tensor input) {
  check_tensor("all_to_all", "input", input);
  check_tensor("all_to_all", "output", output);
  TORCH_CHECK(output.scalar_type() == input.scalar_type() && output.numel() == input.numel() &&
                  input.numel() % size() == 0,
              "[nccl] all_to_all on group ", name_, ": input and output must have the same "
              "dtype and ", size(), " x k elements, got ", input.numel(), " and ",
              output.numel());
  counters_.all_to_all_bytes += input.nbytes();
  const auto dtype = nccl_dtype(input.scalar_type());
  const size_t chunk = static_cast<size_t>(input.numel() / size());
  const size_t chunk_bytes = chunk * input.element_size();
  return issue("all_to_all", op_code(CollectiveOp::kAllToAll), Lane::kReduceScatter,
               {output, input}, [&](cudaStream_t s) {
    auto* in = static_cast<char*>(input.data_ptr());
    auto* out = static_cast<char*>(output.data_ptr());
    FSDP_NCCL_CHECK(ncclGroupStart(), comm_, "ncclGroupStart");
    for (int peer = 0; peer < size(); ++peer) {
      FSDP_NCCL_CHECK(ncclSend(in + peer * chunk_bytes, chunk, dtype, peer, comm_, s), comm_,
                      "ncclSend");
      FSDP_NCCL_CHECK(ncclRecv(out + peer * chunk_bytes, chunk, dtype, peer, comm_, s), comm_,
                      "ncclRecv");
    }
    FSDP_NCCL_CHECK(ncclGroupEnd(), comm_, "ncclGroupEnd");
  });
}

WorkPtr NcclGroup::barrier_async() {
  c10::cuda::CUDAGuard guard(device_);
  at::Tensor one = at::ones({1}, at::TensorOptions().dtype(at::kInt).device(device_));
  return issue("barrier", op_code(CollectiveOp::kBarrier), Lane::kReduceScatter, {one},
               [&](cudaStream_t s) {
    FSDP_NCCL_CHECK(ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclInt32, ncclSum, comm_, s),
                    comm_, "ncclAllReduce (barrier)");
  }, /*host_wait=*/true);
}

std::shared_ptr<ProcessGroup> NcclGroup::new_subgroup(const std::vector<int>& ranks) {
  std::vector<int> members;  // ranks of this group, in the subgroup's order
  int my_index = -1;
  for (int world_rank : ranks) {
    int local = -1;
    for (int i = 0; i < size(); ++i) {
      if (world_ranks_[static_cast<size_t>(i)] == world_rank) local = i;
    }
    TORCH_CHECK(local >= 0, "[nccl] new_subgroup of group ", name_, ": world rank ", world_rank,
                " is not in this group");
    if (local == rank_) my_index = static_cast<int>(members.size());
    members.push_back(local);
  }
  // ncclCommSplit is collective over this communicator: members pass color 0 and their index
  // as key (the subgroup's rank), the others NCCL_SPLIT_NOCOLOR and get no communicator.
  // A blocking host call: the watchdog times it from now (Note [NCCL watchdog]).
  c10::cuda::CUDAGuard guard(device_);
  ncclComm_t sub = nullptr;
  {
    std::lock_guard<std::timed_mutex> lock(issue_mutex_);
    check_not_aborted();
    TORCH_CHECK(comm_ != nullptr, "[nccl] group ", name_, " is unusable (aborted)");
    const int64_t seq = ++seq_;
    issued_->store((seq << 4) | op_code(CollectiveOp::kNewSubgroup), std::memory_order_relaxed);
    const bool watched = watch_->thread.joinable();
    if (watched) {
      std::lock_guard<std::mutex> w(watch_->mutex);
      watch_->pending.push_back({seq, "new_subgroup", Clock::now(), {}});
    }
    auto unwatch = [&] {
      if (!watched) return;
      std::lock_guard<std::mutex> w(watch_->mutex);
      auto& p = watch_->pending;
      p.erase(std::remove_if(p.begin(), p.end(), [&](const Watch::Pending& e) {
                return e.seq == seq;
              }), p.end());
    };
    try {
      FSDP_NCCL_CHECK(ncclCommSplit(comm_, my_index >= 0 ? 0 : NCCL_SPLIT_NOCOLOR,
                                    my_index >= 0 ? my_index : 0, &sub, nullptr),
                      comm_, "ncclCommSplit");
    } catch (...) {
      unwatch();
      check_not_aborted();
      throw;
    }
    unwatch();
  }
  if (my_index < 0) return nullptr;
  std::ostringstream name;
  name << "[";
  for (size_t i = 0; i < ranks.size(); ++i) name << (i ? "," : "") << ranks[i];
  name << "]";
  NcclWatchOptions watch = watch_options_;
  watch.uid = "nccl" + name.str();  // the same on every member
  return std::make_shared<NcclGroup>(sub, my_index, ranks, device_, name.str(), std::move(watch));
}

ProcessGroupPtr make_nccl_group(const NcclGroupOptions& options) {
  TORCH_CHECK(options.store, "[nccl] make_nccl_group needs the rendezvous store");
  set_cuda_device(options.device);
  // The ncclUniqueId goes through the job's rendezvous store: rank 0 creates it, every other
  // rank waits for the key (bounded by options.timeout) and reads it.
  ncclUniqueId id;
  if (options.rank == 0) {
    FSDP_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
    std::vector<uint8_t> bytes(sizeof(id));
    std::memcpy(bytes.data(), &id, sizeof(id));
    options.store->set(options.key, bytes);
  } else {
    options.store->wait({options.key}, options.timeout);
    const std::vector<uint8_t> bytes = options.store->get(options.key);
    TORCH_CHECK(bytes.size() == sizeof(id), "[nccl] the ncclUniqueId under '", options.key,
                "' has ", bytes.size(), " bytes, expected ", sizeof(id),
                "; another job may be using the same MASTER_ADDR:MASTER_PORT");
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(options.device));
  c10::cuda::CUDAGuard guard(device);
  ncclComm_t comm = nullptr;
  FSDP_NCCL_CHECK(ncclCommInitRank(&comm, options.size, id, options.rank), nullptr,
                  "ncclCommInitRank (rank " + std::to_string(options.rank) + " of " +
                      std::to_string(options.size) + " on " + device.str() + ")");
  std::vector<int> world_ranks;
  for (int r = 0; r < options.size; ++r) world_ranks.push_back(r);
  // The watchdog's culprit naming: the heartbeats of Note [Collective timeouts], on a store
  // connection of their own.
  NcclWatchOptions watch;
  watch.timeout = options.collective_timeout;
  watch.uid = "nccl[world]";
  if (options.size > 1 && options.monitor_store) {
    const auto period = std::clamp<std::chrono::milliseconds>(
        options.collective_timeout / 4, std::chrono::milliseconds(100),
        std::chrono::milliseconds(1000));
    watch.monitor = std::make_shared<Monitor>(options.monitor_store, options.rank, period);
  }
  return std::make_shared<NcclGroup>(comm, options.rank, std::move(world_ranks), device,
                                     "world", std::move(watch));
}

}  // namespace fsdp::detail
