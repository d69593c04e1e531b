// Environment side of the launcher: what torchrun, SLURM, mpirun or our own spawner told this
// process (launch_info_from_env), thread counts, free ports, paths.
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "comm/launcher_detail.h"

extern char** environ;

namespace fsdp::detail {

std::string get_env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

bool has_env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

namespace {

int env_int(const char* name, const char* launcher) {
  std::string text = get_env(name);
  TORCH_CHECK(!text.empty(), "[launch] ", launcher, " environment without ", name,
              "; set it or unset the other launcher variables");
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(end != text.c_str() && *end == '\0' && v >= 0 && v < (1L << 30), "[launch] ", name,
              "='", text, "' is not a non-negative integer (set by ", launcher, ")");
  return static_cast<int>(v);
}

int env_int_or(const char* name, int fallback, const char* launcher) {
  return has_env(name) ? env_int(name, launcher) : fallback;
}

// Leading integer of SLURM's "4(x2)" / "4" forms.
int leading_int(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  return i == 0 ? 0 : std::stoi(text.substr(0, i));
}

// A port every rank of a job agrees on without talking: derived from the job id.
int port_from_job_id(const std::string& job_id) {
  unsigned long h = 0;
  for (char c : job_id) h = h * 131 + static_cast<unsigned char>(c);
  return 15000 + static_cast<int>(h % 20000);
}

void validate(const LaunchInfo& info, const char* launcher) {
  TORCH_CHECK(info.world_size >= 1 && info.rank < info.world_size, "[launch] ", launcher,
              " says rank ", info.rank, " of world size ", info.world_size,
              "; the rank must be below the world size");
  TORCH_CHECK(info.local_world_size >= 1 && info.local_rank < info.local_world_size, "[launch] ",
              launcher, " says local rank ", info.local_rank, " of ", info.local_world_size,
              " local ranks; the local rank must be below the local world size");
  TORCH_CHECK(info.node_rank < info.num_nodes, "[launch] ", launcher, " says node ", info.node_rank,
              " of ", info.num_nodes, " nodes");
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // Cut at the first comma outside brackets.
  int depth = 0;
  size_t end = nodelist.size();
  for (size_t i = 0; i < nodelist.size(); ++i) {
    if (nodelist[i] == '[') ++depth;
    if (nodelist[i] == ']') --depth;
    if (nodelist[i] == ',' && depth == 0) {
      end = i;
      break;
    }
  }
  std::string first = nodelist.substr(0, end);
  size_t open = first.find('[');
  if (open == std::string::npos) return first;
  size_t close = first.find(']', open);
  if (close == std::string::npos || first.find('[', close) != std::string::npos) return "";
  std::string range = first.substr(open + 1, close - open - 1);
  size_t stop = range.find_first_of(",-");
  std::string lo = range.substr(0, stop);
  if (lo.empty()) return "";
  for (char c : lo)
    if (!std::isdigit(static_cast<unsigned char>(c))) return "";
  return first.substr(0, open) + lo + first.substr(close + 1);
}

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

int threads_per_rank(int local_ranks) {
  if (has_env(kEnvNumThreads)) {
    std::string text = get_env(kEnvNumThreads);
    char* end = nullptr;
    long v = std::strtol(text.c_str(), &end, 10);
    TORCH_CHECK(end != text.c_str() && *end == '\0' && v >= 1 && v <= 4096, "[launch] ",
                kEnvNumThreads, "='", text, "' is not a positive thread count");
    return static_cast<int>(v);
  }
  return std::max(1, available_cores() / std::max(1, local_ranks));
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
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    std::string key = kv.substr(0, kv.find('='));
    if (overrides.count(key)) continue;
    if (std::find(remove.begin(), remove.end(), key) != remove.end()) continue;
    env.push_back(kv);
  }
  for (const auto& [k, v] : overrides) env.push_back(k + "=" + v);
  return env;
}

std::string find_on_path(const std::string& program) {
  if (program.find('/') != std::string::npos)
    return ::access(program.c_str(), X_OK) == 0 ? program : "";
  std::stringstream path(get_env("PATH", "/usr/local/bin:/usr/bin:/bin"));
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

using detail::get_env;
using detail::has_env;

LaunchInfo launch_info_from_env() {
  LaunchInfo info;
  if (has_env("RANK") && has_env("WORLD_SIZE")) {
    // torchrun-style (also what our own spawner and fsdp-run set).
    const char* who = "torchrun-style";
    info.source = get_env(detail::kEnvLauncher) == "spawn"      ? "spawn"
                  : get_env(detail::kEnvLauncher) == "fsdp-run" ? "fsdp-run"
                                                                : "env";
    info.rank = detail::env_int("RANK", who);
    info.world_size = detail::env_int("WORLD_SIZE", who);
    bool has_local = has_env("LOCAL_RANK");
    info.local_rank = has_local ? detail::env_int("LOCAL_RANK", who) : info.rank;
    // Without LOCAL_WORLD_SIZE all ranks are taken to be on this node.
    info.local_world_size = detail::env_int_or("LOCAL_WORLD_SIZE", info.world_size, who);
    info.num_nodes =
        std::max(1, (info.world_size + info.local_world_size - 1) / info.local_world_size);
    int node_default = info.rank / info.local_world_size;
    info.node_rank =
        detail::env_int_or("GROUP_RANK", detail::env_int_or("NODE_RANK", node_default, who), who);
    info.master_addr = get_env("MASTER_ADDR", "127.0.0.1");
    info.master_port = detail::env_int_or("MASTER_PORT", 0, who);
    detail::validate(info, who);
    return info;
  }
  if (has_env("OMPI_COMM_WORLD_RANK") && has_env("OMPI_COMM_WORLD_SIZE")) {
    const char* who = "mpirun (OpenMPI)";
    info.source = "mpirun";
    info.rank = detail::env_int("OMPI_COMM_WORLD_RANK", who);
    info.world_size = detail::env_int("OMPI_COMM_WORLD_SIZE", who);
    info.local_rank = detail::env_int_or("OMPI_COMM_WORLD_LOCAL_RANK", info.rank, who);
    info.local_world_size = detail::env_int_or("OMPI_COMM_WORLD_LOCAL_SIZE", info.world_size, who);
    // OpenMPI has no node index variable; with the default by-slot mapping ranks are laid
    // out node after node.
    info.num_nodes =
        std::max(1, (info.world_size + info.local_world_size - 1) / info.local_world_size);
    info.node_rank = info.rank / info.local_world_size;
    info.master_addr = get_env("MASTER_ADDR", "127.0.0.1");
    info.master_port = has_env("MASTER_PORT")
                           ? detail::env_int("MASTER_PORT", who)
                           : detail::port_from_job_id(get_env("OMPI_MCA_ess_base_jobid",
                                                              get_env("PMIX_NAMESPACE", "0")));
    detail::validate(info, who);
    return info;
  }
  if (has_env("SLURM_PROCID") && has_env("SLURM_NTASKS")) {
    const char* who = "SLURM (srun)";
    info.source = "slurm";
    info.rank = detail::env_int("SLURM_PROCID", who);
    info.world_size = detail::env_int("SLURM_NTASKS", who);
    info.local_rank = detail::env_int_or("SLURM_LOCALID", 0, who);
    info.num_nodes =
        detail::env_int_or("SLURM_NNODES", detail::env_int_or("SLURM_JOB_NUM_NODES", 1, who), who);
    int per_node = detail::leading_int(get_env("SLURM_NTASKS_PER_NODE"));
    if (per_node <= 0) per_node = detail::leading_int(get_env("SLURM_TASKS_PER_NODE"));
    if (per_node <= 0) per_node = std::max(1, info.world_size / std::max(1, info.num_nodes));
    info.local_world_size = per_node;
    info.node_rank = detail::env_int_or("SLURM_NODEID", info.rank / per_node, who);
    if (has_env("MASTER_ADDR")) {
      info.master_addr = get_env("MASTER_ADDR");
    } else {
      std::string nodelist = get_env("SLURM_JOB_NODELIST", get_env("SLURM_NODELIST"));
      std::string host = nodelist.empty() ? "127.0.0.1" : detail::first_slurm_host(nodelist);
      TORCH_CHECK(!host.empty(), "[launch] cannot take the master host from SLURM_JOB_NODELIST='",
                  nodelist, "'; export MASTER_ADDR=<first node's hostname> before srun");
      info.master_addr = host;
    }
    info.master_port = has_env("MASTER_PORT")
                           ? detail::env_int("MASTER_PORT", who)
                           : detail::port_from_job_id(get_env("SLURM_JOB_ID", "0"));
    detail::validate(info, who);
    return info;
  }
  info.master_addr = get_env("MASTER_ADDR", "127.0.0.1");
  return info;
}

}  // namespace fsdp
