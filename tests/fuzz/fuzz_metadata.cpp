// libFuzzer target: the checkpoint metadata reader (metadata.json / meta.json) on arbitrary
// bytes. Any input must give either validated fields or a FormatError; never a crash, an
// out-of-bounds access (ASan), undefined behaviour (UBSan) or another exception type (e.g. a
// nlohmann::json type_error from reading a field of the wrong type).
#include "ckpt/metadata.h"

#include <cstdint>
#include <cstdlib>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    nlohmann::json meta = fsdp::ckpt::parse_json_object(text, "metadata.json");
    try {
      auto m = fsdp::ckpt::parse_checkpoint_meta(meta, "metadata.json");
      if (m.type != "full" && m.type != "sharded") std::abort();
      if (!m.rng_cpu_per_rank.empty() &&
          static_cast<int64_t>(m.rng_cpu_per_rank.size()) != m.world_size) {
        std::abort();
      }
    } catch (const fsdp::ckpt::FormatError&) {
    }
    auto tensors = fsdp::ckpt::parse_sharded_tensors(meta, "metadata.json");
    // Invariants the loaders rely on: pieces sorted, non-empty, contiguous, covering [0, dim0).
    for (const auto& [key, t] : tensors) {
      int64_t next = 0;
      for (const auto& p : t.pieces) {
        if (p.begin != next || p.end <= p.begin) std::abort();
        if (p.file.empty() || p.file.find('/') != std::string::npos || p.file[0] == '.') {
          std::abort();
        }
        next = p.end;
      }
      if (next != fsdp::ckpt::dim0_of(t.shape)) std::abort();
      for (int64_t d : t.shape) {
        if (d < 0) std::abort();
      }
    }
  } catch (const fsdp::ckpt::FormatError&) {
  }
  return 0;
}
