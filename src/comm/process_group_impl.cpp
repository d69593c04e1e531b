// GroupImpl: the generic part of every process group (validation, sequence numbers, counters,
// emulated ops, timeouts, FSDP_DEBUG checks). Backends only provide a Transport.
#include "comm/process_group_impl.h"

#include "comm/debug.h"
#include "comm/local_groups.h"
#include "comm/rendezvous.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <sstream>

namespace fsdp::detail {

// Note [Reduce-scatter emulation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Gloo 1.13 has no reduce-scatter, and no backend reduces bf16/fp16 with fp32 accumulation.
// reduce_scatter(output[k], input[W*k]) = all_to_all(recv[W*k], input), after which chunk i of
// recv is rank i's chunk for us, then a local reduction of the W chunks in rank order. Each rank
// sends and receives (W-1)*k elements, the same as a ring reduce-scatter, so this is
// bandwidth-optimal; the local sum costs one pass over W*k elements.
//  - bf16/fp16: the chunks are summed into an fp32 accumulator and rounded once at the end (AVG
//    divides in fp32 before rounding). Summation order is rank 0, 1, ..., W-1 on every rank, so
//    results are deterministic and identical on all ranks.
//  - AVG: SUM then divide by the group size (fp types: true division; integer dtypes: division
//    truncating toward zero, documented in comm.h).
//  - MPI too, although it has MPI_Reduce_scatter_block: OpenMPI's (Debian 12, shared memory)
//    ran at a third of this path's bandwidth on this machine (64 MiB fp32, 2 cores: 76-110 ms
//    vs 26-38 ms for all_to_all + sum at world 2; 138-182 vs 51-72 ms at world 3; measured
//    with a standalone MPI program beside `fsdp-bench comm`), and it made a rank's result
//    depend on MPI's summation order; this path sums in rank order on every backend.
// all_reduce of bf16/fp16 = the same reduce-scatter over the input padded to a multiple of W,
// then an all-gather of the reduced chunks: half-precision bytes on the wire, fp32 math.

// Note [bf16 travel]
// ~~~~~~~~~~~~~~~~~~
// Neither Gloo 1.13 nor MPI knows bf16. Data movement (all-gather, all-to-all, broadcast) does
// not look at values, so bf16 travels bit-cast: Gloo gets a kHalf view of the same bytes (Gloo
// only memcpy's for these ops, NaN payloads included), MPI gets MPI_BYTE. Reductions never
// interpret bf16 bits as fp16: they go through Note [Reduce-scatter emulation].

// Note [Collective timeouts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A collective that has been running on the comm thread for longer than the group's timeout
// fails in wait() on every rank that waits for it, with a message naming the op, its sequence
// number, the group and the ranks that did not join. The hot path stays cheap: issuing a
// collective stores (seq << 4 | op) in an atomic; a per-process Monitor thread publishes that
// value to the job's TCPStore when it changed, at most once per period (1 s, or timeout/4 when
// shorter). On a timeout the rank publishes its own value, waits one period so the others'
// heartbeats land, and reads everyone's: ranks whose last collective is older did not join;
// ranks that are further along skipped this one (or called a different one). The Monitor uses
// its own store connection (the rendezvous one belongs to Gloo); for MPI, rank 0 hosts a
// TCPStore whose port goes round with MPI_Bcast.
// The waiter measures from the moment the comm thread started the op (queued time does not
// count); a waiter whose op is still queued behind a hung one reports the hung one. Gloo's own
// per-op timeout is set to the same value, so its worker also gives up and the group can be torn
// down. After a timeout the group is poisoned: later calls fail at once with the first error.

namespace {

using Clock = std::chrono::steady_clock;

// Sum over every op run by this process's comm threads (fsdp::comm_busy_seconds).
std::atomic<int64_t> comm_busy_ns{0};

std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const c10::Error& err) {
    return err.what_without_backtrace();
  } catch (const std::exception& err) {
    return err.what();
  } catch (...) {
    return "unknown exception";
  }
}

// A collective's backend error, with the host and ranks behind a lost connection when the
// roster knows them. See Note [Naming a lost peer] in rendezvous.cpp.
std::string failure_text(const std::exception_ptr& e) {
  std::string text = error_text(e);
  std::string peer = describe_peer_in(text);
  if (!peer.empty()) text += " (" + peer + ": that host was lost or its ranks died)";
  return text;
}

std::string seconds_text(std::chrono::milliseconds ms) {
  std::ostringstream out;
  double s = static_cast<double>(ms.count()) / 1000.0;
  if (std::fabs(s - std::round(s)) < 1e-9) {
    out << static_cast<int64_t>(std::round(s)) << " s";
  } else {
    out << s << " s";
  }
  return out.str();
}

class RecordWork final : public Work {
 public:
  RecordWork(std::shared_ptr<GroupImpl> group, std::shared_ptr<OpRecord> record)
      : group_(std::move(group)), record_(std::move(record)) {}
  void wait() override { group_->wait_record(record_); }
  bool is_completed() override {
    std::lock_guard<std::mutex> lock(record_->mutex);
    return record_->state == OpRecord::State::kDone;
  }

 private:
  std::shared_ptr<GroupImpl> group_;
  std::shared_ptr<OpRecord> record_;
};

bool is_movable(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kLong:
    case at::kInt:
    case at::kShort:
    case at::kChar:
    case at::kByte:
    case at::kBool:
      return true;
    default:
      return false;
  }
}

void check_tensor(const char* api, const char* what, const at::Tensor& t, bool reduce) {
  TORCH_CHECK(t.defined(), "[fsdp::ProcessGroup::", api, "] ", what, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "[fsdp::ProcessGroup::", api, "] ",
              what, " is on ", t.device(),
              "; the gloo and mpi backends take CPU tensors, and CUDA tensors through host "
              "memory (move it with .cpu())");
  TORCH_CHECK(t.is_contiguous(), "[fsdp::ProcessGroup::", api, "] ", what,
              " must be contiguous (shape ", t.sizes(), ", strides ", t.strides(),
              "); pass .contiguous() or a flat buffer");
  if (reduce) {
    TORCH_CHECK(is_reducible(t.scalar_type()), "[fsdp::ProcessGroup::", api, "] cannot reduce ",
                dtype_name(t.scalar_type()),
                " tensors; supported: float32, float64, bfloat16, float16, int32, int64");
  } else {
    TORCH_CHECK(is_movable(t.scalar_type()), "[fsdp::ProcessGroup::", api, "] unsupported dtype ",
                dtype_name(t.scalar_type()),
                "; supported: float32, float64, bfloat16, float16, int64, int32, int16, int8, "
                "uint8, bool");
  }
}

void check_same_dtype(const char* api, const at::Tensor& output, const at::Tensor& input) {
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[fsdp::ProcessGroup::", api,
              "] output is ", dtype_name(output.scalar_type()), " but input is ",
              dtype_name(input.scalar_type()), "; both must have the same dtype");
}

void divide_by(const at::Tensor& t, int64_t n) {
  if (at::isIntegralType(t.scalar_type(), /*includeBool=*/false)) {
    t.div_(n, "trunc");
  } else {
    t.div_(n);
  }
}

// Note [Staging device tensors]
// ------------------------------
// Gloo and MPI move host memory. A collective given CUDA tensors (ranks sharing one GPU, where
// NCCL allows one rank per device, or a machine without NCCL) runs on host copies:
//   - on the caller's thread, each CUDA tensor the collective reads is copied into a pinned
//     host buffer (a blocking copy: it waits for the kernels of the current stream that
//     produced the values); a CUDA tensor it only writes gets an uninitialized buffer;
//   - the host collective is queued like any other, so its fingerprint, timeout and culprit
//     machinery are the same as for CPU tensors;
//   - wait() (or an is_completed() that finds it done) copies the host results back into the
//     CUDA tensors it writes, on the caller's current stream, before returning.
// Two copies over PCIe and a host synchronization per collective: the way to share a device
// between ranks, not a fast path (NCCL is, one rank per GPU). Docs: docs/gpu.md.
class StagedWork final : public Work {
 public:
  StagedWork(WorkPtr inner, std::vector<std::pair<at::Tensor, at::Tensor>> copy_back)
      : inner_(std::move(inner)), copy_back_(std::move(copy_back)) {}
  void wait() override {
    inner_->wait();
    finish();
  }
  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    finish();
    return true;
  }

 private:
  void finish() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [device_tensor, host] : copy_back_) device_tensor.copy_(host);
    copy_back_.clear();
  }
  WorkPtr inner_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back_;  // (CUDA tensor, its host copy)
  std::mutex mutex_;
};

bool any_cuda(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->is_cuda()) return true;
  }
  return false;
}

// Runs `run` on host copies of `tensors` (Note [Staging device tensors]). reads[i] / writes[i]:
// whether the collective reads / writes tensors[i]. A tensor given twice (in place) gets one
// host copy.
WorkPtr stage_through_host(const std::vector<at::Tensor>& tensors, const std::vector<bool>& reads,
                           const std::vector<bool>& writes,
                           const std::function<WorkPtr(const std::vector<at::Tensor>&)>& run) {
  std::vector<at::Tensor> host(tensors.size());
  std::vector<size_t> first(tensors.size());  // the index whose host copy tensors[i] shares
  for (size_t i = 0; i < tensors.size(); ++i) {
    first[i] = i;
    for (size_t j = 0; j < i && first[i] == i; ++j) {
      if (tensors[j].is_same(tensors[i])) first[i] = first[j];
    }
  }
  std::vector<std::pair<at::Tensor, at::Tensor>> copy_back;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (!t.is_cuda()) {
      host[i] = t;
      continue;
    }
    if (first[i] != i) {
      host[i] = host[first[i]];
      continue;
    }
    bool read = false, written = false;
    for (size_t j = i; j < tensors.size(); ++j) {
      if (first[j] != i) continue;
      read = read || reads[j];
      written = written || writes[j];
    }
    host[i] = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    if (read) host[i].copy_(t);
    if (written) copy_back.emplace_back(t, host[i]);
  }
  return std::make_shared<StagedWork>(run(host), std::move(copy_back));
}

}  // namespace

const char* to_string(CollectiveOp op) {
  switch (op) {
    case CollectiveOp::kAllGather:
      return "all_gather";
    case CollectiveOp::kReduceScatter:
      return "reduce_scatter";
    case CollectiveOp::kAllReduce:
      return "all_reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kAllToAll:
      return "all_to_all";
    case CollectiveOp::kBarrier:
      return "barrier";
    case CollectiveOp::kNewSubgroup:
      return "new_subgroup";
  }
  return "unknown_collective";
}

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    case at::kLong:
      return "int64";
    case at::kInt:
      return "int32";
    case at::kShort:
      return "int16";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(dtype);
  }
}

bool is_half(at::ScalarType dtype) { return dtype == at::kBFloat16 || dtype == at::kHalf; }

bool is_reducible(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kBFloat16:
    case at::kHalf:
    case at::kLong:
    case at::kInt:
      return true;
    default:
      return false;
  }
}

void reduce_chunks(const at::Tensor& output, const at::Tensor& chunks, ReduceOp op) {
  const int64_t world = chunks.size(0);
  at::Tensor acc = is_half(output.scalar_type()) ? chunks[0].to(at::kFloat) : output;
  int64_t next = 1;
  if (!is_half(output.scalar_type())) {
    if (op != ReduceOp::kMax && world > 1) {
      at::add_out(acc, chunks[0], chunks[1]);  // one pass instead of a copy and an add
      next = 2;
    } else {
      acc.copy_(chunks[0]);
    }
  }
  for (int64_t i = next; i < world; ++i) {
    if (op == ReduceOp::kMax) {
      at::maximum_out(acc, acc, chunks[i].to(acc.scalar_type()));
    } else {
      acc.add_(chunks[i]);  // bf16/fp16 chunk promoted into the fp32 accumulator
    }
  }
  if (op == ReduceOp::kAvg) divide_by(acc, world);
  if (!acc.is_same(output)) output.copy_(acc);  // the one rounding to bf16/fp16
}

// --- CommThread -------------------------------------------------------------------------

CommThread::CommThread(std::string name) : name_(std::move(name)) {
  thread_ = std::thread([this] { loop(); });
  id_ = thread_.get_id();
}

CommThread::~CommThread() { stop(std::chrono::seconds(30)); }

void CommThread::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(!stopping_, "comm thread '", name_, "' used after stop()");
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void CommThread::run_sync(const std::function<void()>& task) {
  if (on_thread()) {
    task();
    return;
  }
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  post([&] {
    try {
      task();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(m);
    done = true;
    cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(m);
  cv.wait(lock, [&] { return done; });
  if (error) std::rethrow_exception(error);
}

void CommThread::loop() {
  while (true) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      busy_ = false;
      idle_cv_.notify_all();
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) break;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    task();  // tasks catch their own exceptions
  }
  std::lock_guard<std::mutex> lock(mutex_);
  exited_ = true;
  idle_cv_.notify_all();
}

void CommThread::set_current(std::shared_ptr<OpRecord> record) {
  std::lock_guard<std::mutex> lock(current_mutex_);
  current_ = std::move(record);
}

std::shared_ptr<OpRecord> CommThread::current() {
  std::lock_guard<std::mutex> lock(current_mutex_);
  return current_;
}

bool CommThread::stop(std::chrono::milliseconds grace) {
  if (!thread_.joinable()) return true;
  TORCH_INTERNAL_ASSERT(!on_thread(), "comm thread '", name_, "' cannot stop itself");
  std::unique_lock<std::mutex> lock(mutex_);
  stopping_ = true;
  cv_.notify_all();
  bool exited = idle_cv_.wait_for(lock, grace, [&] { return exited_; });
  lock.unlock();
  if (exited) {
    thread_.join();
  } else {
    thread_.detach();  // stuck in a hung collective; see Note [Collective timeouts]
  }
  return exited;
}

// --- GroupImpl --------------------------------------------------------------------------

GroupImpl::GroupImpl(GroupConfig config, std::unique_ptr<Transport> transport,
                     std::shared_ptr<CommThread> thread, std::shared_ptr<Monitor> monitor,
                     bool owns_thread)
    : config_(std::move(config)),
      transport_(std::move(transport)),
      thread_(std::move(thread)),
      monitor_(std::move(monitor)),
      owns_thread_(owns_thread),
      issued_(std::make_shared<std::atomic<int64_t>>(0)) {
  TORCH_INTERNAL_ASSERT((transport_ == nullptr) == (config_.size == 1));
  TORCH_INTERNAL_ASSERT(config_.size == 1 || thread_ != nullptr);
  TORCH_INTERNAL_ASSERT(static_cast<int>(config_.world_ranks.size()) == config_.size);
  if (monitor_ && config_.size > 1) monitor_->add_group(config_.uid, issued_);
}

GroupImpl::~GroupImpl() { shutdown(); }

void GroupImpl::shutdown() {
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  if (monitor_ && config_.size > 1) monitor_->remove_group(config_.uid);
  if (!thread_) return;
  if (owns_thread_) {
    // Drain, then free the transport on this thread (ProcessGroupGloo joins its workers).
    bool clean = thread_->stop(std::max(config_.timeout + std::chrono::seconds(5),
                                        std::chrono::milliseconds(std::chrono::seconds(10))));
    if (clean) {
      transport_.reset();
    } else {
      transport_.release();  // a worker is stuck inside it; leaking beats hanging at exit
    }
  } else {
    // Shared thread (MPI): free the communicator in order after our queued work.
    try {
      thread_->run_sync([this] { transport_.reset(); });
    } catch (...) {
    }
  }
}

std::string GroupImpl::describe(CollectiveOp op, int64_t seq) const {
  std::ostringstream out;
  out << to_string(op) << " #" << seq << " on group " << config_.name << " (" << config_.backend
      << ")";
  return out.str();
}

void GroupImpl::check_usable(const char* op) const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  TORCH_CHECK(!shut_down_, "[fsdp::ProcessGroup] ", op, " on group ", config_.name,
              " after it was destroyed (destroy_process_group or process exit)");
  TORCH_CHECK(poisoned_.empty(), "[fsdp::ProcessGroup] ", op, " on group ", config_.name,
              " (", config_.backend, ") refused: the group is unusable after an earlier failure: ",
              poisoned_);
}

void GroupImpl::poison(const std::string& why) {
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (poisoned_.empty()) poisoned_ = why;
}

WorkPtr GroupImpl::enqueue(const Fingerprint& fp, std::vector<at::Tensor> keep_alive,
                           std::function<void(Transport&)> body,
                           const std::function<void()>& local) {
  std::lock_guard<std::mutex> issue(issue_mutex_);
  check_usable(to_string(fp.op));
  const int64_t seq = next_seq_++;
  issued_->store((seq << 4) | static_cast<int64_t>(fp.op), std::memory_order_relaxed);
  if (config_.size == 1) {
    if (local) local();
    return done_work();
  }
  auto record = std::make_shared<OpRecord>();
  record->op = fp.op;
  record->seq = seq;
  record->what = describe(fp.op, seq);
  record->group = this;
  record->timeout = config_.timeout;
  record->keep_alive = std::move(keep_alive);
  thread_->post([this, record, fp, body = std::move(body)]() mutable {
    run_record(record, fp, std::move(body));
  });
  return std::make_shared<RecordWork>(shared_from_this(), record);
}

void GroupImpl::run_record(const std::shared_ptr<OpRecord>& record, const Fingerprint& fp,
                           std::function<void(Transport&)> body) {
  std::exception_ptr error;
  std::string message;
  bool skipped = false;
  {
    std::lock_guard<std::mutex> lock(state_mutex_);
    if (!poisoned_.empty()) {
      skipped = true;
      message = record->what + " was not run: the group is unusable after an earlier failure: " +
                poisoned_;
    }
  }
  if (!skipped) thread_->set_current(record);
  if (!skipped) {
    {
      std::lock_guard<std::mutex> lock(record->mutex);
      record->state = OpRecord::State::kRunning;
      record->started = Clock::now();
    }
    try {
      if (config_.debug_detail) {
        CollectiveFingerprint mine{fp.op, record->seq, fp.dtype, fp.numel, fp.arg};
        auto mismatch =
            check_same_collective(*transport_, config_.size, mine, config_.world_ranks);
        if (mismatch) message = *mismatch;
      }
      if (message.empty()) body(*transport_);
    } catch (...) {
      error = std::current_exception();
    }
    thread_->set_current(nullptr);
    const auto ran = Clock::now() - record->started;
    comm_busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(ran).count(),
                           std::memory_order_relaxed);
    const bool near_deadline = ran >= config_.timeout * 9 / 10;
    if (error && near_deadline) {
      // Gloo's own per-op timeout fired: poison with the full timeout message, so work queued
      // behind it reports the missing ranks too.
      timeout_message(record);
    } else if (error) {
      poison(record->what + " failed on rank " + std::to_string(config_.world_ranks[config_.rank]) +
             ": " + failure_text(error));
    }
  }
  {
    std::lock_guard<std::mutex> lock(record->mutex);
    record->state = OpRecord::State::kDone;
    if (!message.empty()) {
      record->message = message;
      record->mismatch = !skipped;
      error = std::make_exception_ptr(std::runtime_error(message));
    }
    record->error = error;
    record->keep_alive.clear();
    body = nullptr;  // its captures too, before a waiter frees what it gave the collective
  }
  record->cv.notify_all();
}

std::string GroupImpl::timeout_message(const std::shared_ptr<OpRecord>& record) {
  {
    std::lock_guard<std::mutex> lock(record->mutex);
    if (!record->message.empty()) return record->message;
  }
  std::string missing = monitor_ ? monitor_->describe_missing(config_.uid, config_.world_ranks,
                                                              record->seq, config_.timeout)
                                 : "no monitor to tell which ranks are missing";
  std::ostringstream out;
  out << record->what << " timed out after " << seconds_text(config_.timeout) << ": " << missing;
  if (missing.find(kSilentRanks) != std::string::npos) {
    out << ". ---> HINT: check that host and its network; then restart from the last checkpoint "
           "(--ckpt-path DIR/last), at a smaller world size if the host is gone.";
  } else {
    out << ". ---> HINT: every rank of a group must call the same collectives in the same order; "
           "FSDP_DEBUG=detail checks each call; if the ranks are only slow, raise "
           "FSDP_COLLECTIVE_TIMEOUT_S (seconds).";
  }
  poison(out.str());
  std::lock_guard<std::mutex> lock(record->mutex);
  if (record->message.empty()) record->message = out.str();
  return record->message;
}

void GroupImpl::wait_record(const std::shared_ptr<OpRecord>& record) {
  const auto timeout = config_.timeout;
  std::unique_lock<std::mutex> lock(record->mutex);
  while (record->state != OpRecord::State::kDone) {
    if (record->state == OpRecord::State::kRunning) {
      auto deadline = record->started + timeout;
      if (record->cv.wait_until(lock, deadline,
                                [&] { return record->state == OpRecord::State::kDone; })) {
        break;
      }
      lock.unlock();
      TORCH_CHECK(false, timeout_message(record));
    }
    // Queued behind other work (of this group, or of another group sharing the MPI thread):
    // check every second whether the op running on the thread is hung.
    auto slice = std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(1));
    if (record->cv.wait_for(lock, slice,
                            [&] { return record->state != OpRecord::State::kQueued; })) {
      continue;
    }
    std::shared_ptr<OpRecord> running = thread_->current();
    if (running && running != record) {
      bool hung = false;
      {
        std::lock_guard<std::mutex> rl(running->mutex);
        hung = running->state == OpRecord::State::kRunning &&
               Clock::now() - running->started > running->timeout;
      }
      if (hung) {
        lock.unlock();
        std::string why = running->group->timeout_message(running);
        if (running->group != this) poison(why);
        TORCH_CHECK(false, record->what, " could not start: ", why);
      }
    }
  }
  if (!record->error) return;
  const bool has_message = !record->message.empty();
  const auto elapsed = Clock::now() - record->started;
  lock.unlock();
  if (has_message) TORCH_CHECK(false, timeout_message(record));  // mismatch, skip or timeout
  // A backend error near the deadline is Gloo's own timeout firing: report it as ours.
  if (elapsed >= timeout * 9 / 10) TORCH_CHECK(false, timeout_message(record));
  TORCH_CHECK(false, record->what, " failed on rank ", config_.world_ranks[config_.rank], ": ",
              failure_text(record->error));
}

// --- the collectives ------------------------------------------------------------------------

WorkPtr GroupImpl::all_gather_into_tensor_async(at::Tensor output, at::Tensor input) {
  constexpr const char* api = "all_gather_into_tensor";
  check_tensor(api, "output", output, false);
  check_tensor(api, "input", input, false);
  if (any_cuda({&output, &input})) {
    return stage_through_host({output, input}, {false, true}, {true, false}, [this](auto& h) {
      return all_gather_into_tensor_async(h[0], h[1]);
    });
  }
  check_same_dtype(api, output, input);
  TORCH_CHECK(output.numel() == input.numel() * config_.size, "[fsdp::ProcessGroup::", api,
              "] output has ", output.numel(), " elements but the group of ", config_.size,
              " ranks needs ", config_.size, " x input (", input.numel(),
              ") = ", input.numel() * config_.size, "; allocate the output as at::empty({",
              input.numel() * config_.size, "}, input.options())");
  counters_.all_gather_bytes += input.nbytes();
  counters_.calls += 1;
  Fingerprint fp{CollectiveOp::kAllGather, input.scalar_type(), input.numel(), 0};
  return enqueue(
      fp, {output, input},
      [output, input](Transport& t) {
        if (input.numel() == 0) return;
        t.all_gather(output.view(-1), input.view(-1));
      },
      [&] {
        if (!output.is_same(input)) output.view(-1).copy_(input.view(-1));
      });
}

WorkPtr GroupImpl::reduce_scatter_tensor_async(at::Tensor output, at::Tensor input, ReduceOp op) {
  constexpr const char* api = "reduce_scatter_tensor";
  check_tensor(api, "output", output, true);
  check_tensor(api, "input", input, true);
  if (any_cuda({&output, &input})) {
    return stage_through_host({output, input}, {false, true}, {true, false}, [this, op](auto& h) {
      return reduce_scatter_tensor_async(h[0], h[1], op);
    });
  }
  check_same_dtype(api, output, input);
  TORCH_CHECK(input.numel() == output.numel() * config_.size, "[fsdp::ProcessGroup::", api,
              "] input has ", input.numel(), " elements but the group of ", config_.size,
              " ranks needs ", config_.size, " x output (", output.numel(),
              ") = ", output.numel() * config_.size, "; pad the input to a multiple of the group size");
  counters_.reduce_scatter_bytes += input.nbytes();
  counters_.calls += 1;
  Fingerprint fp{CollectiveOp::kReduceScatter, input.scalar_type(), input.numel(),
                 static_cast<int64_t>(op)};
  return enqueue(
      fp, {output, input},
      [this, output, input, op](Transport& t) {
        if (input.numel() == 0) return;
        do_reduce_scatter(t, output.view(-1), input.view(-1), op);
      },
      [&] {
        if (!output.is_same(input)) output.view(-1).copy_(input.view(-1));  // x/1 == x exactly
      });
}

WorkPtr GroupImpl::all_reduce_async(at::Tensor tensor, ReduceOp op) {
  constexpr const char* api = "all_reduce";
  check_tensor(api, "tensor", tensor, true);
  if (tensor.is_cuda()) {
    return stage_through_host({tensor}, {true}, {true}, [this, op](auto& h) {
      return all_reduce_async(h[0], op);
    });
  }
  counters_.all_reduce_bytes += tensor.nbytes();
  counters_.calls += 1;
  Fingerprint fp{CollectiveOp::kAllReduce, tensor.scalar_type(), tensor.numel(),
                 static_cast<int64_t>(op)};
  return enqueue(fp, {tensor}, [this, tensor, op](Transport& t) {
    if (tensor.numel() == 0) return;
    do_all_reduce(t, tensor.view(-1), op);
  });
}

WorkPtr GroupImpl::broadcast_async(at::Tensor tensor, int root) {
  constexpr const char* api = "broadcast";
  check_tensor(api, "tensor", tensor, false);
  if (tensor.is_cuda()) {
    return stage_through_host({tensor}, {true}, {true}, [this, root](auto& h) {
      return broadcast_async(h[0], root);
    });
  }
  TORCH_CHECK(root >= 0 && root < config_.size, "[fsdp::ProcessGroup::broadcast] root ", root,
              " is not a rank of group ", config_.name, " (size ", config_.size,
              "); root is a rank in this group, not a world rank");
  counters_.broadcast_bytes += tensor.nbytes();
  counters_.calls += 1;
  Fingerprint fp{CollectiveOp::kBroadcast, tensor.scalar_type(), tensor.numel(), root};
  return enqueue(fp, {tensor}, [tensor, root](Transport& t) {
    if (tensor.numel() == 0) return;
    t.broadcast(tensor.view(-1), root);
  });
}

WorkPtr GroupImpl::all_to_all_async(at::Tensor output, at::Tensor input) {
  constexpr const char* api = "all_to_all";
  check_tensor(api, "output", output, false);
  check_tensor(api, "input", input, false);
  if (any_cuda({&output, &input})) {
    return stage_through_host({output, input}, {false, true}, {true, false}, [this](auto& h) {
      return all_to_all_async(h[0], h[1]);
    });
  }
  check_same_dtype(api, output, input);
  TORCH_CHECK(output.numel() == input.numel() && input.numel() % config_.size == 0,
              "[fsdp::ProcessGroup::all_to_all] equal splits need input and output of the same "
              "size, a multiple of the group size ",
              config_.size, "; got input ", input.numel(), " and output ", output.numel(),
              " elements");
  counters_.all_to_all_bytes += input.nbytes();
  counters_.calls += 1;
  Fingerprint fp{CollectiveOp::kAllToAll, input.scalar_type(), input.numel(), 0};
  return enqueue(
      fp, {output, input},
      [output, input](Transport& t) {
        if (input.numel() == 0) return;
        auto in = input;
        if (in.data_ptr() == output.data_ptr()) in = input.clone();  // in-place all-to-all
        t.all_to_all(output.view(-1), in.view(-1));
      },
      [&] {
        if (!output.is_same(input)) output.view(-1).copy_(input.view(-1));
      });
}

WorkPtr GroupImpl::barrier_async() {
  counters_.calls += 1;
  Fingerprint fp{CollectiveOp::kBarrier, at::kByte, 0, 0};
  return enqueue(fp, {}, [](Transport& t) { t.barrier(); });
}

void GroupImpl::do_reduce_scatter(Transport& t, const at::Tensor& output,
                                  const at::Tensor& input, ReduceOp op) {
  // Every backend, every dtype: see Note [Reduce-scatter emulation].
  auto recv = at::empty_like(input);
  t.all_to_all(recv, input);
  reduce_chunks(output, recv.view({config_.size, output.numel()}), op);
}

void GroupImpl::do_all_reduce(Transport& t, const at::Tensor& tensor, ReduceOp op) {
  const auto dtype = tensor.scalar_type();
  if (t.has_native_all_reduce(dtype)) {
    t.all_reduce(tensor, op == ReduceOp::kMax ? ReduceOp::kMax : ReduceOp::kSum);
    if (op == ReduceOp::kAvg) divide_by(tensor, config_.size);
    return;
  }
  // bf16/fp16: reduce-scatter with fp32 accumulation, then all-gather the reduced chunks.
  // See Note [Reduce-scatter emulation].
  const int64_t n = tensor.numel();
  const int64_t world = config_.size;
  const int64_t chunk = (n + world - 1) / world;
  at::Tensor full = tensor;
  if (chunk * world != n) {
    full = at::zeros({chunk * world}, tensor.options());
    full.narrow(0, 0, n).copy_(tensor);
  }
  auto shard = at::empty({chunk}, tensor.options());
  do_reduce_scatter(t, shard, full, op);
  t.all_gather(full, shard);
  if (!full.is_same(tensor)) tensor.copy_(full.narrow(0, 0, n));
}

std::shared_ptr<ProcessGroup> GroupImpl::new_subgroup(const std::vector<int>& ranks) {
  TORCH_CHECK(!ranks.empty(), "[fsdp::ProcessGroup::new_subgroup] empty rank list");
  std::vector<int> group_ranks;
  int my_index = -1;
  const int my_world_rank = config_.world_ranks[config_.rank];
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(i == 0 || ranks[i] > ranks[i - 1],
                "[fsdp::ProcessGroup::new_subgroup] ranks must be sorted and unique, got ",
                c10::IntArrayRef(std::vector<int64_t>(ranks.begin(), ranks.end())));
    auto it = std::find(config_.world_ranks.begin(), config_.world_ranks.end(), ranks[i]);
    TORCH_CHECK(it != config_.world_ranks.end(), "[fsdp::ProcessGroup::new_subgroup] world rank ",
                ranks[i], " is not a member of group ", config_.name);
    group_ranks.push_back(static_cast<int>(it - config_.world_ranks.begin()));
    if (ranks[i] == my_world_rank) my_index = static_cast<int>(i);
  }
  std::ostringstream name;
  name << "group[";
  for (size_t i = 0; i < ranks.size(); ++i) name << (i ? "," : "") << ranks[i];
  name << "]";
  const std::string uid = config_.uid + ".s" + std::to_string(next_subgroup_++);
  int64_t hash = 17;
  for (int r : ranks) hash = hash * 1000003 + r;
  std::unique_ptr<Transport> sub;
  bool own_thread = true;
  Fingerprint fp{CollectiveOp::kNewSubgroup, at::kInt, static_cast<int64_t>(ranks.size()),
                 hash & ((int64_t(1) << 40) - 1)};
  if (ranks.size() > 1 && config_.size > 1) {
    std::mutex m;
    enqueue(fp, {}, [&](Transport& t) {
          auto made = t.split(group_ranks, uid);
          std::lock_guard<std::mutex> lock(m);
          sub = std::move(made);
        })->wait();
    std::lock_guard<std::mutex> lock(m);
    // MPI transports share the one MPI thread; Gloo groups get their own.
    own_thread = config_.backend != "mpi";
  } else {
    enqueue(fp, {}, [](Transport&) {})->wait();
  }
  if (my_index < 0) return nullptr;
  GroupConfig cfg = config_;
  cfg.name = name.str();
  cfg.uid = uid;
  cfg.rank = my_index;
  cfg.size = static_cast<int>(ranks.size());
  cfg.world_ranks = ranks;
  std::shared_ptr<CommThread> thread;
  if (cfg.size > 1) {
    TORCH_INTERNAL_ASSERT(sub != nullptr, "transport split returned nothing for a member");
    thread = own_thread ? std::make_shared<CommThread>("fsdp-comm " + cfg.name) : thread_;
  }
  auto group = std::make_shared<GroupImpl>(std::move(cfg), std::move(sub), std::move(thread),
                                           monitor_, own_thread);
  track_group(group);
  return group;
}

}  // namespace fsdp::detail

namespace fsdp {

double comm_busy_seconds() {
  return static_cast<double>(detail::comm_busy_ns.load(std::memory_order_relaxed)) * 1e-9;
}

}  // namespace fsdp
