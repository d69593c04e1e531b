// Which process-group backend a run gets when it asks for "auto" (Note [Backend auto]).
// A pure function of the facts of the launch, so the choice is testable without launching.
#pragma once

#include <string>

namespace fsdp::detail {

struct Settings;

struct BackendFacts {
  std::string requested = "auto";  // "auto" | "gloo" | "mpi" (FSDP_BACKEND already applied)
  bool mpi_built = false;          // this build has the MPI backend
  bool mpirun_found = false;       // `mpirun` is on PATH
  std::string launcher = "none";   // LaunchInfo::source: none | spawn | fsdp-run | env | slurm | mpirun
  int num_nodes = 1;               // hosts of the job
  int world_size = 1;              // ranks of the job
};

struct BackendChoice {
  std::string backend;  // "gloo" | "mpi"
  std::string reason;   // one clause, for the line the Trainer prints
  bool relaunch_through_mpirun = false;  // this process re-executes itself through mpirun
};

BackendChoice choose_backend(const BackendFacts& facts);

// The facts of this process: the launcher's ranks from `settings` (or `devices` x `num_nodes`
// when nothing launched it), mpi_built(), `mpirun` on the settings' PATH.
BackendFacts backend_facts(const std::string& requested, int devices, int num_nodes,
                           const Settings& settings);

// "[fsdp] backend mpi (auto: ...)": the line a run prints once (rank 0) about its choice.
std::string describe(const BackendChoice& choice, const std::string& requested);

}  // namespace fsdp::detail
