// Environment side of the launcher: what torchrun, SLURM, mpirun or our own spawner told this
// process (launch_info_from_env, parsed with the other settings in src/common/settings.cpp),
// thread counts (measured here, chosen in comm/thread_choice.cpp), free ports, paths.
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "comm/launcher_detail.h"
#include "comm/thread_choice.h"

namespace fsdp::detail {

namespace {

// The CPUs this process may run on (sched_getaffinity); empty when unknown.
std::vector<int> affinity_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

std::string read_proc_stat() {
  std::ifstream in("/proc/stat");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// How many of this process's cores other work keeps busy: /proc/stat read twice, a short sleep
// apart (the load average lags by a minute; this sees the load of the moment). See
// Note [Threads per rank] in comm/thread_choice.cpp.
std::optional<double> measure_busy_cores() {
  constexpr auto kWindow = std::chrono::milliseconds(150);
  const std::vector<int> cpus = affinity_cpus();
  const auto before = parse_proc_stat(read_proc_stat());
  std::this_thread::sleep_for(kWindow);
  return busy_cores_between(before, parse_proc_stat(read_proc_stat()), cpus);
}

}  // namespace

int available_cores() {
  const size_t n = affinity_cpus().size();
  if (n > 0) return static_cast<int>(n);
  unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

int launch_threads(int local_ranks, bool announce) {
  ThreadFacts facts;
  facts.cores = available_cores();
  facts.local_ranks = std::max(1, local_ranks);
  facts.user_threads = read_settings().num_threads;  // FSDP_NUM_THREADS
  if (!facts.user_threads) facts.busy_cores = measure_busy_cores();
  const ThreadChoice choice = choose_threads(facts);
  if (announce) {
    const std::string line = describe(facts, choice);
    if (!line.empty()) std::cerr << line << std::endl;
  }
  return choice.threads;
}

int threads_per_rank(int local_ranks, bool announce) {
  const Settings settings = read_settings();
  // Started by one of fsdp.cpp's launchers: it chose (FSDP_NUM_THREADS first) and said so.
  if (settings.launch_threads && settings.launch.source != "none") {
    return settings.num_threads.value_or(*settings.launch_threads);
  }
  return launch_threads(local_ranks, announce);
}

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0,
              "[launch] cannot create a socket to find a free port: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
            ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  int err = errno;
  ::close(fd);
  TORCH_CHECK(ok, "[launch] cannot find a free TCP port on 127.0.0.1: ", std::strerror(err),
              "; set MASTER_PORT");
  return ntohs(addr.sin_port);
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  TORCH_CHECK(n > 0, "[launch] cannot read /proc/self/exe: ", std::strerror(errno));
  return std::string(buf, static_cast<size_t>(n));
}

std::vector<std::string> self_argv() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> argv;
  size_t start = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == '\0') {
      argv.push_back(all.substr(start, i - start));
      start = i + 1;
    }
  }
  if (start < all.size()) argv.push_back(all.substr(start));
  TORCH_CHECK(!argv.empty(),
              "[launch] cannot read this program's arguments from /proc/self/cmdline");
  return argv;
}

std::vector<std::string> make_env(const std::map<std::string, std::string>& overrides,
                                  const std::vector<std::string>& remove) {
  std::vector<std::string> env;
  for (const auto& [key, value] : process_environment()) {
    if (overrides.count(key)) continue;
    if (std::find(remove.begin(), remove.end(), key) != remove.end()) continue;
    env.push_back(key + "=" + value);
  }
  for (const auto& [k, v] : overrides) env.push_back(k + "=" + v);
  return env;
}

std::string find_on_path(const std::string& program) {
  if (program.find('/') != std::string::npos)
    return ::access(program.c_str(), X_OK) == 0 ? program : "";
  std::stringstream path(read_settings().path);
  std::string dir;
  while (std::getline(path, dir, ':')) {
    if (dir.empty()) dir = ".";
    std::string candidate = dir + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// Note [MPI launch]
// ~~~~~~~~~~~~~~~~~
// With the "mpi" backend the launcher does not spawn ranks itself: OpenMPI processes started
// outside mpirun are "singletons", each its own MPI_COMM_WORLD of size 1, and they cannot be
// joined into one world afterwards (MPI_Comm_connect/accept needs an ompi-server and is not
// what users run). So the program re-executes itself through `mpirun -n N`, which is also the
// fastest correct path on one host: mpirun's ranks talk through OpenMPI's shared-memory
// transport (vader), several times Gloo's loopback TCP
// (docs/benchmarks/collectives_cpu-2core_2026-11-22.md). Flags:
//  --oversubscribe      allow more ranks than cores (tests run 4 ranks on 2 cores);
//  --bind-to none       our ranks size their own thread pools; OpenMPI's default core binding
//                       would pin a rank's intra-op threads to one core;
//  --allow-run-as-root  only when running as root (containers); OpenMPI refuses root otherwise.
// When ranks outnumber cores, OMPI_MCA_mpi_yield_when_idle=1 makes waiting ranks yield the CPU
// instead of spinning on it (a spinning rank steals the core its peer needs to progress).
std::vector<std::string> mpirun_prefix(int nprocs) {
  std::string mpirun = find_on_path("mpirun");
  TORCH_CHECK(!mpirun.empty(), "[launch] backend 'mpi' needs `mpirun` (OpenMPI) on PATH and ",
              "it was not found; install openmpi-bin (`make setup` does) or use backend 'gloo'");
  std::vector<std::string> argv = {mpirun, "-n", std::to_string(nprocs)};
  if (::geteuid() == 0) argv.push_back("--allow-run-as-root");
  argv.push_back("--oversubscribe");
  argv.push_back("--bind-to");
  argv.push_back("none");
  return argv;
}

}  // namespace fsdp::detail

namespace fsdp {

LaunchInfo launch_info_from_env() { return detail::read_settings().launch; }

}  // namespace fsdp
