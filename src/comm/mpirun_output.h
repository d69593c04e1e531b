// fsdp::launch's MPI path: mpirun as a child whose stderr is sorted into what the user reads and
// a log file. See Note [MPI launch output] in mpirun_output.cpp.
#pragma once

#include <string>
#include <vector>

namespace fsdp::detail {

// Forks and runs argv (mpirun and its arguments), forwards the ranks' own stderr lines, puts
// mpirun's and OpenMPI's messages in a log file named at the end, and exits with mpirun's
// status. Call with no other threads running (right after start-up).
[[noreturn]] void run_mpirun_filtered(const std::vector<std::string>& argv);

}  // namespace fsdp::detail
