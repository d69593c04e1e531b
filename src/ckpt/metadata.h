// The piece table of a sharded checkpoint (metadata.json), parsed and validated. Torch-free on
// purpose, like safetensors.h, so the libFuzzer target (tests/fuzz/fuzz_metadata.cpp) builds it
// with clang++ alone. See Note [Checkpoint layout] in layout.h for what the pieces mean.
#pragma once

#include "ckpt/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::ckpt {

struct Piece {
  std::string file;  // relative to the checkpoint directory
  int64_t begin = 0;
  int64_t end = 0;
};

struct SourceTensor {
  std::vector<int64_t> shape;
  DType dtype = DType::kF32;
  std::vector<Piece> pieces;  // sorted, disjoint, covering [0, dim0)
};

inline int64_t dim0_of(const std::vector<int64_t>& full) { return full.empty() ? 1 : full[0]; }

// Throws FormatError("<what>: <msg>").
[[noreturn]] void format_error(const std::string& what, const std::string& msg);

// `text` as a JSON object; FormatError naming `what` otherwise.
nlohmann::json parse_json_object(const std::string& text, const std::string& what);

// Validates a sharded checkpoint's metadata (already parsed): "type" is "sharded", and every
// entry of "tensors" has a shape (dims >= 0, element count < 2^62), a known dtype and pieces
// that name a plain file inside the checkpoint directory and cover rows [0, dim0) exactly once.
// Returns the tensors; throws FormatError naming `what` and the first problem.
std::map<std::string, SourceTensor> parse_sharded_tensors(const nlohmann::json& meta,
                                                          const std::string& what);

// The typed fields of a checkpoint's meta.json / metadata.json, validated (parse_checkpoint_meta).
struct CheckpointMeta {
  std::string type;            // "full" | "sharded"
  int64_t world_size = 0;      // 0: not recorded
  std::string strategy;
  int64_t global_step = 0, epoch = 0, batch_in_epoch = 0, scheduler_steps = 0;
  bool has_optimizer = false;
  std::string optimizer_kind;                     // "adam" | "adamw" | "sgd"
  std::vector<double> lrs;                        // per param group
  std::map<std::string, int64_t> optimizer_steps; // FQN -> Adam step
  std::vector<uint8_t> rng_cpu;                   // rank 0's CPU generator state (may be empty)
  std::vector<std::vector<uint8_t>> rng_cpu_per_rank;  // every rank's, when saved
  // The same for the CUDA generator of each rank's device, when the ranks trained on CUDA.
  std::vector<uint8_t> rng_cuda;
  std::vector<std::vector<uint8_t>> rng_cuda_per_rank;
  std::string callback_states;                    // "callbacks" object as JSON text ("" = none)
};

// Checks every field above that is present (types, ranges, hex strings, one RNG state per
// rank of world_size) and returns them; FormatError naming `what` and the field otherwise.
// Absent optional fields keep their defaults; "type" is required.
CheckpointMeta parse_checkpoint_meta(const nlohmann::json& meta, const std::string& what);

// Bytes as lowercase hex and back (FormatError naming `what` for a bad string).
std::string to_hex(const uint8_t* data, size_t size);
std::vector<uint8_t> from_hex(const std::string& hex, const std::string& what);

}  // namespace fsdp::ckpt
