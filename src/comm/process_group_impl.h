// Internals of fsdp::ProcessGroup: one generic group (GroupImpl) that owns sequence numbers,
// counters, validation, the exact emulation of missing ops, timeouts and FSDP_DEBUG checks, on
// top of a thin Transport per backend (Gloo, MPI) that only moves bytes or calls native
// reductions. See Note [Comm thread] and Note [Collective timeouts].
#pragma once

#include "fsdp/comm.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>


namespace fsdp::detail {

enum class CollectiveOp : int64_t {
  kAllGather = 1,
  kReduceScatter = 2,
  kAllReduce = 3,
  kBroadcast = 4,
  kAllToAll = 5,
  kBarrier = 6,
  kNewSubgroup = 7,
};
const char* to_string(CollectiveOp op);
// "float32", "bfloat16", ... (the names users know from Python).
std::string dtype_name(at::ScalarType dtype);

// A backend's primitives. Every method is called on the group's comm thread, blocking, in the
// same order on every rank of the group, with contiguous CPU tensors of numel > 0.
class Transport {
 public:
  virtual ~Transport() = default;
  // Pure data movement: any dtype, moved as bytes.
  virtual void all_gather(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual void all_to_all(const at::Tensor& output, const at::Tensor& input) = 0;
  virtual void broadcast(const at::Tensor& tensor, int root) = 0;
  virtual void barrier() = 0;
  // Native reductions (op is kSum or kMax) for the dtypes the backend reduces exactly.
  virtual bool has_native_all_reduce(at::ScalarType dtype) const = 0;
  virtual void all_reduce(const at::Tensor& tensor, ReduceOp op) = 0;
  // No reduce-scatter: every backend's is Note [Reduce-scatter emulation] (all_to_all + sum).
  // Transport of a subgroup (group_ranks are ranks of this group, sorted). Collective over this
  // group; returns nullptr on non-members. uid is the same on every rank.
  virtual std::unique_ptr<Transport> split(const std::vector<int>& group_ranks,
                                           const std::string& uid) = 0;
};

// Note [Comm thread]
// ~~~~~~~~~~~~~~~~~~
// Every collective runs on a dedicated communication thread, in issue order (FIFO):
//  - MPI: OpenMPI's non-blocking collectives make progress mostly inside MPI calls, so an
//    MPI_Iallgather left alone while the main thread computes barely advances. One process-wide
//    comm thread initialises MPI (MPI_THREAD_FUNNELED) and makes every MPI call, blocking, so
//    async work really runs while the caller computes. One thread for all MPI groups also means
//    collectives on different groups run in program order (MPI's own rule for blocking calls).
//  - Gloo: ProcessGroupGloo has worker threads, but our emulated ops are chains (alltoall, then
//    a local fp32 sum, then an allgather for a half-precision all-reduce). Issuing the second
//    link from a callback would race with the caller's next collective for Gloo's tag order, so
//    each Gloo group has its own comm thread that runs the whole chain; the local sums then also
//    run off the caller's thread.
// The caller's thread only assigns the sequence number and enqueues, so the hot path is one
// mutex and one condition-variable notify. The thread sleeps on a condition variable when idle.
struct OpRecord;

class CommThread {
 public:
  explicit CommThread(std::string name);
  ~CommThread();
  void post(std::function<void()> task);
  // Runs task on the thread and waits for it; rethrows its exception.
  void run_sync(const std::function<void()>& task);
  // Drains the queue and joins. If the queue has not drained after `grace` (a collective is
  // hung after a timeout), the thread is detached instead; returns false then.
  bool stop(std::chrono::milliseconds grace);
  bool on_thread() const { return std::this_thread::get_id() == id_; }
  // The collective running on this thread now (any group sharing it), for timeout checks of
  // work queued behind it.
  void set_current(std::shared_ptr<OpRecord> record);
  std::shared_ptr<OpRecord> current();

 private:
  void loop();
  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  bool busy_ = false;
  bool exited_ = false;
  std::thread thread_;
  std::thread::id id_;
  std::mutex current_mutex_;
  std::shared_ptr<OpRecord> current_;
};

// What describe_missing says of ranks whose liveness counter stopped.
inline constexpr const char* kSilentRanks =
    "their host is lost, the network to it is down, or their processes are stopped";

// Publishes, per group, the sequence number and op of the collective this rank last called,
// and answers "which ranks did not join collective #s" when one times out.
// See Note [Collective timeouts] and Note [Culprit path deadlines].
class Monitor {
 public:
  // period: heartbeat interval (min(1 s, timeout / 4) keeps messages accurate).
  Monitor(c10::intrusive_ptr<c10d::Store> store, int world_rank, std::chrono::milliseconds period);
  ~Monitor();
  // issued: (seq << 4) | op of the last collective this rank called on the group.
  void add_group(const std::string& uid, std::shared_ptr<std::atomic<int64_t>> issued);
  void remove_group(const std::string& uid);
  // "ranks 2 did not join (rank 2 last called barrier #1)"; never throws, never waits longer
  // than answer_deadline(timeout) for the store, twice, plus one heartbeat period.
  std::string describe_missing(const std::string& uid, const std::vector<int>& world_ranks,
                               int64_t seq, std::chrono::milliseconds timeout);
  // Stops the heartbeat thread; waits for it at most a few seconds (it may be stuck in a store
  // call to a stopped rank 0) and leaves it behind after that.
  void stop();
  // How long describe_missing waits for the store's answer before it names rank 0 (the
  // store's host) as not heard from.
  static std::chrono::milliseconds answer_deadline(std::chrono::milliseconds timeout);

  struct State;  // shared with the heartbeat thread, which may outlive the Monitor

 private:
  std::shared_ptr<State> state_;
  std::chrono::milliseconds initial_period_{1000};  // every rank's heartbeat interval
  std::mutex describe_mutex_;  // one describe_missing at a time
};

// State of one enqueued collective, shared by its Work handle and the comm thread.
class GroupImpl;
struct OpRecord {
  GroupImpl* group = nullptr;  // alive while the record runs (shutdown drains the queue)
  std::chrono::milliseconds timeout{0};
  CollectiveOp op;
  int64_t seq = 0;
  std::string what;  // "all_reduce #17 on group world (gloo)"
  std::mutex mutex;
  std::condition_variable cv;
  enum class State { kQueued, kRunning, kDone } state = State::kQueued;
  std::chrono::steady_clock::time_point started;
  std::exception_ptr error;
  bool mismatch = false;  // FSDP_DEBUG fingerprint mismatch (consistent on all ranks)
  std::string message;    // final error text once known
  std::vector<at::Tensor> keep_alive;
};

struct GroupConfig {
  std::string backend;  // "gloo" | "mpi"
  std::string name;     // "world", "shard[0,1]", ...
  std::string uid;      // unique over the job, same on every rank
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  bool debug_detail = false;
};

class GroupImpl final : public ProcessGroup, public std::enable_shared_from_this<GroupImpl> {
 public:
  // transport == nullptr iff size == 1 (then every op is local and needs no network).
  GroupImpl(GroupConfig config, std::unique_ptr<Transport> transport,
            std::shared_ptr<CommThread> thread, std::shared_ptr<Monitor> monitor,
            bool owns_thread);
  ~GroupImpl() override;

  int rank() const override { return config_.rank; }
  int size() const override { return config_.size; }
  std::string backend() const override { return config_.backend; }
  const std::vector<int>& world_ranks() const override { return config_.world_ranks; }

  WorkPtr all_gather_into_tensor_async(at::Tensor output, at::Tensor input) override;
  WorkPtr reduce_scatter_tensor_async(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr all_reduce_async(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast_async(at::Tensor tensor, int root) override;
  WorkPtr all_to_all_async(at::Tensor output, at::Tensor input) override;
  WorkPtr barrier_async() override;
  std::shared_ptr<ProcessGroup> new_subgroup(const std::vector<int>& ranks) override;

  const GroupConfig& config() const { return config_; }
  void set_name(std::string name) { config_.name = std::move(name); }
  // Finishes queued work, releases the transport (communicators, sockets). Idempotent.
  void shutdown();

  // Used by Work::wait (see Note [Collective timeouts]).
  void wait_record(const std::shared_ptr<OpRecord>& record);
  // The timeout error of one of this group's records (queries the Monitor once, poisons).
  std::string timeout_message(const std::shared_ptr<OpRecord>& record);

 private:
  struct Fingerprint {
    CollectiveOp op;
    at::ScalarType dtype;
    int64_t numel;
    int64_t arg;  // root, reduce op, or output numel
  };
  // Assigns the next sequence number and queues body on the comm thread; in a group of one
  // rank runs `local` right away instead (no thread, no network).
  WorkPtr enqueue(const Fingerprint& fp, std::vector<at::Tensor> keep_alive,
                  std::function<void(Transport&)> body,
                  const std::function<void()>& local = nullptr);
  // Runs `body` and then destroys it, before the record is done: the tensors it captured (a
  // collective's input) are not kept alive past the wait by the comm thread.
  void run_record(const std::shared_ptr<OpRecord>& record, const Fingerprint& fp,
                  std::function<void(Transport&)> body);
  void poison(const std::string& why);
  void check_usable(const char* op) const;
  std::string describe(CollectiveOp op, int64_t seq) const;

  // Algorithms (comm thread). See Note [Reduce-scatter emulation] and Note [bf16 travel].
  void do_reduce_scatter(Transport& t, const at::Tensor& output, const at::Tensor& input,
                         ReduceOp op);
  void do_all_reduce(Transport& t, const at::Tensor& tensor, ReduceOp op);

  GroupConfig config_;
  std::unique_ptr<Transport> transport_;
  std::shared_ptr<CommThread> thread_;
  std::shared_ptr<Monitor> monitor_;
  bool owns_thread_;
  std::mutex issue_mutex_;  // seq assignment + enqueue are one step (issue order = run order)
  int64_t next_seq_ = 1;
  int next_subgroup_ = 0;
  std::shared_ptr<std::atomic<int64_t>> issued_;  // (seq << 4) | op, read by the Monitor
  mutable std::mutex state_mutex_;
  std::string poisoned_;  // non-empty: an earlier collective failed, the group is unusable
  bool shut_down_ = false;
};

// Local reduction of `chunks` (world x k, any reducible dtype) into output (k): sum or max in
// fp32 for bf16/fp16 (fp32 accumulation, one rounding), then AVG divides (integer division
// truncating toward zero for integer dtypes). See Note [Reduce-scatter emulation].
void reduce_chunks(const at::Tensor& output, const at::Tensor& chunks, ReduceOp op);

bool is_reducible(at::ScalarType dtype);

// Remembers a group so destroy_process_group() and process exit can shut it down (before
// MPI_Finalize) even while user code still holds it. Defined in process_group.cpp.
void track_group(const std::shared_ptr<GroupImpl>& group);
bool is_half(at::ScalarType dtype);

}  // namespace fsdp::detail
