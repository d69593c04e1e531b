// inspect_checkpoint and the streaming converters behind `fsdp-ckpt`.
#include "ckpt/identity.h"
#include "ckpt/layout.h"
#include "ckpt/output.h"
#include "ckpt/tools.h"
#include "fsdp/checkpoint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <vector>

namespace fsdp {

namespace fs = std::filesystem;
using ckpt::json;

namespace {

std::unique_ptr<ckpt::Source> open_source(const std::string& path, const char* who) {
  try {
    return std::make_unique<ckpt::Source>(path);
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[", who, "] ", e.what());
  }
}

int64_t row_nbytes(const ckpt::SourceTensor& t) {
  int64_t n = ckpt::dtype_itemsize(t.dtype);
  for (size_t i = 1; i < t.shape.size(); ++i) n *= t.shape[i];
  return n;
}

bool is_model_key(const std::string& key) { return key.rfind(ckpt::kOptimPrefix, 0) != 0; }

// Rows [b, e) of `key` from `src`, appended to `w` piece by piece. `buf` (a byte tensor, so the
// tracking allocator sees it) grows to the largest piece streamed: memory stays bounded by it.
void stream_rows(const ckpt::Source& src, const std::string& key, int64_t b, int64_t e,
                 ckpt::SafetensorsWriter& w, at::Tensor& buf) {
  const ckpt::SourceTensor& t = *src.find(key);
  const int64_t rb = row_nbytes(t);
  for (const auto& p : t.pieces) {
    const int64_t lo = std::max(p.begin, b), hi = std::min(p.end, e);
    if (lo >= hi) continue;
    const int64_t n = (hi - lo) * rb;
    if (!buf.defined() || buf.numel() < n) {
      buf = at::Tensor();  // the smaller buffer goes first: never two alive
      buf = at::empty({n}, at::kByte);
    }
    if (lo == p.begin && hi == p.end) {
      src.read_piece(key, p, buf.data_ptr(), static_cast<size_t>(n));
    } else {
      // Part of a piece: a row read in the file's own dtype (no conversion).
      const int64_t row_numel = rb / ckpt::dtype_itemsize(t.dtype);
      src.read_rows(key, lo, hi - lo,
                    at::from_blob(buf.data_ptr(), {(hi - lo) * row_numel},
                                  at::TensorOptions().dtype(ckpt::to_scalar_type(t.dtype))));
    }
    w.write(buf.data_ptr(), static_cast<size_t>(n));
  }
}

}  // namespace

CheckpointInfo inspect_checkpoint(const std::string& path) {
  ckpt::verify_checkpoint(path, "fsdp-ckpt inspect");  // a damaged checkpoint is an error
  auto src = open_source(path, "fsdp-ckpt inspect");
  CheckpointInfo info;
  info.type = src->type();
  const ckpt::CheckpointMeta& m = src->info();
  info.world_size = static_cast<int>(m.world_size);
  info.strategy = m.strategy;
  info.progress.global_step = m.global_step;
  info.progress.epoch = m.epoch;
  info.progress.batch_in_epoch = m.batch_in_epoch;
  info.progress.scheduler_steps = m.scheduler_steps;
  for (const auto& [k, t] : src->tensors()) {
    info.tensors.push_back({k, ckpt::dtype_name(t.dtype), t.shape,
                            static_cast<int64_t>(t.pieces.size())});
  }
  return info;
}

void convert_to_safetensors(const std::string& checkpoint_dir, const std::string& out_file) {
  ckpt::convert_to_safetensors(checkpoint_dir, out_file, /*overwrite=*/false);
}

void convert_to_sharded(const std::string& checkpoint_dir, const std::string& out_dir,
                        int world_size) {
  ckpt::convert_to_sharded(checkpoint_dir, out_dir, world_size, /*overwrite=*/false);
}

namespace ckpt {

namespace {
constexpr const char* kConvert = "[fsdp-ckpt convert]";

// See Note [Writers never destroy] in output.h.
void check_convert_output(const std::string& in, const std::string& out, OutputKind kind,
                          bool overwrite) {
  const std::string problem = output_problem(in, out, kind, overwrite, "--overwrite");
  TORCH_CHECK(problem.empty(), kConvert, " ", problem);
}
}  // namespace

VerifyReport verify_checkpoint(const std::string& path, const char* who) {
  auto src = open_source(path, who);
  VerifyReport r;
  r.type = src->type();
  r.run_id = src->run_id();
  r.global_step = src->info().global_step;
  r.world_size = src->info().world_size;
  r.tensors = static_cast<int64_t>(src->tensors().size());
  std::set<std::string> files;
  for (const auto& [k, t] : src->tensors()) {
    for (const auto& p : t.pieces) files.insert(p.file);
  }
  r.files = static_cast<int64_t>(files.size());
  try {
    r.bytes_checked = src->verify_all();
  } catch (const FormatError& e) {
    TORCH_CHECK(false, "[", who, "] ", e.what());
  }
  // Pieces of files without checksums were skipped: the checkpoint verified only if none was.
  r.checksums = src->has_integrity();
  if (src->type() == "safetensors") {
    r.checksums = true;
    for (const auto& f : files) r.checksums = r.checksums && src->has_checksums(f);
  }
  return r;
}

void convert_to_safetensors(const std::string& checkpoint_dir, const std::string& out_file,
                            bool overwrite) {
  check_convert_output(checkpoint_dir, out_file, OutputKind::kSafetensorsFile, overwrite);
  auto src = open_source(checkpoint_dir, "fsdp-ckpt convert");
  std::vector<ckpt::TensorSpec> specs;
  for (const auto& [k, t] : src->tensors()) {
    if (is_model_key(k)) specs.push_back({k, t.dtype, t.shape});
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
  if (src->type() != "safetensors") {
    metadata["global_step"] = std::to_string(src->info().global_step);
  }
  ckpt::SafetensorsWriter w(out_file, specs, metadata, /*checksums=*/true);
  at::Tensor buf;
  for (const auto& s : specs) {
    stream_rows(*src, s.name, 0, ckpt::dim0_of(s.shape), w, buf);
  }
  w.commit();
}

void convert_to_sharded(const std::string& checkpoint_dir, const std::string& out_dir,
                        int world_size, bool overwrite) {
  TORCH_CHECK(world_size >= 1, kConvert, " --world must be >= 1 (got ", world_size, ")");
  check_convert_output(checkpoint_dir, out_dir, OutputKind::kCheckpointDir, overwrite);
  auto src = open_source(checkpoint_dir, "fsdp-ckpt convert");
  StagingDir staging(out_dir, kConvert);
  const fs::path& partial = staging.path();

  // The FSDP split: R = ceil(dim0 / W) rows per rank, the last ranks short or empty.
  auto rows_of = [&](const ckpt::SourceTensor& t, int r) {
    const int64_t dim0 = ckpt::dim0_of(t.shape);
    const int64_t R = (dim0 + world_size - 1) / world_size;
    const int64_t b = std::min<int64_t>(r * R, dim0);
    return std::make_pair(b, std::min<int64_t>(b + R, dim0));
  };
  json table = json::object();
  for (const auto& [k, t] : src->tensors()) {
    json pieces = json::array();
    for (int r = 0; r < world_size; ++r) {
      auto [b, e] = rows_of(t, r);
      if (e > b) pieces.push_back(json{{"file", ckpt::shard_file_name(r, world_size)}, {"rows", {b, e}}});
    }
    table[k] = {{"shape", t.shape}, {"dtype", ckpt::dtype_name(t.dtype)}, {"pieces", pieces}};
  }
  // See Note [Checkpoint identity]: the run of the input (a fresh one for a checkpoint that
  // records none), a save of its own.
  Identity id;
  id.run_id = src->run_id().empty() ? random_id() : src->run_id();
  id.save_id = random_id();
  id.step = src->info().global_step;
  id.world_size = world_size;
  id.shards = world_size;
  at::Tensor buf;
  for (int r = 0; r < world_size; ++r) {
    std::vector<ckpt::TensorSpec> specs;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const auto& [k, t] : src->tensors()) {
      auto [b, e] = rows_of(t, r);
      if (e <= b) continue;
      specs.push_back({k, t.dtype, ckpt::piece_shape(t.shape, e - b)});
      ranges.emplace_back(b, e);
    }
    id.shard = r;
    ckpt::SafetensorsWriter w((partial / ckpt::shard_file_name(r, world_size)).string(), specs,
                              identity_metadata(id), /*checksums=*/true);
    for (size_t i = 0; i < specs.size(); ++i) {
      stream_rows(*src, specs[i].name, ranges[i].first, ranges[i].second, w, buf);
    }
    w.commit();
  }
  json meta = src->meta().is_object() ? src->meta() : json::object();
  meta["format"] = "fsdp.cpp checkpoint";
  meta["format_version"] = ckpt::kFormatVersion;
  meta["type"] = "sharded";
  // Per-rank RNG states only mean something at the world size they were saved at.
  if (src->info().world_size != world_size) {
    meta.erase("rng_cpu_per_rank");
    meta.erase("rng_cuda_per_rank");
  }
  meta["world_size"] = world_size;
  meta["converted_from"] = src->type();
  meta["tensors"] = table;
  meta["integrity"] = {{"checksum", "crc32"}, {"run_id", id.run_id}, {"save_id", id.save_id}};
  ckpt::write_file_atomic((partial / ckpt::kShardedMetaFile).string(), meta.dump(1));
  // Checked again: the output may have changed while this ran.
  check_convert_output(checkpoint_dir, out_dir, OutputKind::kCheckpointDir, overwrite);
  staging.publish();
}

}  // namespace ckpt
}  // namespace fsdp
