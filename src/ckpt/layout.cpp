// Checkpoint sources: format detection, validation of the piece table, row reads.
// See Note [Checkpoint layout] in layout.h.
#include "ckpt/layout.h"

#include "ckpt/identity.h"
#include "common/injected_hooks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <regex>
#include <sstream>

namespace fsdp::ckpt {

namespace fs = std::filesystem;

DType to_dtype(at::ScalarType type) {
  switch (type) {
    case at::kDouble: return DType::kF64;
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    case at::kLong: return DType::kI64;
    case at::kInt: return DType::kI32;
    case at::kShort: return DType::kI16;
    case at::kChar: return DType::kI8;
    case at::kByte: return DType::kU8;
    case at::kBool: return DType::kBool;
    default: break;
  }
  TORCH_CHECK(false, "[checkpoint] tensors of dtype ", type, " cannot be saved in safetensors "
              "here (supported: float64/32/16, bfloat16, int64/32/16/8, uint8, bool)");
}

at::ScalarType to_scalar_type(DType dtype) {
  switch (dtype) {
    case DType::kF64: return at::kDouble;
    case DType::kF32: return at::kFloat;
    case DType::kF16: return at::kHalf;
    case DType::kBF16: return at::kBFloat16;
    case DType::kI64: return at::kLong;
    case DType::kI32: return at::kInt;
    case DType::kI16: return at::kShort;
    case DType::kI8: return at::kChar;
    case DType::kU8: return at::kByte;
    case DType::kBool: return at::kBool;
  }
  return at::kFloat;
}

std::string shard_file_name(int rank, int world) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

std::vector<int64_t> piece_shape(const std::vector<int64_t>& full, int64_t rows) {
  if (full.empty()) return {};
  std::vector<int64_t> s = full;
  s[0] = rows;
  return s;
}

namespace {

void add_whole_file(const SafetensorsReader& r, const std::string& file,
                    std::map<std::string, SourceTensor>& out) {
  for (const auto& e : r.header().tensors) {
    SourceTensor t;
    t.shape = e.shape;
    t.dtype = e.dtype;
    t.pieces.push_back({file, 0, dim0_of(e.shape)});
    out[e.name] = std::move(t);
  }
}

}  // namespace

Source::Source(const std::string& path) : path_(path) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    type_ = "safetensors";
    dir_ = fs::path(path).parent_path().string();
    std::string file = fs::path(path).filename().string();
    readers_[file] = std::make_unique<SafetensorsReader>(path);
    add_whole_file(*readers_[file], file, tensors_);
    meta_ = json::object();
    for (const auto& [k, v] : readers_[file]->header().metadata) meta_[k] = v;
    return;
  }
  dir_ = path;
  fs::path sharded = fs::path(path) / kShardedMetaFile;
  fs::path full = fs::path(path) / kFullMetaFile;
  if (fs::exists(sharded, ec)) {
    type_ = "sharded";
    meta_ = parse_json_object(read_file(sharded.string()), sharded.string());
    tensors_ = parse_sharded_tensors(meta_, sharded.string());
    info_ = parse_checkpoint_meta(meta_, sharded.string());
  } else if (fs::exists(full, ec)) {
    type_ = "full";
    meta_ = parse_json_object(read_file(full.string()), full.string());
    info_ = parse_checkpoint_meta(meta_, full.string());
    if (info_.type != "full") format_error(full.string(), "\"type\" is not \"full\"");
    for (const char* f : {kModelFile, kOptimizerFile}) {
      fs::path p = fs::path(path) / f;
      if (std::string(f) == kOptimizerFile && !fs::exists(p, ec)) continue;
      readers_[f] = std::make_unique<SafetensorsReader>(p.string());
      add_whole_file(*readers_[f], f, tensors_);
    }
  } else {
    throw FormatError(path + ": not a checkpoint: no " + kFullMetaFile + " (full) or " +
                      kShardedMetaFile + " (sharded) in it; pass a directory written by "
                      "save_checkpoint (e.g. <checkpoint-dir>/last) or a .safetensors file");
  }

  // Open every file a piece names and check that it holds that piece (validated headers).
  for (const auto& [key, t] : tensors_) {
    for (const auto& p : t.pieces) {
      const SafetensorsReader& r = reader(p.file);
      const TensorEntry& e = r.entry(key);
      std::vector<int64_t> want = piece_shape(t.shape, p.end - p.begin);
      if (e.shape != want || e.dtype != t.dtype) {
        format_error(r.path(), "tensor '" + key + "' is " + shape_str(e.shape) + " " +
                                   dtype_name(e.dtype) + " but the metadata says rows [" +
                                   std::to_string(p.begin) + ", " + std::to_string(p.end) +
                                   ") of " + shape_str(t.shape) + " " + dtype_name(t.dtype) +
                                   " (" + shape_str(want) +
                                   "); the checkpoint files do not belong together");
      }
    }
  }
  check_identity();
}

void Source::check_identity() {
  const std::string what = (fs::path(dir_) / (type_ == "full" ? kFullMetaFile
                                                              : kShardedMetaFile)).string();
  auto it = meta_.find("integrity");
  if (type_ == "safetensors" || it == meta_.end()) return;  // written before the record
  const json& in = *it;
  auto field = [&](const char* key) {
    auto f = in.find(key);
    if (f == in.end() || !f->is_string() || f->get<std::string>().empty()) {
      format_error(what,
                   std::string("\"integrity\" lacks \"") + key + "\"; the metadata is corrupt");
    }
    return f->get<std::string>();
  };
  if (field("checksum") != "crc32") {
    format_error(what, "\"integrity\" names checksum '" + field("checksum") +
                           "', which this version does not know (it knows crc32); read it with "
                           "the fsdp.cpp that wrote it");
  }
  run_id_ = field("run_id");
  save_id_ = field("save_id");
  const std::string mine = "run " + run_id_ + " step " + std::to_string(info_.global_step) +
                           ", save " + save_id_;
  static const std::regex shard_re("shard-([0-9]+)-of-([0-9]+)\\.safetensors");
  for (const auto& [file, r] : readers_) {
    const SafetensorsHeader& h = r->header();
    if (!r->has_checksums() || !h.metadata.count("fsdp.save_id")) {
      format_error(r->path(), "has no checksums and no identity, but " + what +
          " says every file of this checkpoint has them: the file comes from another (older) "
          "checkpoint; put back the file saved with this one, or load the checkpoint it "
          "belongs to");
    }
    if (h.metadata.at("fsdp.save_id") != save_id_) {
      format_error(r->path(), "belongs to another checkpoint (" + describe_identity(h) + ") than " +
          what + " (" + mine + "): the files of two checkpoints are mixed; put back the file "
          "saved with this one, or load the checkpoint it belongs to");
    }
    std::smatch m;
    const std::string want = std::regex_match(file, m, shard_re)
                                 ? m[1].str() + "/" + m[2].str()
                                 : std::string("0/1");
    auto shard = h.metadata.find("fsdp.shard");
    if (shard == h.metadata.end() || shard->second != want) {
      format_error(r->path(), "holds shard " + (shard == h.metadata.end() ? "?" : shard->second) +
          " of its checkpoint but is named for shard " + want + ": files were renamed; give "
          "each shard file its own name back");
    }
  }
}

bool Source::piece_pending(const std::string& key, const Piece& piece) const {
  return reader(piece.file).has_checksums() && !verified_.count({piece.file, key});
}

void Source::check_piece(const std::string& key, const Piece& piece, uint32_t crc) const {
  const SafetensorsReader& r = reader(piece.file);
  const uint32_t want = r.recorded_crc32(key);
  if (crc != want) {
    const SourceTensor& t = tensors_.at(key);
    format_error(r.path(), "tensor '" + key + "' (rows [" + std::to_string(piece.begin) + ", " +
        std::to_string(piece.end) + ") of " + shape_str(t.shape) + " " + dtype_name(t.dtype) +
        ") does not match its checksum (recorded crc32 " + crc32_hex(want) + ", read " +
        crc32_hex(crc) + "): the file is damaged; restore it from a copy, or load an earlier "
        "checkpoint");
  }
  verified_.insert({piece.file, key});
}

void Source::verify_piece(const std::string& key, const Piece& piece) const {
  if (!piece_pending(key, piece)) return;
  check_piece(key, piece, reader(piece.file).crc32_of(key));
}

int64_t Source::verify_all() const {
  int64_t bytes = 0;
  for (const auto& [key, t] : tensors_) {
    for (const auto& p : t.pieces) {
      if (!reader(p.file).has_checksums()) continue;
      const TensorEntry& e = reader(p.file).entry(key);
      verified_.erase({p.file, key});  // checked again, from the disk
      verify_piece(key, p);
      bytes += static_cast<int64_t>(e.end - e.begin);
    }
  }
  return bytes;
}

const SourceTensor* Source::find(const std::string& key) const {
  auto it = tensors_.find(key);
  return it == tensors_.end() ? nullptr : &it->second;
}

const SafetensorsReader& Source::reader(const std::string& file) const {
  auto it = readers_.find(file);
  if (it != readers_.end()) return *it->second;
  // Opened on first use (a cache: reading does not change the checkpoint).
  auto reader = std::make_unique<SafetensorsReader>((fs::path(dir_) / file).string());
  return *readers_.emplace(file, std::move(reader)).first->second;
}

void Source::read_piece(const std::string& key, const Piece& piece, void* dst,
                        size_t nbytes) const {
  const SafetensorsReader& r = reader(piece.file);
  r.read(key, dst, nbytes);
  if (piece_pending(key, piece)) check_piece(key, piece, crc32_update(0, dst, nbytes));
}

void Source::read_rows(const std::string& key, int64_t row_begin, int64_t rows,
                       const at::Tensor& dst) const {
  const SourceTensor* t = find(key);
  TORCH_INTERNAL_ASSERT(t, "read_rows of unknown key ", key);
  TORCH_INTERNAL_ASSERT(dst.is_contiguous());
  const int64_t dim0 = dim0_of(t->shape);
  TORCH_INTERNAL_ASSERT(row_begin >= 0 && row_begin + rows <= dim0);
  if (rows == 0) return;
  const int64_t row_numel = dim0 == 0 ? 0 : [&] {
    int64_t n = 1;
    for (size_t i = 1; i < t->shape.size(); ++i) n *= t->shape[i];
    return n;
  }();
  TORCH_INTERNAL_ASSERT(dst.numel() == rows * row_numel, "read_rows: destination of ",
                        dst.numel(), " elements for ", rows, " rows of ", row_numel);
  const at::ScalarType file_type = to_scalar_type(t->dtype);
  // Read straight into dst when it is host memory of the file's dtype; else through a host
  // buffer (another dtype, or a device tensor).
  const bool direct = dst.scalar_type() == file_type && dst.is_cpu();
  at::Tensor flat = dst.view({-1});
  for (const auto& p : t->pieces) {
    const int64_t lo = std::max(p.begin, row_begin);
    const int64_t hi = std::min(p.end, row_begin + rows);
    if (lo >= hi) continue;
    at::Tensor out = flat.narrow(0, (lo - row_begin) * row_numel, (hi - lo) * row_numel);
    at::Tensor buf = direct ? out
                            : at::empty({(hi - lo) * row_numel},
                                        dst.options().dtype(file_type).device(at::kCPU));
    // See Note [Checkpoint identity]: a whole piece is checked from what was read, part of
    // one by reading the piece once.
    const bool whole = lo == p.begin && hi == p.end;
    if (!whole) verify_piece(key, p);
    const size_t nbytes = static_cast<size_t>(buf.numel() * buf.element_size());
    reader(p.file).read_rows(key, lo - p.begin, hi - lo, buf.data_ptr(), nbytes);
    if (whole && piece_pending(key, p)) check_piece(key, p, crc32_update(0, buf.data_ptr(), nbytes));
    if (!direct) out.copy_(buf);
  }
}

void maybe_crash_during_save(int rank, int64_t step) {
  // See Note [Injected hooks] in src/common/injected_hooks.h.
  const auto& hook = detail::injected_hooks().during_checkpoint_save;
  if (hook) hook(rank, step);
}

}  // namespace fsdp::ckpt
