// Settings: the environment, read and checked in one place. See src/common/settings.h.
#include "common/settings.h"

#include "fsdp/memory.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <string_view>

extern char** environ;

namespace fsdp::detail {

// Note [Settings]
// ~~~~~~~~~~~~~~~
// The environment is read here and nowhere else in the library: process_environment() copies
// it, parse_settings() turns it into one Settings value and checks every variable it knows (a
// bad value is an error naming the variable, its value and what is valid, whichever setting the
// caller wanted), and docs/environment.md documents each of them in one table, in the order of
// variables() below (a test holds the two together). The launcher's variables (torchrun-style,
// mpirun's, SLURM's) become Settings::launch here, so "which rank am I" has one answer.
//
// Nothing is cached: the Trainer reads the settings once, when it is constructed, and hands
// what it read to the parts it builds; library entry points that run without a Trainer
// (fsdp::launch, init_process_group, install_tracking_allocator, a strategy driven by hand)
// read them when they are called. The environment can change inside one process -- fsdp::launch
// sets RANK=0 in the rank it keeps, a program sets FSDP_JOB_ID before it builds a strategy --
// and each reader sees it as it is at that moment.
//
// Switches that only tests and benchmarks need (failure injection, collectives that move no
// data) are not settings: no variable a user can leave set reaches them. See Note [Injected
// hooks] in src/common/injected_hooks.h.

namespace {

// Every variable parse_settings reads, in the order of docs/environment.md's table (a function's
// static: the allocator may read settings during another file's static initialization).
const std::vector<std::string>& variables() {
  static const std::vector<std::string> names = {
    // The launcher's.
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
    "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_JOB_NODELIST",
    "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_STEP_ID",
    "FSDP_JOB_ID", "FSDP_LAUNCHER", "FSDP_LAUNCH_NOTIFY_FD", "FSDP_NUM_THREADS",
    "FSDP_LAUNCH_THREADS", "PATH",
    // The user's.
    "FSDP_BACKEND", "FSDP_MEMORY_BUDGET", "FSDP_ALLOC_CACHE", "FSDP_STDOUT_IS_TERMINAL",
    "FSDP_COLLECTIVE_TIMEOUT_S", "FSDP_RENDEZVOUS_TIMEOUT_S", "FSDP_DEBUG", "FSDP_DEFERRED_INIT",
    "PL_DEEPSPEED_CONFIG_PATH", "GLOO_SOCKET_IFNAME", "TORCH_CPP_LOG_LEVEL",
    "TORCH_SHOW_CPP_STACKTRACES"};
  return names;
}

[[noreturn]] void bad_value(std::string_view name, const std::string& value,
                            std::string_view what, std::string_view valid,
                            std::string_view set_by = {}) {
  TORCH_CHECK(false, "[settings] ", name, "='", value, "'",
              set_by.empty() ? std::string() : " (set by " + std::string(set_by) + ")",
              " is not ", what, "; valid: ", valid, " (docs/environment.md)");
}

// Reads the known variables of one environment; empty values count as unset.
class Reader {
 public:
  explicit Reader(const Environment& env) : env_(env) {}

  std::optional<std::string> get(const char* name) const {
    const auto& known = variables();
    TORCH_INTERNAL_ASSERT(std::find(known.begin(), known.end(), name) != known.end(), name,
                          " is read but not listed in variables() (docs/environment.md)");
    auto it = env_.find(name);
    if (it == env_.end() || it->second.empty()) return std::nullopt;
    return it->second;
  }
  std::string get_or(const char* name, const std::string& fallback) const {
    return get(name).value_or(fallback);
  }
  bool has(const char* name) const { return get(name).has_value(); }

  // A whole number in [lo, hi].
  std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi, std::string_view what,
                                 std::string_view set_by = {}) const {
    auto text = get(name);
    if (!text) return std::nullopt;
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text->c_str(), &end, 10);
    if (end == text->c_str() || *end != '\0' || errno != 0 || v < lo || v > hi) {
      bad_value(name, *text, what,
                "a whole number from " + std::to_string(lo) + " to " + std::to_string(hi),
                set_by);
    }
    return v;
  }
  // A number of seconds > 0.
  std::optional<double> seconds(const char* name, std::string_view example) const {
    auto text = get(name);
    if (!text) return std::nullopt;
    char* end = nullptr;
    const double v = std::strtod(text->c_str(), &end);
    if (end == text->c_str() || *end != '\0' || !(v > 0) || v > 1e9) {
      bad_value(name, *text, "a positive number of seconds",
                "a number of seconds above 0, such as " + std::string(example));
    }
    return v;
  }
  std::optional<int64_t> bytes(const char* name, std::string_view zero_means) const {
    auto text = get(name);
    if (!text) return std::nullopt;
    try {
      return parse_bytes(*text);
    } catch (const c10::Error&) {
      bad_value(name, *text, "a byte count",
                "a size such as 12GiB, 800MB or 1073741824, or 0 " + std::string(zero_means));
    }
  }
  std::optional<bool> zero_or_one(const char* name, std::string_view zero, std::string_view one) const {
    auto text = get(name);
    if (!text) return std::nullopt;
    if (*text == "0") return false;
    if (*text == "1") return true;
    bad_value(name, *text, "0 or 1",
              "0 (" + std::string(zero) + ") or 1 (" + std::string(one) + ")");
  }

 private:
  const Environment& env_;
};

// Leading integer of SLURM's "4(x2)" / "4" forms.
int leading_int(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && i < 9 && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
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

// What a launcher told this process. A launcher's variables come as a set: with one of them
// present (RANK and WORLD_SIZE; OMPI_COMM_WORLD_RANK and _SIZE; SLURM_PROCID and SLURM_NTASKS),
// the others of its set are read and checked.
LaunchInfo parse_launch(const Reader& env) {
  constexpr int64_t kMaxRank = (int64_t{1} << 30) - 1;
  auto rank_of = [&](const char* name, const char* who) -> int {
    auto v = env.integer(name, 0, kMaxRank, "a non-negative integer", who);
    TORCH_CHECK(v.has_value(), "[launch] ", who, " environment without ", name,
                "; set it or unset the other launcher variables");
    return static_cast<int>(*v);
  };
  auto rank_or = [&](const char* name, int fallback, const char* who) -> int {
    return env.has(name) ? rank_of(name, who) : fallback;
  };
  auto port_of = [&](const char* name, const char* who) -> int {
    return static_cast<int>(*env.integer(name, 0, 65535, "a TCP port", who));
  };

  LaunchInfo info;
  // The four numbers torchrun-style launchers and mpirun give, and the nodes they imply (the
  // ranks of a node are consecutive: mpirun's default by-slot mapping lays them out so).
  auto adopt_ranks = [&](const char* rank, const char* world, const char* local_rank,
                         const char* local_world, const char* who) {
    info.rank = rank_of(rank, who);
    info.world_size = rank_of(world, who);
    info.local_rank = rank_or(local_rank, info.rank, who);
    // Without a local world size all ranks are taken to be on this node.
    info.local_world_size = rank_or(local_world, info.world_size, who);
    const int per_node = std::max(1, info.local_world_size);
    info.num_nodes = std::max(1, (info.world_size + per_node - 1) / per_node);
    info.node_rank = info.rank / per_node;
    info.master_addr = env.get_or("MASTER_ADDR", "127.0.0.1");
  };
  if (env.has("RANK") && env.has("WORLD_SIZE")) {
    // torchrun-style (also what our own spawner and fsdp-run set).
    const char* who = "torchrun-style";
    const std::string tag = env.get_or("FSDP_LAUNCHER", "");
    info.source = tag == "spawn" ? "spawn" : tag == "fsdp-run" ? "fsdp-run" : "env";
    adopt_ranks("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", who);
    info.node_rank = rank_or("GROUP_RANK", rank_or("NODE_RANK", info.node_rank, who), who);
    info.master_port = env.has("MASTER_PORT") ? port_of("MASTER_PORT", who) : 0;
    validate(info, who);
    return info;
  }
  if (env.has("OMPI_COMM_WORLD_RANK") && env.has("OMPI_COMM_WORLD_SIZE")) {
    // OpenMPI has no node index variable.
    const char* who = "mpirun (OpenMPI)";
    info.source = "mpirun";
    adopt_ranks("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", who);
    info.master_port = env.has("MASTER_PORT")
                           ? port_of("MASTER_PORT", who)
                           : port_from_job_id(env.get_or("OMPI_MCA_ess_base_jobid",
                                                         env.get_or("PMIX_NAMESPACE", "0")));
    validate(info, who);
    return info;
  }
  if (env.has("SLURM_PROCID") && env.has("SLURM_NTASKS")) {
    const char* who = "SLURM (srun)";
    info.source = "slurm";
    info.rank = rank_of("SLURM_PROCID", who);
    info.world_size = rank_of("SLURM_NTASKS", who);
    info.local_rank = rank_or("SLURM_LOCALID", 0, who);
    info.num_nodes = rank_or("SLURM_NNODES", rank_or("SLURM_JOB_NUM_NODES", 1, who), who);
    int per_node = leading_int(env.get_or("SLURM_NTASKS_PER_NODE", ""));
    if (per_node <= 0) per_node = leading_int(env.get_or("SLURM_TASKS_PER_NODE", ""));
    if (per_node <= 0) per_node = std::max(1, info.world_size / std::max(1, info.num_nodes));
    info.local_world_size = per_node;
    info.node_rank = rank_or("SLURM_NODEID", info.rank / per_node, who);
    if (env.has("MASTER_ADDR")) {
      info.master_addr = *env.get("MASTER_ADDR");
    } else {
      const std::string nodelist =
          env.get_or("SLURM_JOB_NODELIST", env.get_or("SLURM_NODELIST", ""));
      const std::string host = nodelist.empty() ? "127.0.0.1" : first_slurm_host(nodelist);
      TORCH_CHECK(!host.empty(), "[launch] cannot take the master host from SLURM_JOB_NODELIST='",
                  nodelist, "'; export MASTER_ADDR=<first node's hostname> before srun");
      info.master_addr = host;
    }
    info.master_port = env.has("MASTER_PORT")
                           ? port_of("MASTER_PORT", who)
                           : port_from_job_id(env.get_or("SLURM_JOB_ID", "0"));
    validate(info, who);
    return info;
  }
  // No launcher: MASTER_ADDR / MASTER_PORT still say where rank 0 of a job about to be started
  // should listen (fsdp::launch's spawner, init_process_group with explicit ranks).
  info.master_addr = env.get_or("MASTER_ADDR", "127.0.0.1");
  info.master_port = env.has("MASTER_PORT") ? port_of("MASTER_PORT", "") : 0;
  return info;
}

// The id of the job this process is a rank of. torchrun's and SLURM's ids count only when that
// launcher started this process: a program that runs inside a SLURM allocation and spawns its
// own ranks is its own job (fsdp::launch gives it a fresh id).
std::string parse_job_id(const Reader& env, const LaunchInfo& launch) {
  if (auto id = env.get("FSDP_JOB_ID")) return *id;
  // torchrun's --rdzv-id defaults to "none" in every job: not an id.
  if (auto id = env.get("TORCHELASTIC_RUN_ID"); id && *id != "none" && launch.source == "env") {
    return *id;
  }
  if (auto id = env.get("SLURM_JOB_ID"); id && launch.source == "slurm") {
    if (auto step = env.get("SLURM_STEP_ID")) return *id + "." + *step;
    return *id;
  }
  return "";
}

}  // namespace

Environment process_environment() {
  Environment env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const size_t eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  return env;
}

Settings parse_settings(const Environment& environment) {
  const Reader env(environment);
  Settings s;
  s.launch = parse_launch(env);
  s.launched_by = env.get_or("FSDP_LAUNCHER", "");
  if (auto fd = env.integer("FSDP_LAUNCH_NOTIFY_FD", 0, 1 << 20, "a file descriptor")) {
    s.notify_fd = static_cast<int>(*fd);
  }
  if (auto n = env.integer("FSDP_NUM_THREADS", 1, 4096, "a positive thread count")) {
    s.num_threads = static_cast<int>(*n);
  }
  if (auto n = env.integer("FSDP_LAUNCH_THREADS", 1, 4096, "a positive thread count",
                           "the launcher")) {
    s.launch_threads = static_cast<int>(*n);
  }
  if (auto n = env.integer("OMPI_COMM_WORLD_SIZE", 1, int64_t{1} << 30, "a world size",
                           "mpirun (OpenMPI)")) {
    s.mpirun_world_size = static_cast<int>(*n);
  }
  s.job_id = parse_job_id(env, s.launch);
  s.path = env.get_or("PATH", "/usr/local/bin:/usr/bin:/bin");

  s.backend = env.get_or("FSDP_BACKEND", "");
  if (!s.backend.empty() && s.backend != "auto" && s.backend != "gloo" && s.backend != "mpi" &&
      s.backend != "nccl") {
    bad_value("FSDP_BACKEND", s.backend, "a process group backend",
              "'auto', 'gloo', 'mpi', 'nccl'");
  }
  s.memory_budget = env.bytes("FSDP_MEMORY_BUDGET", "for no budget");
  s.alloc_cache_bytes = env.bytes("FSDP_ALLOC_CACHE", "to turn the cache off")
                            .value_or(s.alloc_cache_bytes);
  s.stdout_is_terminal =
      env.zero_or_one("FSDP_STDOUT_IS_TERMINAL", "plain progress lines", "a redrawn line");
  s.collective_timeout_s = env.seconds("FSDP_COLLECTIVE_TIMEOUT_S", "600");
  s.rendezvous_timeout_s = env.seconds("FSDP_RENDEZVOUS_TIMEOUT_S", "60");
  if (auto debug = env.get("FSDP_DEBUG")) {
    std::string lower = *debug;
    for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower == "detail") {
      s.debug = DebugLevel::kDetail;
    } else if (lower != "off") {
      bad_value("FSDP_DEBUG", *debug, "a debug level",
                "'off', 'detail' (check every collective's op, sizes and dtype across ranks)");
    }
  }
  s.deferred_init =
      env.zero_or_one("FSDP_DEFERRED_INIT", "off", "on, the default").value_or(true);
  s.deepspeed_config_path = env.get_or("PL_DEEPSPEED_CONFIG_PATH", "");
  s.gloo_socket_ifname = env.get_or("GLOO_SOCKET_IFNAME", "");
  s.torch_log_level_set = env.has("TORCH_CPP_LOG_LEVEL");
  s.show_cpp_stacktraces = env.get_or("TORCH_SHOW_CPP_STACKTRACES", "") == "1";
  return s;
}

Settings read_settings() { return parse_settings(process_environment()); }

const std::vector<std::string>& setting_names() { return variables(); }

std::string get_env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : fallback;
}

bool has_env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0';
}

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

}  // namespace fsdp::detail
