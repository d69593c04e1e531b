// Checkpoint and run identity. See Note [Checkpoint identity] and Note [Run identity] in
// identity.h.
#include "ckpt/identity.h"

#include <random>

namespace fsdp::ckpt {

std::map<std::string, std::string> identity_metadata(const Identity& id) {
  return {{"fsdp.run_id", id.run_id},
          {"fsdp.save_id", id.save_id},
          {"fsdp.step", std::to_string(id.step)},
          {"fsdp.world_size", std::to_string(id.world_size)},
          {"fsdp.shard", std::to_string(id.shard) + "/" + std::to_string(id.shards)}};
}

std::string describe_identity(const SafetensorsHeader& header) {
  auto get = [&](const char* key) {
    auto it = header.metadata.find(key);
    return it == header.metadata.end() ? std::string("?") : it->second;
  };
  if (!header.metadata.count("fsdp.save_id")) return "no identity";
  return "run " + get("fsdp.run_id") + " step " + get("fsdp.step") + ", shard " +
         get("fsdp.shard") + ", save " + get("fsdp.save_id");
}

std::string random_id() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) {
    const uint32_t v = rd();
    out += crc32_hex(v);  // 8 hex digits of v
  }
  return out;
}

std::string& current_run_id() {
  static std::string id;
  return id;
}

const std::string& current_or_new_run_id() {
  std::string& id = current_run_id();
  if (id.empty()) id = random_id();
  return id;
}

}  // namespace fsdp::ckpt
