// Implementation of tests/testing.h: multi-rank tests as real processes on loopback.
//
// Note [run_ranks]
// ~~~~~~~~~~~~~~~~
// The parent (the gtest process ctest started) is rank 0. It re-executes this test binary once
// per extra rank with --gtest_filter=<this test> and the launcher environment (RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a fresh free MASTER_PORT)
// plus FSDP_TEST_CHILD=1, FSDP_TEST_CALL=<index of this run_ranks call within the test> and
// FSDP_TEST_RESULT_DIR. A child runs the test from its start; the run_ranks call with the
// matching index runs `body`, writes rank<R>.txt (failures and exception) into the result
// dir and ends the process right there (0 = passed) — code after run_ranks runs only in the
// parent. The parent watches the children with the launcher's Supervisor: when a child fails,
// the other children are stopped at once, so rank 0's pending collectives fail fast instead
// of at the collective timeout (and if rank 0 stays blocked anyway, a watchdog ends the test
// binary after 60 s). The parent then fails the test naming each failed rank with its
// failure text. For backend "mpi" every rank is a child under `mpirun` (OpenMPI singletons
// cannot form one world, see Note [MPI launch]) and the parent only waits for mpirun.
// Children's stdout/stderr are not filtered here: in a test every rank's failure matters.
#include "testing.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/launcher_detail.h"
#include "comm/mpi_transport.h"
#include "fsdp/launcher.h"

namespace fsdp::testing {

namespace {

namespace fs = std::filesystem;
using detail::get_env;
using Clock = std::chrono::steady_clock;

constexpr const char* kEnvChild = "FSDP_TEST_CHILD";
constexpr const char* kEnvCall = "FSDP_TEST_CALL";
constexpr const char* kEnvResultDir = "FSDP_TEST_RESULT_DIR";
constexpr const char* kEnvTimeout = "FSDP_COLLECTIVE_TIMEOUT_S";
constexpr const char* kDefaultTestTimeoutS = "300";  // collectives in tests: fail in 5 min

std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  TORCH_CHECK(info != nullptr, "[run_ranks] must be called from inside a TEST body");
  return std::string(info->test_suite_name()) + "." + info->name();
}

// Index of this run_ranks call within the current test (0, 1, ...).
int next_call_index() {
  static std::string test;
  static int count = 0;
  std::string name = current_test_name();
  if (name != test) {
    test = name;
    count = 0;
  }
  return count++;
}

// The failed assertions of the current test so far, "file:line: message" each.
std::string failure_summary() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (!info) return "";
  const ::testing::TestResult* result = info->result();
  std::ostringstream out;
  for (int i = 0; i < result->total_part_count(); ++i) {
    const auto& part = result->GetTestPartResult(i);
    if (!part.failed()) continue;
    out << (part.file_name() ? part.file_name() : "?") << ":" << part.line_number() << ": "
        << part.message() << "\n";
  }
  return out.str();
}

std::string exception_text(std::exception_ptr ep) {
  try {
    std::rethrow_exception(ep);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) return "";
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Environment changes for rank 0 (the parent), undone at scope exit.
class ScopedEnv {
 public:
  void set(const std::string& key, const std::string& value) {
    if (!saved_.count(key)) {
      const char* old = std::getenv(key.c_str());
      saved_[key] = old ? std::optional<std::string>(old) : std::nullopt;
    }
    ::setenv(key.c_str(), value.c_str(), 1);
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved_) {
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
    }
  }

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

std::vector<std::string> child_argv(const std::string& test) {
  return {detail::self_exe(), "--gtest_filter=" + test, "--gtest_also_run_disabled_tests",
          "--gtest_brief=1"};
}

// Variables a child must not inherit: they would select other tests or write gtest's XML.
const std::vector<std::string> kDropFromChildEnv = {
    "GTEST_FILTER", "GTEST_SHARD_INDEX", "GTEST_TOTAL_SHARDS", "GTEST_OUTPUT", "GTEST_REPEAT",
    "RANK",         "LOCAL_RANK",        detail::kEnvNotifyFd};

std::string make_result_dir() {
  std::string tmpl = (fs::temp_directory_path() / "fsdp-ranks-XXXXXX").string();
  TORCH_CHECK(::mkdtemp(tmpl.data()) != nullptr,
              "[run_ranks] mkdtemp failed: ", std::strerror(errno));
  return tmpl;
}

std::string rank_result(const std::string& dir, int rank) {
  std::string text = read_file(dir + "/rank" + std::to_string(rank) + ".txt");
  if (text.rfind("ok", 0) == 0) return "ok";
  return text;
}

// fork/exec `argv` with exactly `envs`; captures stdout/stderr when `capture` (else they are
// inherited); kills the process group after timeout_s.
ProcResult run_with_env(const std::vector<std::string>& argv, const std::vector<std::string>& envs,
                        double timeout_s, bool capture) {
  TORCH_CHECK(!argv.empty(), "[run_process] empty command");
  ProcResult result;
  std::string program = detail::find_on_path(argv[0]);
  TORCH_CHECK(!program.empty(), "[run_process] cannot run '", argv[0],
              "': not an executable and not on PATH");
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  int outp[2] = {-1, -1}, errp[2] = {-1, -1};
  if (capture)
    TORCH_CHECK(::pipe2(outp, O_CLOEXEC) == 0 && ::pipe2(errp, O_CLOEXEC) == 0,
                "[run_process] pipe2: ", std::strerror(errno));
  std::fflush(stdout);
  std::fflush(stderr);
  auto t0 = Clock::now();
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "[run_process] fork: ", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);
    if (capture) {
      ::dup2(outp[1], 1);
      ::dup2(errp[1], 2);
    }
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(program.c_str(), cargv.data(), cenv.data());
    const char msg[] = "run_process: exec failed\n";
    (void)!::write(2, msg, sizeof(msg) - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  int fds[2] = {outp[0], errp[0]};
  if (capture) {
    ::close(outp[1]);
    ::close(errp[1]);
  }
  std::string* sinks[2] = {&result.out, &result.err};
  bool killed = false, reaped = false;
  int status = 0;
  std::optional<Clock::time_point> reaped_at;
  for (;;) {
    std::vector<pollfd> pfds;
    std::vector<int> which;
    for (int i = 0; i < 2; ++i)
      if (fds[i] >= 0) {
        pfds.push_back({fds[i], POLLIN, 0});
        which.push_back(i);
      }
    if (pfds.empty() && reaped) break;
    if (!pfds.empty() && ::poll(pfds.data(), pfds.size(), 50) > 0) {
      for (size_t k = 0; k < pfds.size(); ++k) {
        if (!(pfds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[65536];
        ssize_t n = ::read(pfds[k].fd, buf, sizeof(buf));
        if (n > 0) {
          sinks[which[k]]->append(buf, static_cast<size_t>(n));
        } else if (n == 0 || errno != EINTR) {
          ::close(fds[which[k]]);
          fds[which[k]] = -1;
        }
      }
    } else if (pfds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!reaped && ::waitpid(pid, &status, WNOHANG) == pid) {
      reaped = true;
      reaped_at = Clock::now();
    }
    double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!killed && !reaped && elapsed > timeout_s) {
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      killed = true;
    }
    // Something the process started may still hold the pipes: stop reading 2 s after it ended.
    if (reaped && Clock::now() - *reaped_at > std::chrono::seconds(2)) break;
  }
  for (int fd : fds)
    if (fd >= 0) ::close(fd);
  result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  result.exit_code = detail::exit_code_of(status);
  if (killed) result.err += "\n[run_process] killed after " + std::to_string(timeout_s) + " s\n";
  return result;
}

// --- child side ----------------------------------------------------------------------
void run_child(int world_size, const std::string& backend,
               const std::function<void(ProcessGroup&)>& body, int call) {
  if (get_env(kEnvCall) != std::to_string(call)) return;  // another call of this test
  LaunchInfo info = launch_info_from_env();
  int rank = info.rank;
  TORCH_CHECK(info.world_size == world_size, "[run_ranks] child started for world size ",
              info.world_size, " reached run_ranks(", world_size, ")");
  at::set_num_threads(detail::threads_per_rank(info.local_world_size));
  std::string error;
  {
    SCOPED_TRACE("rank " + std::to_string(rank));
    try {
      ProcessGroupOptions options;
      options.backend = backend;
      ProcessGroupPtr group = init_process_group(options);
      body(*group);
    } catch (...) {
      error = exception_text(std::current_exception());
    }
  }
  bool failed = ::testing::Test::HasFailure() || !error.empty();
  std::string summary = failure_summary();
  if (!error.empty()) summary += "exception: " + error + "\n";
  std::fflush(stdout);
  if (failed)
    std::fprintf(stderr, "[rank %d] failed in %s:\n%s", rank, current_test_name().c_str(),
                 summary.c_str());
  std::string dir = get_env(kEnvResultDir);
  if (!dir.empty()) {
    std::ofstream out(dir + "/rank" + std::to_string(rank) + ".txt");
    out << (failed ? "failed\n" + summary : std::string("ok\n"));
  }
  std::fflush(stderr);
  if (!failed && backend == "mpi") {
    // mpirun counts a rank that exits without MPI_Finalize as failed: shut down cleanly.
    // (No barrier here: tests of failing collectives leave the group unusable on purpose.)
    try {
      destroy_process_group();
    } catch (...) {
    }
    std::exit(0);
  }
  // A failed MPI rank aborts the job: exiting non-zero without MPI_Finalize sometimes left
  // mpirun hung after it had reaped every rank (1 run in 6 of RunRanks.FailureNamesTheRank).
  if (failed && backend == "mpi") detail::abort_mpi_job(1);
  ::_exit(failed ? 1 : 0);
}

// --- parent side ---------------------------------------------------------------------
void run_mpi_parent(int world_size, const std::function<void(ProcessGroup&)>& body, int call,
                    const std::string& test) {
  std::string dir = make_result_dir();
  std::vector<std::string> argv = detail::mpirun_prefix(world_size);
  for (const auto& a : child_argv(test)) argv.push_back(a);
  int threads = detail::launch_threads(world_size, /*announce=*/false);
  std::map<std::string, std::string> env = {
      {kEnvChild, "1"},
      {kEnvCall, std::to_string(call)},
      {kEnvResultDir, dir},
      {"OMP_NUM_THREADS", std::to_string(threads)},
      {detail::kEnvLaunchThreads, std::to_string(threads)},
      {kEnvTimeout, get_env(kEnvTimeout, kDefaultTestTimeoutS)},
  };
  if (world_size > detail::available_cores()) env["OMPI_MCA_mpi_yield_when_idle"] = "1";
  ProcResult r = run_with_env(argv, detail::make_env(env, kDropFromChildEnv), 600,
                              /*capture=*/false);
  std::vector<int> failed;
  std::ostringstream why;
  for (int rank = 0; rank < world_size; ++rank) {
    std::string res = rank_result(dir, rank);
    if (res == "ok") continue;
    failed.push_back(rank);
    why << "rank " << rank << ": "
        << (res.empty() ? "did not finish (killed or crashed; see mpirun's output above)\n" : res);
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (r.exit_code != 0 || !failed.empty()) {
    ADD_FAILURE() << "run_ranks(" << world_size << ", \"mpi\"): mpirun exited with code "
                  << r.exit_code << "; " << failed.size() << " rank(s) failed\n"
                  << why.str();
  }
  (void)body;  // runs in the mpirun ranks
}

void run_spawn_parent(int world_size, const std::string& backend,
                      const std::function<void(ProcessGroup&)>& body, int call,
                      const std::string& test) {
  std::string dir = make_result_dir();
  int port = detail::free_port();
  int threads = detail::launch_threads(world_size, /*announce=*/false);
  std::string timeout = get_env(kEnvTimeout, kDefaultTestTimeoutS);
  std::map<std::string, std::string> common = {
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(world_size)},
      {"GROUP_RANK", "0"},
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)},
      {detail::kEnvLauncher, "test"},
      {kEnvTimeout, timeout},
  };
  detail::SupervisorOptions sopt;
  sopt.world_size = world_size;
  sopt.self_rank = 0;
  sopt.forward_stderr = false;
  sopt.kill_grace_s = 2.0;
  sopt.stop_delay_s = 3.0;
  sopt.who = "run_ranks";
  detail::Supervisor sup(sopt);
  for (int r = 1; r < world_size; ++r) {
    auto env = common;
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    env[kEnvChild] = "1";
    env[kEnvCall] = std::to_string(call);
    env[kEnvResultDir] = dir;
    env["OMP_NUM_THREADS"] = std::to_string(threads);
    env[detail::kEnvLaunchThreads] = std::to_string(threads);
    sup.spawn({r, child_argv(test), detail::make_env(env, kDropFromChildEnv)});
  }
  sup.start(/*exit_process_on_failure=*/false);

  // Watchdog: a child failed, the others were stopped, and rank 0 is still blocked.
  std::atomic<bool> body_done{false};
  std::thread watchdog([&] {
    std::optional<Clock::time_point> since;
    while (!body_done.load()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      int p = sup.primary_rank();
      if (p > 0 && !since) since = Clock::now();
      if (since && Clock::now() - *since > std::chrono::seconds(60) && !body_done.load()) {
        std::fprintf(stderr,
                     "run_ranks: rank %d failed in %s and rank 0 is still blocked 60 s later; "
                     "ending the test program\n",
                     p, test.c_str());
        std::fflush(stderr);
        ::_exit(1);
      }
    }
  });

  std::string error;
  bool rank0_failed;
  int threads_before = at::get_num_threads();
  {
    ScopedEnv scoped;
    for (const auto& [k, v] : common) scoped.set(k, v);
    scoped.set("RANK", "0");
    scoped.set("LOCAL_RANK", "0");
    at::set_num_threads(threads);
    bool had_failure = ::testing::Test::HasFailure();
    {
      SCOPED_TRACE("rank 0");
      try {
        ProcessGroupOptions options;
        options.backend = backend;
        ProcessGroupPtr group = init_process_group(options);
        body(*group);
      } catch (...) {
        error = exception_text(std::current_exception());
      }
    }
    rank0_failed = !error.empty() || (!had_failure && ::testing::Test::HasFailure());
    if (rank0_failed) sup.stop_all();  // children would wait for rank 0 forever
    sup.wait();
    try {
      destroy_process_group();
    } catch (...) {
    }
    at::set_num_threads(threads_before);
  }
  body_done.store(true);
  watchdog.join();

  int primary = sup.primary_rank();
  std::ostringstream why;
  std::vector<int> failed;
  if (!error.empty()) {
    failed.push_back(0);
    why << "rank 0 threw"
        << (primary > 0 ? " (after rank " + std::to_string(primary) + " failed)" : "") << ": "
        << error << "\n";
  }
  for (const auto& st : sup.statuses()) {
    // Ranks we stopped after another rank's failure are collateral, not failures.
    if (!st.exited || !detail::failed(st.wait_status) || st.stopped) continue;
    failed.push_back(st.rank);
    std::string res = rank_result(dir, st.rank);
    why << "rank " << st.rank << " " << detail::describe_wait_status(st.wait_status)
        << (res.empty() || res == "ok" ? "\n" : ":\n" + res);
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (!failed.empty() || rank0_failed) {
    std::ostringstream ranks;
    for (size_t i = 0; i < failed.size(); ++i) ranks << (i ? ", " : "") << failed[i];
    ADD_FAILURE() << "run_ranks(" << world_size << ", \"" << backend << "\"): rank(s) "
                  << (failed.empty() ? std::string("0") : ranks.str()) << " failed\n"
                  << why.str();
  }
}

}  // namespace

bool in_child_rank() {
  return get_env(kEnvChild) == "1";
}

void run_ranks(int world_size, const std::string& backend,
               const std::function<void(ProcessGroup& world)>& body) {
  TORCH_CHECK(world_size >= 1 && world_size <= 64, "[run_ranks] world size ", world_size,
              " is not in [1, 64]");
  TORCH_CHECK(backend == "gloo" || backend == "mpi" || backend == "auto",
              "[run_ranks] unknown backend '", backend, "'; valid: gloo, mpi, auto");
  int call = next_call_index();
  if (in_child_rank()) {
    run_child(world_size, backend, body, call);
    return;
  }
  std::string test = current_test_name();
  if (backend == "mpi") {
    run_mpi_parent(world_size, body, call, test);
  } else {
    run_spawn_parent(world_size, backend, body, call, test);
  }
}

ProcResult run_process(const std::vector<std::string>& argv,
                       const std::map<std::string, std::string>& env, double timeout_s) {
  return run_with_env(argv, detail::make_env(env), timeout_s, /*capture=*/true);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

ScopedSetenv::ScopedSetenv(const std::string& name, const std::string& value) : name_(name) {
  if (const char* old = std::getenv(name.c_str())) old_ = old;
  ::setenv(name.c_str(), value.c_str(), 1);
}

ScopedSetenv::~ScopedSetenv() {
  if (old_) {
    ::setenv(name_.c_str(), old_->c_str(), 1);
  } else {
    ::unsetenv(name_.c_str());
  }
}

std::optional<std::string> command_line_flag(const std::string& name) {
  const std::string prefix = "--" + name + "=";
  for (const auto& arg : detail::self_argv()) {
    if (arg.rfind(prefix, 0) == 0) return arg.substr(prefix.size());
  }
  return std::nullopt;
}

std::string bin_path(const std::string& program) {
  // The FSDP_BIN_DIR environment variable overrides the build's bin directory.
  std::string dir = get_env("FSDP_BIN_DIR", FSDP_BIN_DIR);
  return dir + "/" + program;
}

nlohmann::json fsdp_train_summary(const std::vector<std::string>& extra, const std::string& tag) {
  const fs::path dir = fs::temp_directory_path() /
                       ("fsdp_test_cli_" + std::to_string(::getpid()) + "_" + tag);
  fs::create_directories(dir);
  std::vector<std::string> argv = {bin_path("fsdp-train"), "--model", "transformer-tiny",
                                   "--data", "synthetic", "--dropout", "0", "--seed", "7",
                                   "--max-steps", "10", "--no-progress-bar", "--default-root-dir",
                                   (dir / "logs").string(), "--summary-json",
                                   (dir / "summary.json").string()};
  argv.insert(argv.end(), extra.begin(), extra.end());
  const ProcResult r = run_process(argv, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  std::ifstream f(dir / "summary.json");
  EXPECT_TRUE(f.good()) << "no --summary-json written\n" << r.out << r.err;
  nlohmann::json j = f.good() ? nlohmann::json::parse(f) : nlohmann::json::object();
  fs::remove_all(dir);
  return j;
}

std::string wikitext2_dir() {
  fs::path dir = fs::path(FSDP_SOURCE_DIR) / ".." / "shared" / "data" / "wikitext-2";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return "";
  return fs::weakly_canonical(dir, ec).string();
}

}  // namespace fsdp::testing
