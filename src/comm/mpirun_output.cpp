// Runs mpirun for fsdp::launch's MPI path with its stderr filtered: the ranks' own lines reach
// the user, mpirun's banners and OpenMPI's transport chatter go to a log file. See Note [MPI
// launch output].
#include "comm/mpirun_output.h"

#include "comm/launcher_detail.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <regex>

namespace fsdp::detail {

// Note [MPI launch output]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// mpirun merges its ranks' stderr into its own and adds, when a rank fails, 8-10 lines of its
// own ("------" framed help texts, "Primary job terminated normally, ...", "mpirun noticed that
// process rank 1 ... exited on signal 9"), and OpenMPI's TCP transport prints raw lines
// ("[host:pid] ... Read -1, expected 12, errno = 104") on ranks whose peer vanished. The user
// needs one line: the failing rank's "[rank R] error: ...". So fsdp::launch does not exec mpirun;
// it forks it with stderr on a pipe and stays as a thin parent that sorts each line:
//  - OpenMPI's lines (a dashed block and everything in it, "[host:pid]" prefixes, "Read -1,
//    expected", lines starting with mpirun/prterun) go to a log file;
//  - the first "[rank R] error:" line goes to stderr; later "[rank M] error:" lines of other
//    ranks are consequences (their peer died) and go to the log, as fsdp-run's supervisor drops
//    them (Note [Failure notice]);
//  - every other line (the program's own stderr) goes to stderr unchanged.
// When anything went to the log, one last line names it. The log is created only then, under
// $TMPDIR (or /tmp), fsdp-mpirun-XXXXXX.log. The parent forwards SIGTERM, SIGHUP and SIGINT to
// mpirun (which ends its ranks) and exits with mpirun's status.

namespace {

std::atomic<pid_t> g_mpirun{-1};

void forward_signal(int sig) {
  const pid_t pid = g_mpirun.load();
  if (pid > 0) ::kill(pid, sig);
}

class LineSorter {
 public:
  void line(const std::string& text) {  // without its '\n'
    if (is_dashes(text)) {
      in_block_ = !in_block_;
      to_log(text);
      return;
    }
    if (in_block_ || is_openmpi(text)) {
      to_log(text);
      return;
    }
    static const std::regex rank_error(R"(^\[rank (\d+)\] error: )");
    std::smatch m;
    if (std::regex_search(text, m, rank_error)) {
      const int rank = std::stoi(m[1]);
      if (first_error_rank_ < 0) first_error_rank_ = rank;
      if (rank != first_error_rank_) {
        ++later_errors_;
        to_log(text);
        return;
      }
    }
    write_all(2, text + "\n");
  }

  // The closing line naming the log, when anything went there.
  void finish() {
    if (log_fd_ < 0) return;
    ::close(log_fd_);
    std::string what = "mpirun's own messages";
    if (later_errors_ > 0) {
      what += " and " + std::to_string(later_errors_) + " later error line(s) of other ranks";
    }
    write_all(2, "fsdp: " + what + " (" + std::to_string(logged_) + " lines) are in " + path_ +
                     "\n");
  }

 private:
  static bool is_dashes(const std::string& t) {
    return t.size() >= 20 && t.find_first_not_of('-') == std::string::npos;
  }
  static bool is_openmpi(const std::string& t) {
    static const std::regex host_pid(R"(^\[[^\]\s]+:\d+\])");
    return t.find("Read -1, expected") != std::string::npos || std::regex_search(t, host_pid) ||
           t.rfind("mpirun", 0) == 0 || t.rfind("prterun", 0) == 0;
  }
  void to_log(const std::string& text) {
    if (log_fd_ < 0) open_log();
    if (log_fd_ >= 0) write_all(log_fd_, text + "\n");
    ++logged_;
  }
  void open_log() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/fsdp-mpirun-XXXXXX.log";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    log_fd_ = ::mkstemps(buf.data(), 4);
    if (log_fd_ < 0) {
      // Nowhere to put it: better shown than lost.
      path_ = "(no log: " + std::string(std::strerror(errno)) + ")";
      return;
    }
    ::fcntl(log_fd_, F_SETFD, FD_CLOEXEC);
    path_ = buf.data();
  }

  bool in_block_ = false;
  int first_error_rank_ = -1;
  int64_t later_errors_ = 0;
  int64_t logged_ = 0;
  int log_fd_ = -1;
  std::string path_;
};

}  // namespace

[[noreturn]] void run_mpirun_filtered(const std::vector<std::string>& argv) {
  int p[2];
  TORCH_CHECK(::pipe2(p, O_CLOEXEC) == 0, "[launch] pipe2: ", std::strerror(errno));
  std::vector<char*> cargv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  const std::string exec_error =
      "[launch] cannot execute " + argv[0] + "; install openmpi-bin or use backend 'gloo'\n";
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "[launch] fork failed: ", std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // this parent gone: mpirun ends its ranks
    if (::getppid() != parent) ::_exit(1);
    ::dup2(p[1], 2);
    ::execv(cargv[0], cargv.data());
    write_all(p[1], exec_error);
    ::_exit(127);
  }
  ::close(p[1]);
  g_mpirun.store(pid);
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);

  LineSorter sorter;
  std::string buf;
  char chunk[65536];
  int status = 0;
  bool reaped = false;
  std::chrono::steady_clock::time_point reaped_at;
  for (;;) {
    pollfd pfd{p[0], POLLIN, 0};
    if (::poll(&pfd, 1, 100) > 0) {
      ssize_t n = ::read(p[0], chunk, sizeof(chunk));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // mpirun and everything it started closed stderr
      buf.append(chunk, static_cast<size_t>(n));
      size_t nl;
      while ((nl = buf.find('\n')) != std::string::npos) {
        sorter.line(buf.substr(0, nl));
        buf.erase(0, nl + 1);
      }
    }
    if (!reaped && ::waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
      reaped_at = std::chrono::steady_clock::now();
    }
    // Something mpirun started may still hold the pipe: read 2 s more at most.
    if (reaped && std::chrono::steady_clock::now() - reaped_at > std::chrono::seconds(2)) break;
  }
  if (!buf.empty()) sorter.line(buf);
  ::close(p[0]);
  while (!reaped && ::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  sorter.finish();
  std::fflush(stdout);
  if (WIFEXITED(status)) ::_exit(WEXITSTATUS(status));
  ::_exit(WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1);
}

}  // namespace fsdp::detail
