// metadata.json of sharded checkpoints: validation of the piece table. See metadata.h.
#include "ckpt/metadata.h"

#include <algorithm>
#include <limits>

namespace fsdp::ckpt {

using json = nlohmann::json;

void format_error(const std::string& what, const std::string& msg) {
  throw FormatError(what + ": " + msg);
}

namespace {

// A JSON number that is a non-negative integer representable as int64.
bool as_index(const json& v, int64_t* out) {
  if (!v.is_number_unsigned()) return false;
  const uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = static_cast<int64_t>(u);
  return true;
}

}  // namespace

json parse_json_object(const std::string& text, const std::string& what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    format_error(what, "is not a JSON object; the checkpoint metadata is truncated or corrupt");
  }
  return j;
}

std::map<std::string, SourceTensor> parse_sharded_tensors(const json& meta,
                                                          const std::string& what) {
  if (!meta.is_object()) format_error(what, "is not a JSON object");
  auto type = meta.find("type");
  if (type == meta.end() || !type->is_string() || type->get<std::string>() != "sharded") {
    format_error(what, "\"type\" is not \"sharded\"");
  }
  auto ts = meta.find("tensors");
  if (ts == meta.end() || !ts->is_object()) format_error(what, "has no \"tensors\" object");
  std::map<std::string, SourceTensor> out;
  for (auto it = ts->begin(); it != ts->end(); ++it) {
    const std::string& key = it.key();
    const json& v = it.value();
    const std::string where = "tensor '" + key + "'";
    if (!v.is_object() || !v.contains("shape") || !v.contains("dtype") ||
        !v.contains("pieces") || !v["shape"].is_array() || !v["dtype"].is_string() ||
        !v["pieces"].is_array()) {
      format_error(what, where + " lacks \"shape\", \"dtype\" or \"pieces\"");
    }
    SourceTensor t;
    // Element count below 2^62 so that byte counts (x8) cannot overflow later.
    constexpr int64_t kMaxElements = int64_t{1} << 62;
    int64_t numel = 1;
    for (const auto& d : v["shape"]) {
      int64_t dim = 0;
      if (!as_index(d, &dim)) format_error(what, where + " has a bad shape " + v["shape"].dump());
      if (dim != 0 && numel > kMaxElements / dim) {
        format_error(what, where + " has an impossibly large shape " + v["shape"].dump());
      }
      numel *= dim;
      t.shape.push_back(dim);
    }
    if (!parse_dtype(v["dtype"].get<std::string>(), &t.dtype)) {
      format_error(what, where + " has unknown dtype " + v["dtype"].dump());
    }
    for (const auto& p : v["pieces"]) {
      int64_t begin = 0, end = 0;
      if (!p.is_object() || !p.contains("file") || !p["file"].is_string() ||
          !p.contains("rows") || !p["rows"].is_array() || p["rows"].size() != 2 ||
          !as_index(p["rows"][0], &begin) || !as_index(p["rows"][1], &end)) {
        format_error(what, where + " has a malformed piece " + p.dump() +
                               " (expected {\"file\": name, \"rows\": [begin, end]})");
      }
      std::string file = p["file"].get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file[0] == '.' ||
          file.find('\0') != std::string::npos) {
        format_error(what, where + " names file '" + file + "' outside the checkpoint directory");
      }
      t.pieces.push_back({std::move(file), begin, end});
    }
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const Piece& a, const Piece& b) { return a.begin < b.begin; });
    int64_t next = 0;
    const int64_t dim0 = dim0_of(t.shape);
    for (const auto& p : t.pieces) {
      if (p.begin != next || p.end <= p.begin || p.end > dim0) {
        format_error(what, where + " (" + std::to_string(dim0) + " rows): piece rows [" +
                               std::to_string(p.begin) + ", " + std::to_string(p.end) + ") in " +
                               p.file + " do not continue at row " + std::to_string(next) +
                               " with at least one row; the metadata is corrupt");
      }
      next = p.end;
    }
    if (next != dim0) {
      format_error(what, where + ": rows [" + std::to_string(next) + ", " +
                             std::to_string(dim0) +
                             ") are in no file; the checkpoint is incomplete");
    }
    out[key] = std::move(t);
  }
  return out;
}

std::string to_hex(const uint8_t* data, size_t size) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(size * 2);
  for (size_t i = 0; i < size; ++i) {
    out.push_back(digits[data[i] >> 4]);
    out.push_back(digits[data[i] & 15]);
  }
  return out;
}

std::vector<uint8_t> from_hex(const std::string& hex, const std::string& what) {
  if (hex.size() % 2 != 0) format_error(what, "is not a hex string (odd length)");
  auto val = [&](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    format_error(what, "is not a hex string");
  };
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<uint8_t>((val(hex[2 * i]) << 4) | val(hex[2 * i + 1]));
  }
  return out;
}

CheckpointMeta parse_checkpoint_meta(const json& meta, const std::string& what) {
  if (!meta.is_object()) format_error(what, "is not a JSON object");
  CheckpointMeta m;
  auto str = [&](const json& obj, const char* key, std::string* out, bool required) {
    auto it = obj.find(key);
    if (it == obj.end()) {
      if (required) format_error(what, std::string("has no \"") + key + "\"");
      return;
    }
    if (!it->is_string()) format_error(what, std::string("\"") + key + "\" is not a string");
    *out = it->get<std::string>();
  };
  auto index = [&](const json& obj, const char* key, int64_t* out) {
    auto it = obj.find(key);
    if (it == obj.end()) return;
    if (!as_index(*it, out)) {
      format_error(what,
                   std::string("\"") + key + "\" is not a non-negative integer: " + it->dump());
    }
  };
  str(meta, "type", &m.type, true);
  if (m.type != "full" && m.type != "sharded") {
    format_error(what, "\"type\" is \"" + m.type + "\"; expected \"full\" or \"sharded\"");
  }
  str(meta, "strategy", &m.strategy, false);
  index(meta, "world_size", &m.world_size);
  if (auto it = meta.find("progress"); it != meta.end()) {
    if (!it->is_object()) format_error(what, "\"progress\" is not an object");
    index(*it, "global_step", &m.global_step);
    index(*it, "epoch", &m.epoch);
    index(*it, "batch_in_epoch", &m.batch_in_epoch);
    index(*it, "scheduler_steps", &m.scheduler_steps);
  }
  if (auto it = meta.find("optimizer"); it != meta.end()) {
    const json& om = *it;
    if (!om.is_object()) format_error(what, "\"optimizer\" is not an object");
    m.has_optimizer = true;
    str(om, "kind", &m.optimizer_kind, true);
    auto lrs = om.find("lrs");
    if (lrs == om.end() || !lrs->is_array())
      format_error(what, "\"optimizer\" has no \"lrs\" array");
    for (const auto& lr : *lrs) {
      if (!lr.is_number()) format_error(what, "\"optimizer.lrs\" holds a non-number " + lr.dump());
      m.lrs.push_back(lr.get<double>());
    }
    auto steps = om.find("steps");
    if (steps == om.end() || !steps->is_object()) {
      format_error(what, "\"optimizer\" has no \"steps\" object");
    }
    for (auto s = steps->begin(); s != steps->end(); ++s) {
      int64_t v = 0;
      if (!as_index(s.value(), &v)) {
        format_error(what,
                     "\"optimizer.steps\" of '" + s.key() + "' is not a non-negative integer");
      }
      m.optimizer_steps[s.key()] = v;
    }
  }
  if (auto it = meta.find("callbacks"); it != meta.end()) {
    if (!it->is_object()) format_error(what, "\"callbacks\" is not an object");
    m.callback_states = it->dump();
  }
  auto rng_states = [&](const char* one_key, const char* per_rank_key, std::vector<uint8_t>* one,
                        std::vector<std::vector<uint8_t>>* per_rank) {
    std::string rng;
    str(meta, one_key, &rng, false);
    *one = from_hex(rng, what + " \"" + one_key + "\"");
    auto it = meta.find(per_rank_key);
    if (it == meta.end()) return;
    if (!it->is_array() || static_cast<int64_t>(it->size()) != m.world_size) {
      format_error(what, std::string("\"") + per_rank_key + "\" is not an array of world_size (" +
                             std::to_string(m.world_size) + ") hex strings");
    }
    for (const auto& r : *it) {
      if (!r.is_string())
        format_error(what, std::string("\"") + per_rank_key + "\" holds a non-string");
      per_rank->push_back(from_hex(r.get<std::string>(), what + " \"" + per_rank_key + "\""));
    }
  };
  rng_states("rng_cpu", "rng_cpu_per_rank", &m.rng_cpu, &m.rng_cpu_per_rank);
  rng_states("rng_cuda", "rng_cuda_per_rank", &m.rng_cuda, &m.rng_cuda_per_rank);
  return m;
}

}  // namespace fsdp::ckpt
