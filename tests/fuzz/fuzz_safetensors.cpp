// libFuzzer target: the safetensors header/metadata reader on arbitrary bytes. Any input must
// give either a parsed header whose entries lie inside the data section or a FormatError;
// never a crash, an out-of-bounds read (ASan) or another exception type.
#include "ckpt/safetensors.h"

#include <cstdint>
#include <cstdlib>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    auto header = fsdp::ckpt::parse_safetensors_image(data, size, "fuzz.safetensors");
    uint64_t prev_end = 0;
    for (const auto& t : header.tensors) {
      // Invariants the loaders rely on.
      if (t.end > header.data_size || t.begin > t.end || t.begin < prev_end) std::abort();
      if (static_cast<uint64_t>(t.nbytes()) != t.end - t.begin) std::abort();
      // Touch the bytes the header promises (ASan catches any out-of-bounds read).
      volatile uint8_t sink = 0;
      for (uint64_t i = t.begin; i < t.end; i += 4096) sink ^= data[header.data_start + i];
      if (t.end > t.begin) sink ^= data[header.data_start + t.end - 1];
      (void)sink;
      prev_end = t.end;
    }
  } catch (const fsdp::ckpt::FormatError&) {
  }
  return 0;
}
