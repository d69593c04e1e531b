// The memory bandwidth the optimizer floors divide by (fsdp-bench floor, llmc, cpu_adam).
//
// Adam's fused pass updates p, m and v in place and reads g: every line it writes was read
// first, so the measure is an in-place stream, a.add_(b): 8 bytes read and 4 written per
// element, no write-allocate traffic. at::copy_ into a fresh buffer (what these benchmarks
// used before) also reads each destination line before writing it (write-allocate), traffic its
// "read + written" count does not see: on this machine that understated the bandwidth by ~1.5x
// and so overstated the optimizer floor.
#include "bench.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

namespace fsdp::bench {

double update_bandwidth() {
  const int64_t n = int64_t{64} << 20;  // 256 MiB of fp32 per operand, far beyond the caches
  at::Tensor a = at::rand({n}), b = at::rand({n});
  a.add_(b);  // touch every page
  double best = 1e30;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    a.add_(b);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                              .count());
  }
  return 3.0 * 4.0 * static_cast<double>(n) / best;
}

}  // namespace fsdp::bench
