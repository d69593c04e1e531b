// The library's own pseudo-random generator for data order and synthetic data: splitmix64.
// std:: distributions differ between standard libraries; these functions give the same numbers
// on every platform, so samplers and corpora are reproducible everywhere.
#pragma once

#include <cstdint>

namespace fsdp::detail {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }

  // Uniform in [0, n), n > 0, without modulo bias (rejects the top partial range).
  uint64_t below(uint64_t n) {
    const uint64_t threshold = (0 - n) % n;  // 2^64 mod n
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) return r % n;
    }
  }

 private:
  uint64_t state_;
};

}  // namespace fsdp::detail
