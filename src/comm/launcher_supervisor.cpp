// The Supervisor: spawns rank processes and watches them. See Note [Supervisor] and
// Note [Failure notice] in launcher_detail.h.
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "comm/launcher_detail.h"

namespace fsdp::detail {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

void write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

void write_all(int fd, const std::string& s) {
  write_all(fd, s.data(), s.size());
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = ::strsignal(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name ? std::string(" (") + name + ")" : "");
  }
  return "ended with wait status " + std::to_string(status);
}

bool process_is_stopped(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');  // the name may hold spaces and parentheses
  if (close == std::string::npos || close + 2 >= line.size()) return false;
  const char state = line[close + 2];
  return state == 'T' || state == 't';
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int64_t kernel_oom_kills() {
  std::ifstream vmstat("/proc/vmstat");
  std::string key;
  int64_t value = 0;
  while (vmstat >> key >> value) {
    if (key == "oom_kill") return value;
  }
  return -1;
}

std::string oom_kill_explanation(int wait_status, bool stopped_by_us, int64_t oom_kills_before,
                                 int64_t oom_kills_now) {
  if (!WIFSIGNALED(wait_status) || WTERMSIG(wait_status) != SIGKILL || stopped_by_us) return "";
  if (oom_kills_before < 0 || oom_kills_now <= oom_kills_before) return "";
  return " — the kernel's OOM killer ran during this job (/proc/vmstat oom_kill " +
         std::to_string(oom_kills_before) + " -> " + std::to_string(oom_kills_now) +
         "), so the machine (or the job's memory cgroup) most likely ran out of memory. HINT: "
         "give each rank less to hold (a sharding strategy such as fsdp or deepspeed_stage_3, "
         "fewer ranks on this host) or set FSDP_MEMORY_BUDGET lower so that setup refuses what "
         "cannot fit; `dmesg | grep -i oom` names the process";
}

bool failed(int status) {
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

struct Supervisor::Impl {
  const int64_t oom_kills_at_start = kernel_oom_kills();  // see oom_kill_explanation
  struct Child {
    int rank = 0;
    pid_t pid = -1;
    int err_fd = -1;  // read end of its stderr pipe, -1 when not forwarded or closed
    std::string buf;  // stderr bytes not yet forwarded (incomplete line)
    bool exited = false;
    int status = 0;
    bool noticed = false;  // sent a failure notice
    bool stopped = false;  // we sent it SIGTERM/SIGKILL
    int64_t reap_seq = 0;  // order of reaping
  };

  SupervisorOptions opt;
  std::vector<Child> children;
  int notify_r = -1, notify_w = -1;
  int wake_r = -1, wake_w = -1;

  std::mutex mu;     // children[*].exited/status/noticed, primary*, reaping, notices
  int primary = -1;  // rank of the primary failure, -1 none
  bool primary_is_self = false;
  int primary_code = 0;
  int64_t reap_counter = 0;
  std::string notice_buf;
  std::vector<int> notices;  // ranks in the order their notices arrived

  std::atomic<int> stop_signal{0};  // fsdp-run: a signal asked us to stop the job
  std::thread thread;
  bool exit_on_failure = false;
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool done = false;
  int result = 0;
  int64_t suppressed_lines = 0;
  bool drain_started = false;
  Clock::time_point drain_since;

  Child* by_rank(int rank) {
    for (auto& c : children)
      if (c.rank == rank) return &c;
    return nullptr;
  }

  // --- under mu -----------------------------------------------------------------------
  void drain_notices_locked() {
    char buf[256];
    for (;;) {
      ssize_t n = ::read(notify_r, buf, sizeof(buf));
      if (n <= 0) break;
      notice_buf.append(buf, static_cast<size_t>(n));
    }
    size_t pos;
    while ((pos = notice_buf.find('\n')) != std::string::npos) {
      int rank = std::atoi(notice_buf.substr(0, pos).c_str());
      notice_buf.erase(0, pos + 1);
      if (Child* c = by_rank(rank)) {
        if (!c->noticed) {
          c->noticed = true;
          notices.push_back(rank);
        }
      }
    }
  }

  void reap_locked() {
    for (auto& c : children) {
      if (c.exited) continue;
      int status = 0;
      pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) {
        c.exited = true;
        c.status = status;
        c.reap_seq = ++reap_counter;
      } else if (r < 0 && errno == ECHILD) {
        // Somebody else reaped it (should not happen: we never waitpid(-1)).
        c.exited = true;
        c.status = 0;
        c.reap_seq = ++reap_counter;
      }
    }
  }

  // A child that died (failed) without sending a notice, earliest reaped first.
  Child* silent_death_locked() {
    Child* best = nullptr;
    for (auto& c : children)
      if (c.exited && !c.stopped && failed(c.status) && !c.noticed &&
          (!best || c.reap_seq < best->reap_seq))
        best = &c;
    return best;
  }

  // Sets `primary` when a child failed. See Note [Failure notice].
  void decide_locked() {
    if (primary >= 0) return;
    drain_notices_locked();
    reap_locked();
    if (Child* c = silent_death_locked()) {
      primary = c->rank;
      return;
    }
    if (notices.empty()) return;
    // A notice: give a rank that died silently (what the noticing rank may be reacting to)
    // a moment to become visible to waitpid.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    reap_locked();
    drain_notices_locked();
    if (Child* c = silent_death_locked()) {
      primary = c->rank;
      return;
    }
    primary = notices.front();
  }

  bool all_exited_locked() const {
    for (const auto& c : children)
      if (!c.exited) return false;
    return true;
  }

  // --- stderr forwarding (watcher thread only) ---------------------------------------
  // Reads what is available into the children's buffers; returns false on nothing to do.
  void read_stderr(const std::vector<pollfd>& fds) {
    for (const auto& p : fds) {
      if (p.fd == notify_r || p.fd == wake_r || !(p.revents & (POLLIN | POLLHUP | POLLERR)))
        continue;
      for (auto& c : children) {
        if (c.err_fd != p.fd) continue;
        char buf[65536];
        for (;;) {
          ssize_t n = ::read(c.err_fd, buf, sizeof(buf));
          if (n > 0) {
            c.buf.append(buf, static_cast<size_t>(n));
            if (n < static_cast<ssize_t>(sizeof(buf))) break;
            continue;
          }
          if (n < 0 && (errno == EINTR)) continue;
          if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          ::close(c.err_fd);  // EOF or error
          c.err_fd = -1;
          break;
        }
      }
    }
  }

  void forward_lines(int primary_rank) {
    for (auto& c : children) {
      if (c.buf.empty()) continue;
      size_t end = c.err_fd < 0 ? c.buf.size() : c.buf.rfind('\n');
      if (end == std::string::npos) {
        if (c.buf.size() < 65536) continue;  // wait for the end of the line
        end = c.buf.size();
      } else if (c.err_fd >= 0) {
        end += 1;
      }
      if (primary_rank < 0 || c.rank == primary_rank) {
        write_all(2, c.buf.data(), end);
      } else {
        for (size_t i = 0; i < end; ++i) suppressed_lines += c.buf[i] == '\n';
      }
      c.buf.erase(0, end);
    }
  }

  std::vector<pollfd> poll_fds() const {
    std::vector<pollfd> fds;
    fds.push_back({notify_r, POLLIN, 0});
    fds.push_back({wake_r, POLLIN, 0});
    for (const auto& c : children)
      if (c.err_fd >= 0) fds.push_back({c.err_fd, POLLIN, 0});
    return fds;
  }

  // One poll round: read stderr, read notices, reap, decide, forward. Returns primary.
  int step(int timeout_ms) {
    auto fds = poll_fds();
    int r = ::poll(fds.data(), fds.size(), timeout_ms);
    if (r > 0) {
      if (fds[1].revents & POLLIN) {
        char b[64];
        while (::read(wake_r, b, sizeof(b)) > 0) {
        }
      }
      read_stderr(fds);
    }
    int p;
    {
      std::lock_guard<std::mutex> lock(mu);
      decide_locked();
      p = primary;
    }
    forward_lines(p);
    return p;
  }

  void signal_running(int sig, int except_rank) {
    std::lock_guard<std::mutex> lock(mu);
    reap_locked();
    for (auto& c : children) {
      if (c.exited || c.rank == except_rank) continue;
      c.stopped = true;
      ::kill(-c.pid, sig);  // its process group: the rank and anything it started
      ::kill(c.pid, sig);
      if (sig == SIGTERM) {
        // A stopped rank (SIGSTOP, a frozen debugger target) acts on SIGTERM only once it runs
        // again: resume it so it ends now, with its SIGTERM cleanup, instead of at SIGKILL.
        ::kill(-c.pid, SIGCONT);
        ::kill(c.pid, SIGCONT);
      }
    }
  }

  // Stops every child: SIGTERM (all but `spare`, which is finishing by itself), then after
  // the grace period SIGKILL to everything left. Keeps forwarding the primary's stderr.
  void stop_children(int spare, bool forward) {
    signal_running(SIGTERM, spare);
    auto t0 = Clock::now();
    bool killed = false;
    for (;;) {
      bool all;
      {
        std::lock_guard<std::mutex> lock(mu);
        reap_locked();
        all = all_exited_locked();
      }
      if (forward) {
        auto fds = poll_fds();
        if (::poll(fds.data(), fds.size(), 10) > 0) read_stderr(fds);
        forward_lines(primary);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (all) break;
      if (!killed && seconds_since(t0) > opt.kill_grace_s) {
        signal_running(SIGKILL, -1);
        killed = true;
      }
      if (killed && seconds_since(t0) > opt.kill_grace_s + 30) break;  // unkillable (D state)
    }
    if (forward) {
      // The primary's last words may still be in its pipe (or held by a grandchild).
      auto t1 = Clock::now();
      while (seconds_since(t1) < 0.5) {
        bool open = false;
        for (auto& c : children) open |= c.err_fd >= 0;
        if (!open) break;
        auto fds = poll_fds();
        if (::poll(fds.data(), fds.size(), 10) > 0) read_stderr(fds);
      }
      for (auto& c : children)
        if (c.err_fd >= 0) {
          ::close(c.err_fd);
          c.err_fd = -1;
        }
      forward_lines(primary);
    }
  }

  std::string failure_line(int rank, const std::string& how) const {
    std::string line = opt.who + ": rank " + std::to_string(rank) + " " + how + "; stopping all " +
                       std::to_string(opt.world_size) + " ranks";
    if (suppressed_lines > 0)
      line += " (" + std::to_string(suppressed_lines) +
              " line(s) of output from other ranks after the failure not shown)";
    return line + "\n";
  }

  // Handles the primary child failure; returns its exit code.
  int handle_child_failure() {
    int rank;
    {
      std::lock_guard<std::mutex> lock(mu);
      rank = primary;
    }
    for (auto t0 = Clock::now(); seconds_since(t0) < opt.stop_delay_s;) {
      {
        std::lock_guard<std::mutex> lock(mu);
        reap_locked();
        if (all_exited_locked()) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    stop_children(rank, opt.forward_stderr);
    Child* c = by_rank(rank);
    int status;
    bool stopped_by_us;
    {
      std::lock_guard<std::mutex> lock(mu);
      status = c->status;
      stopped_by_us = c->stopped;
      primary_code = exit_code_of(status);
      if (primary_code == 0) primary_code = 1;
    }
    write_all(2, failure_line(rank, describe_wait_status(status) +
                                        oom_kill_explanation(status, stopped_by_us,
                                                             oom_kills_at_start,
                                                             kernel_oom_kills())));
    return primary_code;
  }

  void finish(int code) {
    std::lock_guard<std::mutex> lock(done_mu);
    done = true;
    result = code;
    done_cv.notify_all();
  }

  void loop() {
    for (;;) {
      int p = step(20);
      bool self = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        self = primary_is_self;
      }
      if (self) {
        // This process failed; self_failed() stops the children. Keep dropping their output.
        bool all;
        {
          std::lock_guard<std::mutex> lock(mu);
          all = all_exited_locked();
        }
        if (all) {
          finish(primary_code);
          return;
        }
        continue;
      }
      if (int sig = stop_signal.load()) {
        write_all(2, opt.who + ": received signal " + std::to_string(sig) + " (" +
                         ::strsignal(sig) + "); stopping all " + std::to_string(opt.world_size) +
                         " ranks\n");
        stop_children(-1, opt.forward_stderr);
        finish(128 + sig);
        return;
      }
      if (p >= 0) {
        int code = handle_child_failure();
        if (exit_on_failure) {
          std::fflush(stdout);
          ::_exit(code);
        }
        finish(code);
        return;
      }
      bool all, open = false;
      {
        std::lock_guard<std::mutex> lock(mu);
        all = all_exited_locked();
      }
      for (auto& c : children) open |= c.err_fd >= 0;
      if (all && !open) {
        finish(0);
        return;
      }
      if (all) {
        // Exited, but something they started still holds stderr: drain for a moment.
        if (!drain_started) {
          drain_started = true;
          drain_since = Clock::now();
        }
        if (seconds_since(drain_since) > 1.0) {
          for (auto& c : children)
            if (c.err_fd >= 0) {
              ::close(c.err_fd);
              c.err_fd = -1;
            }
          forward_lines(-1);
        }
      }
    }
  }
};

Supervisor::Supervisor(SupervisorOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  int p[2];
  TORCH_CHECK(::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0, "[launch] pipe2: ", std::strerror(errno));
  impl_->notify_r = p[0];
  impl_->notify_w = p[1];
  TORCH_CHECK(::pipe2(p, O_CLOEXEC | O_NONBLOCK) == 0, "[launch] pipe2: ", std::strerror(errno));
  impl_->wake_r = p[0];
  impl_->wake_w = p[1];
}

Supervisor::~Supervisor() {
  if (impl_->thread.joinable()) impl_->thread.join();
  for (int fd : {impl_->notify_r, impl_->notify_w, impl_->wake_r, impl_->wake_w})
    if (fd >= 0) ::close(fd);
  for (auto& c : impl_->children)
    if (c.err_fd >= 0) ::close(c.err_fd);
}

void Supervisor::spawn(const ChildSpec& spec) {
  TORCH_CHECK(!spec.argv.empty(), "[launch] nothing to run for rank ", spec.rank);
  // Everything the child needs is prepared before fork: between fork and exec only
  // async-signal-safe calls are allowed.
  std::vector<std::string> env = spec.env;
  env.push_back(std::string(kEnvNotifyFd) + "=" + std::to_string(impl_->notify_w));
  std::vector<char*> argv, envp;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  std::string program = find_on_path(spec.argv[0]);
  TORCH_CHECK(!program.empty(), "[launch] cannot run '", spec.argv[0],
              "': not an executable file and not found on PATH");
  std::string exec_error = impl_->opt.who + ": cannot execute " + program + " for rank " +
                           std::to_string(spec.rank) + "\n";

  int errp[2] = {-1, -1};
  if (impl_->opt.forward_stderr)
    TORCH_CHECK(::pipe2(errp, O_CLOEXEC) == 0, "[launch] pipe2: ", std::strerror(errno));
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "[launch] fork failed for rank ", spec.rank, ": ", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the parent died before prctl
    if (errp[1] >= 0) ::dup2(errp[1], 2);
    ::fcntl(impl_->notify_w, F_SETFD, 0);  // keep the notice pipe across exec
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::signal(SIGPIPE, SIG_DFL);
    ::execve(program.c_str(), argv.data(), envp.data());
    write_all(2, exec_error.data(), exec_error.size());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  Impl::Child c;
  c.rank = spec.rank;
  c.pid = pid;
  if (errp[1] >= 0) {
    ::close(errp[1]);
    ::fcntl(errp[0], F_SETFL, O_NONBLOCK);
    c.err_fd = errp[0];
  }
  impl_->children.push_back(std::move(c));
}

void Supervisor::start(bool exit_process_on_failure) {
  impl_->exit_on_failure = exit_process_on_failure;
  impl_->thread = std::thread([this] { impl_->loop(); });
}

int Supervisor::run() {
  impl_->loop();
  return impl_->result;
}

int Supervisor::wait() {
  if (impl_->thread.joinable()) impl_->thread.join();
  std::unique_lock<std::mutex> lock(impl_->done_mu);
  impl_->done_cv.wait(lock, [&] { return impl_->done; });
  return impl_->result;
}

bool Supervisor::self_failed(int exit_code) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->primary >= 0 && !impl_->primary_is_self) return false;
    impl_->primary = impl_->opt.self_rank;
    impl_->primary_is_self = true;
    impl_->primary_code = exit_code;
  }
  char b = 1;
  (void)::write(impl_->wake_w, &b, 1);
  impl_->stop_children(-1, /*forward=*/false);
  write_all(2, impl_->failure_line(impl_->opt.self_rank,
                                   "exited with status " + std::to_string(exit_code)));
  return true;
}

bool Supervisor::child_failed(double grace_s) {
  auto t0 = Clock::now();
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      if (impl_->primary >= 0) return !impl_->primary_is_self;
      impl_->drain_notices_locked();
      impl_->reap_locked();
      if (impl_->silent_death_locked() || !impl_->notices.empty()) return true;
    }
    if (seconds_since(t0) >= grace_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void Supervisor::stop_all() {
  impl_->stop_children(-1, false);
}

void Supervisor::request_stop(int sig) {
  impl_->stop_signal.store(sig);
  char b = 1;
  (void)::write(impl_->wake_w, &b, 1);
}

int Supervisor::primary_rank() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->primary;
}

std::vector<ChildStatus> Supervisor::statuses() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<ChildStatus> out;
  for (const auto& c : impl_->children)
    out.push_back({c.rank, c.pid, c.exited, c.status, c.stopped});
  return out;
}

std::vector<pid_t> Supervisor::pids() const {
  std::vector<pid_t> out;
  for (const auto& c : impl_->children) out.push_back(c.pid);
  return out;
}

}  // namespace fsdp::detail
