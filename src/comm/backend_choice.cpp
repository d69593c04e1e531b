#include "comm/backend_choice.h"

#include "comm/launcher_detail.h"
#include "comm/mpi_transport.h"

namespace fsdp::detail {

// Note [Backend auto]
// ~~~~~~~~~~~~~~~~~~~
// "auto" picks the fastest backend that works for the way the ranks are (or will be) started.
// On one host MPI (OpenMPI's shared-memory transport) beats Gloo's loopback TCP: we
// measured DDP 1.88 vs 1.44 it/s and FULL_SHARD 1.66 vs 1.13 it/s on transformer-small at
// world 2. But MPI ranks must be started by mpirun (Note [MPI launch]): processes started any
// other way are MPI singletons that cannot form one world. Hence, in order:
//   1. world of one rank: no collectives cross a process; "gloo" (the local group).
//   2. launched by mpirun and MPI built: "mpi" (on any number of hosts; mpirun placed them).
//   3. ranks already started by another launcher (our spawner, fsdp-run, torchrun env, srun):
//      "gloo"; they are not an MPI job.
//   4. not launched yet (a plain `fsdp-train --devices N`) on one host, MPI built and mpirun on
//      PATH: "mpi", and the launcher re-executes the program through mpirun.
//   5. otherwise "gloo", saying what is missing for MPI (several hosts need mpirun or
//      srun/fsdp-run per host, which is Gloo's TCP).
// An explicit "gloo" or "mpi" (flag or FSDP_BACKEND) is never overridden.
BackendChoice choose_backend(const BackendFacts& f) {
  BackendChoice c;
  if (f.requested != "auto") {
    c.backend = f.requested;
    c.reason = "requested";
    c.relaunch_through_mpirun = f.requested == "mpi" && f.launcher == "none" && f.world_size > 1;
    return c;
  }
  if (f.world_size <= 1) {
    c.backend = "gloo";
    c.reason = "one rank, no collectives between processes";
    return c;
  }
  if (f.launcher == "mpirun") {
    c.backend = f.mpi_built ? "mpi" : "gloo";
    c.reason = f.mpi_built ? "launched by mpirun"
                           : "launched by mpirun but this build has no MPI backend "
                             "(FSDP_WITH_MPI=OFF)";
    return c;
  }
  if (f.launcher != "none") {
    c.backend = "gloo";
    c.reason = "ranks started by " + f.launcher +
               ", not mpirun (MPI needs mpirun: `fsdp-run --backend mpi` or `mpirun -n N`)";
    return c;
  }
  if (f.num_nodes > 1) {
    c.backend = "gloo";
    c.reason = std::to_string(f.num_nodes) + " hosts without mpirun: Gloo over TCP";
    return c;
  }
  if (!f.mpi_built) {
    c.backend = "gloo";
    c.reason = "one host, but this build has no MPI backend (FSDP_WITH_MPI=OFF)";
    return c;
  }
  if (!f.mpirun_found) {
    c.backend = "gloo";
    c.reason = "one host, but `mpirun` is not on PATH (install openmpi-bin for the faster MPI)";
    return c;
  }
  c.backend = "mpi";
  c.reason = "one host, MPI built and mpirun found: shared memory is faster than Gloo's "
             "loopback TCP; re-running through mpirun";
  c.relaunch_through_mpirun = true;
  return c;
}

BackendFacts backend_facts(const std::string& requested, int devices, int num_nodes,
                           const Settings& settings) {
  BackendFacts f;
  f.requested = requested;
  f.mpi_built = mpi_built();
  f.mpirun_found = !find_on_path("mpirun").empty();
  const LaunchInfo& info = settings.launch;
  f.launcher = info.source;
  if (info.source == "none") {
    f.num_nodes = num_nodes;
    f.world_size = devices * num_nodes;
  } else {
    f.num_nodes = info.num_nodes;
    f.world_size = info.world_size;
  }
  return f;
}

std::string describe(const BackendChoice& choice, const std::string& requested) {
  return "[fsdp] backend " + choice.backend + " (" + requested + ": " + choice.reason + ")";
}

}  // namespace fsdp::detail
