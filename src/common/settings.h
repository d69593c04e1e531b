// Settings: every environment variable fsdp.cpp reads, read by one file (settings.cpp) into one
// struct and documented in one table (docs/environment.md). See Note [Settings] in settings.cpp.
#pragma once

#include "fsdp/launcher.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

// Variable name -> value. An empty value counts as unset everywhere (`VAR= program` unsets).
using Environment = std::map<std::string, std::string>;

// This process's environment, now (the one reader of the process environment).
Environment process_environment();

// Values of FSDP_DEBUG.
enum class DebugLevel { kOff, kDetail };

struct Settings {
  // --- The launcher's: who started this process, which rank it is, where rank 0 is.
  // torchrun-style (RANK, WORLD_SIZE, ...), mpirun (OMPI_COMM_WORLD_*), SLURM (SLURM_*), our
  // own spawner and fsdp-run; source "none" when no launcher started this process.
  LaunchInfo launch;
  // FSDP_LAUNCHER: which of fsdp.cpp's launchers started the ranks ("spawn": fsdp::launch's
  // spawner, "mpirun": fsdp::launch re-running the program through mpirun, "fsdp-run",
  // "test": the test harness; "" for anything else).
  std::string launched_by;
  // FSDP_LAUNCH_NOTIFY_FD: the failure-notice pipe of the launcher's watcher (-1: none).
  int notify_fd = -1;
  // FSDP_NUM_THREADS: the user's intra-op threads per rank (unset: chosen from the free cores).
  std::optional<int> num_threads;
  // FSDP_LAUNCH_THREADS: the intra-op threads per rank the launcher chose for the ranks it
  // started (Note [Threads per rank] in comm/thread_choice.cpp).
  std::optional<int> launch_threads;
  // OMPI_COMM_WORLD_SIZE: set when mpirun started this process (whatever RANK says).
  std::optional<int> mpirun_world_size;
  // The job's id: FSDP_JOB_ID, else torchrun's TORCHELASTIC_RUN_ID (under torchrun, unless it
  // is torchrun's placeholder "none"), else SLURM_JOB_ID[.SLURM_STEP_ID] (under srun); "" when
  // none applies. Ranks of one job agree on it: the rendezvous refuses another job's ranks, the
  // disk tier names its files after it.
  std::string job_id;
  // PATH, where mpirun is looked for.
  std::string path;

  // --- The user's.
  std::string backend;  // FSDP_BACKEND: "auto" | "gloo" | "mpi"; "" when unset
  // FSDP_MEMORY_BUDGET: per-rank tensor bytes (0: no budget); unset: the Trainer's default.
  std::optional<int64_t> memory_budget;
  int64_t alloc_cache_bytes = int64_t{512} << 20;  // FSDP_ALLOC_CACHE (0: no cache)
  std::optional<bool> stdout_is_terminal;          // FSDP_STDOUT_IS_TERMINAL
  std::optional<double> collective_timeout_s;      // FSDP_COLLECTIVE_TIMEOUT_S
  std::optional<double> rendezvous_timeout_s;      // FSDP_RENDEZVOUS_TIMEOUT_S
  DebugLevel debug = DebugLevel::kOff;             // FSDP_DEBUG
  bool deferred_init = true;                       // FSDP_DEFERRED_INIT (0 turns it off)
  std::string deepspeed_config_path;               // PL_DEEPSPEED_CONFIG_PATH
  std::string gloo_socket_ifname;                  // GLOO_SOCKET_IFNAME
  bool torch_log_level_set = false;                // TORCH_CPP_LOG_LEVEL is set
  bool show_cpp_stacktraces = false;               // TORCH_SHOW_CPP_STACKTRACES=1
};

// Parses `env`. A bad value is a c10::Error of one sentence that names the variable, its value
// and what is valid.
Settings parse_settings(const Environment& env);
// parse_settings(process_environment()).
Settings read_settings();

// The names parse_settings reads, in the order of the table in docs/environment.md.
const std::vector<std::string>& setting_names();

// Raw access for the programs that set variables for the processes they start (fsdp-run, the
// test harness); the library itself reads Settings.
std::string get_env(const char* name, const std::string& fallback = "");
bool has_env(const char* name);

// First host of a SLURM node list ("node[03-05,07]" -> "node03", "a,b" -> "a"); "" when the
// list has a form we do not expand (then the user sets MASTER_ADDR).
std::string first_slurm_host(const std::string& nodelist);

}  // namespace fsdp::detail
