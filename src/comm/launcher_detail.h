// Internals shared by the launcher (fsdp::launch), fsdp-run and the multi-rank test helper:
// spawning rank processes and watching them (the Supervisor), environment helpers.
#pragma once

#include "common/settings.h"
#include "fsdp/launcher.h"

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

// --- environment ------------------------------------------------------------------------

// Environment variables the launcher sets for the ranks it starts (read back through
// Settings, src/common/settings.h; documented in docs/environment.md).
constexpr const char* kEnvNotifyFd = "FSDP_LAUNCH_NOTIFY_FD";  // see Note [Failure notice]
// "spawn" | "mpirun" (fsdp::launch) | "fsdp-run" | "test"
constexpr const char* kEnvLauncher = "FSDP_LAUNCHER";
// The intra-op threads per rank the launcher chose (Note [Threads per rank] in
// comm/thread_choice.cpp); FSDP_NUM_THREADS stays the user's.
constexpr const char* kEnvLaunchThreads = "FSDP_LAUNCH_THREADS";

// CPUs this process may run on (sched_getaffinity; respects cpusets and taskset).
int available_cores();
// Intra-op threads per rank for a launcher about to start `local_ranks` ranks on this node (or a
// process that is its job's only rank): FSDP_NUM_THREADS when set, else chosen from the load of
// this moment (Note [Threads per rank] in comm/thread_choice.cpp; measuring takes ~150 ms).
// `announce`: print the one line about the choice to stderr (when there is one to print).
int launch_threads(int local_ranks, bool announce);
// Intra-op threads for one of `local_ranks` ranks on this node: FSDP_NUM_THREADS when set, else
// what the launcher that started this rank chose (FSDP_LAUNCH_THREADS), else launch_threads().
int threads_per_rank(int local_ranks, bool announce = false);

// A TCP port that was free a moment ago on 127.0.0.1 (bind to port 0, read it, close).
int free_port();

// Absolute path of this executable and this process's argv (from /proc/self).
std::string self_exe();
std::vector<std::string> self_argv();

// The current environment as "K=V" strings, with `overrides` applied (value "" is kept as an
// empty value; use `remove` to drop variables).
std::vector<std::string> make_env(const std::map<std::string, std::string>& overrides,
                                  const std::vector<std::string>& remove = {});

// "/usr/bin/mpirun" or "" when mpirun is not on PATH.
std::string find_on_path(const std::string& program);

// mpirun and its flags for an N-rank job on this host (see Note [MPI launch]).
std::vector<std::string> mpirun_prefix(int nprocs);

// --- the supervisor -----------------------------------------------------------------------

struct ChildSpec {
  int rank = 0;
  std::vector<std::string> argv;  // argv[0] is the program path (absolute or on PATH)
  std::vector<std::string> env;   // complete environment, "K=V"
};

struct ChildStatus {
  int rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int wait_status = 0;   // raw waitpid status, valid when exited
  bool stopped = false;  // the supervisor signalled it (after a failure elsewhere)
};

// Writes all of it to fd, retrying after EINTR and short writes; gives up on other errors.
// Async-signal-safe (write(2) only), so usable between fork and exec.
void write_all(int fd, const char* data, size_t n);
void write_all(int fd, const std::string& s);

// How a finished process ended: "exited with status 1" / "was killed by signal 9 (Killed)".
std::string describe_wait_status(int wait_status);
// The kernel's count of OOM kills (/proc/vmstat oom_kill), -1 when unknown.
int64_t kernel_oom_kills();
// For a rank that died of SIGKILL the supervisor did not send, while the kernel's OOM-kill count
// rose since the job started: a sentence saying so and what to do; "" otherwise.
std::string oom_kill_explanation(int wait_status, bool stopped_by_us, int64_t oom_kills_before,
                                 int64_t oom_kills_now);
// True when the process is stopped (state T or t in /proc/<pid>/stat: SIGSTOP, job control, a
// debugger).
bool process_is_stopped(pid_t pid);
// Shell-style exit code: the exit status, or 128 + signal.
int exit_code_of(int wait_status);
bool failed(int wait_status);

// Note [Supervisor]
// ~~~~~~~~~~~~~~~~~
// One Supervisor owns the rank processes a launcher spawned. It forks them (always from the
// calling thread, which should be the main thread: PR_SET_PDEATHSIG fires when the *thread*
// that forked exits), each child in its own process group with PR_SET_PDEATHSIG(SIGKILL), so
// a parent that dies for any reason (even SIGKILL) takes its children with it, and killing a
// rank kills anything it started. A watcher loop (a thread in fsdp::launch and run_ranks, the
// main loop in fsdp-run) polls the children (waitpid on each pid, never waitpid(-1): rank 0's
// own program may have children of its own), the failure-notice pipe and the children's
// stderr pipes. The first failure (see Note [Failure notice]) is the *primary* failure: the
// other ranks get SIGTERM (and SIGCONT: a stopped rank acts on SIGTERM only once resumed) and,
// after a grace period, SIGKILL; the primary's stderr is drained
// and one line says what happened: "fsdp: rank 2 exited with status 1; stopping all 4 ranks".
//
// Note [Failure notice]
// ~~~~~~~~~~~~~~~~~~~~~
// When a rank fails, its peers fail soon after with secondary errors ("Connection reset by
// peer") that must not drown the real one. Two mechanisms keep them out:
//  1. Every spawned rank inherits the write end of one pipe (fd in FSDP_LAUNCH_NOTIFY_FD).
//     fail_rank, the terminate handler and the fatal-signal handler write "<rank>\n" to it
//     *before* printing anything. The watcher reads the notices before it forwards stderr, so
//     the first rank to notice is known before anybody's error text is forwarded. A rank that
//     dies without a notice (SIGKILL) is found by waitpid; when a notice arrives the watcher
//     first looks (again after 20 ms) for a rank that already died without one, because that
//     death is what the noticing rank is reacting to.
//  2. Children's stderr goes through the watcher line by line. Once the primary failure is
//     known, lines from other ranks are dropped (their count is reported). Rank 0 of
//     fsdp::launch is the parent itself: its failure path first asks the supervisor whether a
//     child already failed (waiting up to 200 ms for a notice) and stays silent if so.
// A survivor that prints an error by itself (not through fsdp's failure paths) before the
// primary is known still gets through; everything after that point is dropped.
struct SupervisorOptions {
  int world_size = 1;          // for messages
  int self_rank = -1;          // this process's rank when it is one of the ranks, else -1
  bool forward_stderr = true;  // pipe children's stderr through the watcher (Note above)
  double kill_grace_s = 3.0;   // SIGTERM -> SIGKILL
  // After a child failed, let the others finish by themselves this long before stopping them
  // (run_ranks: so every failing rank of a test gets to report; launchers: 0).
  double stop_delay_s = 0.0;
  std::string who = "fsdp";  // prefix of the launcher's own lines
};

class Supervisor {
 public:
  explicit Supervisor(SupervisorOptions options);
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  // Forks and execs one child. Call from the main thread, before start().
  void spawn(const ChildSpec& spec);

  // Watches on a background thread until every child exited or a failure was handled.
  // If exit_process_on_failure, the watcher ends this whole process (after stopping the
  // children and printing the launcher line) with the primary's exit code.
  void start(bool exit_process_on_failure);
  // Watches on the calling thread until all children exited; returns the exit code
  // (0, or the primary failure's code). For fsdp-run.
  int run();

  // Blocks until the watcher finished; returns 0 when every child exited 0, else the
  // primary failure's exit code.
  int wait();

  // This process (self_rank) failed: stop the children, print the launcher line. Does not
  // exit; the caller does. Returns false (and does nothing) when a child's failure was already
  // the primary one: the watcher is handling it. Safe to call from any thread.
  bool self_failed(int exit_code);
  // True when a child failed (or fails within `grace_s`): checks synchronously.
  bool child_failed(double grace_s);
  // SIGTERM, then SIGKILL after the grace period, to every child still running.
  void stop_all();
  // Asks the watcher to stop every child (SIGTERM, then SIGKILL) because this process got
  // signal `sig`; the watch then ends with code 128+sig. Async-signal-safe (fsdp-run calls it
  // from its SIGINT/SIGTERM handler).
  void request_stop(int sig);

  int primary_rank() const;                   // -1 when no failure
  std::vector<ChildStatus> statuses() const;  // one per spawned child
  std::vector<pid_t> pids() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The supervisor of this process's spawned ranks (fsdp::launch), or nullptr.
Supervisor* launch_supervisor();

// Installs std::terminate and fatal-signal handlers that mark the failing rank (and notify
// the watcher). Idempotent.
void install_failure_handlers();

// Failure notice to the launcher's watcher (see Note [Failure notice]); async-signal-safe.
void send_failure_notice();

}  // namespace fsdp::detail
