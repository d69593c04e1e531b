// fsdp::launch: turn one program into N ranks (spawning or adopting), and the failure paths
// that make one failing rank end all of them. See Note [Supervisor], Note [Failure notice],
// Note [MPI launch] and Note [Rank 0 exit].
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <utility>
#include <thread>

#include "comm/launcher_detail.h"
#include "comm/mpirun_output.h"
#include "comm/rendezvous.h"

namespace fsdp {

namespace detail {

namespace {

// Set once at launch (before any handler can run) and read by the failure paths.
std::atomic<int> g_rank{0};
std::atomic<int> g_notify_fd{-1};
std::atomic<bool> g_parent_is_rank0{false};  // a rank fsdp::launch spawned (Note [Failure notice])
Supervisor* g_supervisor = nullptr;  // rank 0 of a spawned job; leaked on purpose
// For the fatal-signal handler (async-signal-safe): children's pids and precomputed lines.
constexpr int kMaxChildren = 4096;
pid_t g_child_pids[kMaxChildren];
std::atomic<int> g_num_children{0};
char g_signal_prefix[64] = "[rank 0] ";
char g_world_text[32] = "1";

void raw_write(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    ssize_t w = ::write(2, s, n);
    if (w <= 0) {
      if (w < 0 && errno == EINTR) continue;
      return;
    }
    s += w;
    n -= static_cast<size_t>(w);
  }
}

// Async-signal-safe decimal.
void format_int(int v, char* out) {
  char tmp[16];
  int n = 0;
  bool neg = v < 0;
  unsigned u = neg ? static_cast<unsigned>(-v) : static_cast<unsigned>(v);
  do {
    tmp[n++] = static_cast<char>('0' + u % 10);
    u /= 10;
  } while (u > 0);
  int i = 0;
  if (neg) out[i++] = '-';
  while (n > 0) out[i++] = tmp[--n];
  out[i] = '\0';
}

void on_fatal_signal(int sig) {
  send_failure_notice();
  char num[16];
  format_int(sig, num);
  raw_write(g_signal_prefix);
  raw_write("fatal signal ");
  raw_write(num);
  raw_write(" (");
  raw_write(sigabbrev_np(sig) ? sigabbrev_np(sig) : "?");
  raw_write(")\n");
  int n = g_num_children.load();
  if (n > 0) {
    // Rank 0 of a spawned job: take the other ranks down now (PR_SET_PDEATHSIG would too,
    // a moment later) and say so.
    for (int i = 0; i < n; ++i) {
      ::kill(-g_child_pids[i], SIGKILL);
      ::kill(g_child_pids[i], SIGKILL);
    }
    raw_write("fsdp: rank 0 was killed by signal ");
    raw_write(num);
    raw_write("; stopping all ");
    raw_write(g_world_text);
    raw_write(" ranks\n");
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

std::string exception_text(std::exception_ptr ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const c10::Error& e) {
    // TORCH_SHOW_CPP_STACKTRACES=1 is libtorch's own switch for C++ backtraces in messages.
    bool backtrace = false;
    try {
      backtrace = read_settings().show_cpp_stacktraces;
    } catch (const c10::Error&) {
      // a bad setting is reported where it is read; here it only costs the backtrace
    }
    return backtrace ? e.what() : e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

// A rank spawned by fsdp::launch whose parent (rank 0, which also watches the ranks and forwards
// their stderr) is stopped: nobody would end the job, the stopped parent would stay for ever, and
// this rank's error would stay unread in the parent's pipe. So the rank writes its error to the
// parent's own stderr (/proc/<parent>/fd/2) and ends the parent the way a supervisor ends a
// stopped rank (SIGTERM, then resume it); its other children follow (PR_SET_PDEATHSIG). Returns
// false (and does nothing) when the parent is not stopped. See Note [Culprit path deadlines] in
// process_group_monitor.cpp.
bool end_stopped_parent(const std::string& text) {
  const pid_t parent = ::getppid();
  if (parent <= 1 || !process_is_stopped(parent)) return false;
  const std::string line = text + "fsdp: rank 0 (pid " + std::to_string(parent) +
                           ") is stopped and cannot end the job; ending it and its ranks\n";
  const int fd = ::open(("/proc/" + std::to_string(parent) + "/fd/2").c_str(),
                        O_WRONLY | O_APPEND | O_CLOEXEC);
  if (fd >= 0) {
    (void)!::write(fd, line.data(), line.size());
    ::close(fd);
  } else {
    raw_write(line.c_str());
  }
  ::kill(parent, SIGTERM);
  ::kill(parent, SIGCONT);
  return true;
}

void on_terminate() {
  std::string what = "std::terminate called without an active exception";
  if (auto ep = std::current_exception()) what = "uncaught exception: " + exception_text(ep);
  fail_rank(what, 1);
}

// Note [Rank 0 exit]
// ~~~~~~~~~~~~~~~~~~
// Rank 0 of a spawned job is the user's own process, so it must not end before its children:
// a glibc on_exit hook (it sees the exit status, unlike atexit) runs when main returns or exit()
// is called. Status 0: wait for every child; if one fails meanwhile, the watcher reports it
// and ends this process with that rank's code. Non-zero: rank 0 failed without an exception
// (e.g. `return 1`), so the children are stopped and the launcher line is printed, unless a
// child's failure came first (then rank 0's status is a consequence and the watcher reports
// the child). Programs may call fsdp::finalize_ranks() to do the waiting explicitly; the hook
// then has nothing left to do. The hook is registered in launch(), after which the process
// group is created, so it runs before the group's static destructors close its sockets.
void on_rank0_exit(int status, void*) {
  Supervisor* sup = g_supervisor;
  if (!sup) return;
  if (status == 0) {
    std::fflush(stdout);
    int code = sup->wait();  // a failure while waiting _exits from the watcher
    if (code != 0) ::_exit(code);
    return;
  }
  if (sup->child_failed(0.2) || !sup->self_failed(status)) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // the watcher exits
  }
}

// Intra-op threads: the free cores shared by the local ranks (Note [Threads per rank] in
// comm/thread_choice.cpp). libtorch 2.13 defaults to one thread per core, which oversubscribes
// the cores as soon as two ranks, or a rank and other work, share them (docs/design.md "Facts
// about libtorch 2.13 on this machine": ~1000x slower matmuls under load). `announce`: this
// process says what it chose, when the choice is made here.
// A process that launches more than once (a program that builds two Trainers) measures and
// says its choice once: the first choice for the same ranks and FSDP_NUM_THREADS is kept.
void set_threads(int local_ranks, bool announce) {
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> chosen;  // {local ranks, FSDP_NUM_THREADS or 0}
  std::lock_guard<std::mutex> lock(mutex);
  const std::pair<int, int> key{local_ranks, read_settings().num_threads.value_or(0)};
  auto it = chosen.find(key);
  if (it == chosen.end()) it = chosen.emplace(key, threads_per_rank(local_ranks, announce)).first;
  at::set_num_threads(it->second);
}

}  // namespace

Supervisor* launch_supervisor() {
  return g_supervisor;
}

void send_failure_notice() {
  int fd = g_notify_fd.load();
  if (fd < 0) return;
  char buf[24];
  format_int(g_rank.load(), buf);
  size_t n = std::strlen(buf);
  buf[n] = '\n';
  (void)!::write(fd, buf, n + 1);
}

void install_failure_handlers() {
  static std::atomic<bool> installed{false};
  Settings settings;
  try {
    settings = read_settings();
  } catch (const c10::Error&) {
  }
  const LaunchInfo& info = settings.launch;
  g_rank.store(info.rank);
  std::snprintf(g_signal_prefix, sizeof(g_signal_prefix), "[rank %d] ", info.rank);
  std::snprintf(g_world_text, sizeof(g_world_text), "%d", info.world_size);
  if (settings.notify_fd >= 0) g_notify_fd.store(settings.notify_fd);
  g_parent_is_rank0.store(info.source == "spawn" && info.rank != 0);
  if (installed.exchange(true)) return;
  std::set_terminate(on_terminate);
  struct sigaction sa {};
  sa.sa_handler = on_fatal_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND | SA_NODEFER;
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) ::sigaction(sig, &sa, nullptr);
}

}  // namespace detail

using namespace detail;

[[noreturn]] void fail_rank(const std::string& what, int exit_code) {
  if (exit_code == 0) exit_code = 1;
  static std::atomic<bool> failing{false};
  if (failing.exchange(true)) {
    // Another thread is already ending this rank.
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  int rank = g_rank.load();
  std::string text = "[rank " + std::to_string(rank) + "] error: " + what + "\n";
  if (Supervisor* sup = g_supervisor) {
    // Rank 0 of a spawned job. If a child failed first, this is a consequence (e.g. the
    // child's socket closed under our collective): stay quiet, the watcher reports the child
    // and ends this process. See Note [Failure notice].
    if (sup->child_failed(0.2)) {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    std::fflush(stdout);
    raw_write(text.c_str());
    if (!sup->self_failed(exit_code)) {
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    ::_exit(exit_code);
  }
  send_failure_notice();
  std::fflush(stdout);
  if (!g_parent_is_rank0.load() || !end_stopped_parent(text)) raw_write(text.c_str());
  ::_exit(exit_code);
}

void finalize_ranks() {
  Supervisor* sup = g_supervisor;
  if (!sup) return;
  std::fflush(stdout);
  int code = sup->wait();
  if (code != 0) ::_exit(code);
}

namespace {

void check_options(const LaunchOptions& o) {
  TORCH_CHECK(o.backend == "auto" || o.backend == "gloo" || o.backend == "mpi" ||
                  o.backend == "nccl",
              "[launch] unknown backend '", o.backend, "'; valid: auto, gloo, mpi, nccl");
  TORCH_CHECK(o.num_nodes >= 1, "[launch] num_nodes must be >= 1, got ", o.num_nodes);
  TORCH_CHECK(o.devices <= 4096, "[launch] devices=", o.devices, " is not a sensible rank count");
}

[[noreturn]] void exec_through_mpirun(int devices) {
  std::vector<std::string> argv = mpirun_prefix(devices);
  std::string exe = self_exe();
  std::vector<std::string> args = self_argv();
  argv.push_back(exe);
  argv.insert(argv.end(), args.begin() + 1, args.end());
  int threads = launch_threads(devices, /*announce=*/true);
  // The variables mpirun's ranks inherit (mpirun is started from this process): see
  // docs/environment.md.
  ::setenv("OMP_NUM_THREADS", std::to_string(threads).c_str(), 1);
  ::setenv(kEnvLaunchThreads, std::to_string(threads).c_str(), 1);
  ::setenv(kEnvLauncher, "mpirun", 1);
  if (devices > available_cores()) ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", 1);
  // OpenMPI gives its children a pseudo-terminal for stdout even when ours is a pipe or file;
  // tell them what ours is (ProgressBar::stdout_is_terminal).
  if (!read_settings().stdout_is_terminal) {
    ::setenv("FSDP_STDOUT_IS_TERMINAL", ::isatty(STDOUT_FILENO) == 1 ? "1" : "0", 1);
  }
  std::fflush(stdout);
  std::cerr.flush();
  run_mpirun_filtered(argv);  // See Note [MPI launch output]
}

}  // namespace

LaunchInfo launch(const LaunchOptions& options) {
  check_options(options);
  // No caching: after spawning, rank 0's own environment says RANK=0 etc., so a second call
  // adopts; and one test process (run_ranks) may see several worlds one after another.
  const Settings settings = read_settings();
  LaunchInfo info = settings.launch;
  if (info.source != "none") {
    // Adopt the ranks a launcher (or our own spawner) gave.
    TORCH_CHECK(options.devices <= 0 || options.devices == info.local_world_size, "[launch] ",
                "devices=", options.devices, " but the launcher (", info.source, ") started ",
                info.local_world_size,
                " rank(s) on this node (LOCAL_WORLD_SIZE); make them "
                "agree, or pass devices=0 to take the launcher's count");
    TORCH_CHECK(options.devices <= 0 || options.num_nodes == info.num_nodes, "[launch] ",
                "num_nodes=", options.num_nodes, " but the launcher (", info.source, ") started ",
                info.world_size, " ranks, ", info.local_world_size, " per node = ", info.num_nodes,
                " node(s); make them agree");
    // Under an outside launcher each rank chooses for itself and rank 0 says what it chose.
    set_threads(info.local_world_size, /*announce=*/info.rank == 0);
    install_failure_handlers();
    return info;
  }

  TORCH_CHECK(options.num_nodes == 1, "[launch] num_nodes=", options.num_nodes,
              " but this process was not started by a launcher, and a program cannot start "
              "ranks on other machines by itself. On each node run `fsdp-run -n <devices> "
              "--nnodes ",
              options.num_nodes,
              " --node-rank <k> --master-addr <node 0's address> "
              "--master-port <port> -- <program> <args>`, or use `srun` (SLURM) or `mpirun`");
  int devices = std::max(1, options.devices);
  if (devices == 1) {
    set_threads(1, /*announce=*/true);
    install_failure_handlers();
    return info;
  }
  if (options.backend == "mpi") exec_through_mpirun(devices);

  // Spawn devices-1 copies of this program; this process is rank 0.
  std::string addr = info.master_addr;  // MASTER_ADDR, else 127.0.0.1
  int port = info.master_port > 0 ? info.master_port : free_port();
  // Measured before the other ranks start, so their start-up is not counted as load.
  int threads = launch_threads(devices, /*announce=*/true);
  std::map<std::string, std::string> common = {
      {"WORLD_SIZE", std::to_string(devices)},
      {"LOCAL_WORLD_SIZE", std::to_string(devices)},
      {"MASTER_ADDR", addr},
      {"MASTER_PORT", std::to_string(port)},
      {"GROUP_RANK", "0"},
      {kEnvLauncher, "spawn"},
      {kEnvLaunchThreads, std::to_string(threads)},
      // One job id for the ranks spawned here; see Note [Rendezvous handshake].
      {"FSDP_JOB_ID", !settings.job_id.empty() ? settings.job_id : random_job_id()},
  };
  for (const auto& [k, v] : common) ::setenv(k.c_str(), v.c_str(), 1);
  ::setenv("RANK", "0", 1);
  ::setenv("LOCAL_RANK", "0", 1);

  SupervisorOptions sopt;
  sopt.world_size = devices;
  sopt.self_rank = 0;
  sopt.forward_stderr = true;
  auto* sup = new Supervisor(sopt);  // leaked: the watcher runs until the process ends
  std::string exe = self_exe();
  std::vector<std::string> argv = self_argv();
  argv[0] = exe;
  for (int r = 1; r < devices; ++r) {
    auto env = common;
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    env["OMP_NUM_THREADS"] = std::to_string(threads);
    sup->spawn({r, argv, make_env(env)});
  }
  auto pids = sup->pids();
  for (size_t i = 0; i < pids.size() && i < static_cast<size_t>(kMaxChildren); ++i)
    g_child_pids[i] = pids[i];
  g_num_children.store(static_cast<int>(std::min(pids.size(), static_cast<size_t>(kMaxChildren))));
  g_supervisor = sup;
  ::on_exit(on_rank0_exit, nullptr);
  sup->start(/*exit_process_on_failure=*/true);

  info = launch_info_from_env();
  set_threads(devices, /*announce=*/false);  // FSDP_LAUNCH_THREADS, set above
  install_failure_handlers();
  return info;
}

}  // namespace fsdp
