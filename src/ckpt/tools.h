// What `fsdp-ckpt` calls beyond the public API (include/fsdp/checkpoint.h): conversion that may
// replace an output it is told to, and verification without loading.
#pragma once

#include <string>

namespace fsdp::ckpt {

// As fsdp::convert_to_safetensors / fsdp::convert_to_sharded; with `overwrite`, an existing
// output of the same kind is replaced (Note [Writers never destroy] in src/ckpt/output.h).
void convert_to_safetensors(const std::string& checkpoint_dir, const std::string& out_file,
                            bool overwrite);
void convert_to_sharded(const std::string& checkpoint_dir, const std::string& out_dir,
                        int world_size, bool overwrite);

}  // namespace fsdp::ckpt
