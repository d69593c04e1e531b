// A program linked the wrong way round on purpose: libtorch before libgloo (tests/CMakeLists.txt),
// so Gloo's symbols resolve into libtorch's private copy. Starting a gloo world must then fail
// with the link-order error of Note [Gloo backend] (docs/design.md) before any Gloo object is
// made. Prints the error and exits 3; exits 0 if the world (wrongly) came up.
#include <cstdio>

#include "fsdp/comm.h"

int main() {
  fsdp::ProcessGroupOptions options;
  options.backend = "gloo";
  options.rank = 0;
  options.world_size = 2;
  options.master_addr = "127.0.0.1";
  options.master_port = 1;  // never reached: the symbol check comes first
  try {
    fsdp::init_process_group(options);
  } catch (const std::exception& e) {
    std::printf("%s\n", e.what());
    return 3;
  }
  return 0;
}
