// What `fsdp-ckpt` calls beyond the public API (include/fsdp/checkpoint.h): conversion that may
// replace an output it is told to, and verification without loading.
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::ckpt {

// As fsdp::convert_to_safetensors / fsdp::convert_to_sharded; with `overwrite`, an existing
// output of the same kind is replaced (Note [Writers never destroy] in src/ckpt/output.h).
void convert_to_safetensors(const std::string& checkpoint_dir, const std::string& out_file,
                            bool overwrite);
void convert_to_sharded(const std::string& checkpoint_dir, const std::string& out_dir,
                        int world_size, bool overwrite);

// What `fsdp-ckpt verify` checked: the structure (headers, piece table, identity of every file:
// Note [Checkpoint identity] in src/ckpt/identity.h) and every piece's bytes against its
// checksum, without loading anything into a model. Throws c10::Error naming the file, the
// tensor and what is wrong.
struct VerifyReport {
  std::string type;         // "full" | "sharded" | "safetensors"
  std::string run_id;       // "" when not recorded
  int64_t global_step = 0;
  int64_t world_size = 0;
  int64_t files = 0;
  int64_t tensors = 0;
  int64_t bytes_checked = 0;
  bool checksums = false;   // false: written without them (an earlier fsdp.cpp); not verified
};
VerifyReport verify_checkpoint(const std::string& path, const char* who = "fsdp-ckpt verify");

}  // namespace fsdp::ckpt
