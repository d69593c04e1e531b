// MPI backend: OpenMPI called directly, every call made on one process-wide comm thread.
// See Note [Comm thread] and Note [MPI progress and yielding].
#pragma once

#include "comm/process_group_impl.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <memory>

namespace fsdp::detail {

struct MpiWorld {
  std::unique_ptr<Transport> transport;
  std::shared_ptr<CommThread> thread;  // the one thread that makes MPI calls
  int rank = 0;
  int size = 1;
  // Heartbeat store for the Monitor: rank 0 hosts a TCPStore, its port goes round by MPI_Bcast.
  c10::intrusive_ptr<c10d::Store> monitor_store;
};

// True when this build has the MPI backend.
bool mpi_built();
// Initialises MPI once per process (on the comm thread) and returns the world. Collective.
MpiWorld make_mpi_world();
// MPI_Finalize on the comm thread (at exit). Skipped when a collective is stuck.
void finalize_mpi();
// For a rank that is failing under mpirun: MPI_Abort(MPI_COMM_WORLD, code) when MPI is
// initialised and not finalised (mpirun then stops every rank and exits with the code; a rank
// that just exits non-zero can leave OpenMPI 4.1's mpirun hung with its ranks reaped as
// zombies, open-mpi/ompi#3380). Returns when MPI is not in use in this process.
void abort_mpi_job(int code);

}  // namespace fsdp::detail
