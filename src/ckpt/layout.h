// Checkpoint internals shared by save, load and conversion.
//
// Note [Checkpoint layout]
// ------------------------
// Every tensor is handled as rows: a tensor of shape (d0, d1, ...) has d0 rows of d1*... elements;
// 0-d and 1-d tensors are rows of one element (0-d: one row), which is exactly how FSDP shards
// parameters (src/shard/fsdp_param.h). A tensor's rows live in one or more pieces, each a
// contiguous row range [begin, end) stored as its own safetensors entry (shape [end-begin,
// d1, ...], or [] for a 0-d tensor) under the tensor's key:
//   model tensors       key = FQN ("layers.0.ff.w1")
//   optimizer state     key = "optim.<FQN>.<stat>" (exp_avg, exp_avg_sq, max_exp_avg_sq,
//                       momentum_buffer), same rows as its parameter
// A full checkpoint has one piece per tensor (model.safetensors / optimizer.safetensors); a
// sharded one has the unpadded rows each rank held (shard-<r>-of-<W>.safetensors) and lists the
// pieces in metadata.json. A loader asks for the row range its rank holds and reads the
// overlapping part of every piece: that is resharding.
#pragma once

#include "ckpt/metadata.h"
#include "ckpt/safetensors.h"
#include "fsdp/comm.h"

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp::ckpt {

using json = nlohmann::json;

constexpr const char* kFullMetaFile = "meta.json";
constexpr const char* kShardedMetaFile = "metadata.json";
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kOptimPrefix = "optim.";
constexpr int kFormatVersion = 1;

DType to_dtype(at::ScalarType type);
at::ScalarType to_scalar_type(DType dtype);
std::string shard_file_name(int rank, int world);
// Shape of a piece of `rows` rows of a tensor of `full` shape.
std::vector<int64_t> piece_shape(const std::vector<int64_t>& full, int64_t rows);
// A checkpoint opened for reading: every file header and the piece table validated.
class Source {
 public:
  // A checkpoint directory (full or sharded) or a bare .safetensors file. Throws FormatError.
  explicit Source(const std::string& path);

  const std::string& path() const { return path_; }
  const std::string& type() const { return type_; }  // "full" | "sharded" | "safetensors"
  const json& meta() const { return meta_; }
  // Its typed, validated fields (type "safetensors": defaults, type left empty).
  const CheckpointMeta& info() const { return info_; }
  const std::map<std::string, SourceTensor>& tensors() const { return tensors_; }
  const SourceTensor* find(const std::string& key) const;

  // Rows [row_begin, row_begin + rows) of `key` into `dst` (contiguous, rows * row elements of
  // any dtype; converted when it differs from the file's).
  void read_rows(const std::string& key, int64_t row_begin, int64_t rows,
                 const at::Tensor& dst) const;
  // Reads one piece's bytes (for streaming conversion).
  void read_piece(const std::string& key, const Piece& piece, void* dst, size_t nbytes) const;

  // See Note [Checkpoint identity] in identity.h. Whether the metadata records the integrity
  // entry (every file then has checksums and identity, checked at open), and its run.
  bool has_integrity() const { return !save_id_.empty(); }
  const std::string& run_id() const { return run_id_; }
  bool has_checksums(const std::string& file) const { return reader(file).has_checksums(); }
  // Checks every piece's bytes against its recorded checksum (FormatError naming the file and
  // the tensor); returns the bytes checked. Pieces of files without checksums are skipped.
  int64_t verify_all() const;

 private:
  const SafetensorsReader& reader(const std::string& file) const;
  void check_identity();
  // The piece's checksum against `crc` (once per piece); verify_piece reads it to compute it.
  void check_piece(const std::string& key, const Piece& piece, uint32_t crc) const;
  void verify_piece(const std::string& key, const Piece& piece) const;
  bool piece_pending(const std::string& key, const Piece& piece) const;
  std::string run_id_, save_id_;
  mutable std::set<std::pair<std::string, std::string>> verified_;  // (file, key) checked
  std::string path_;
  std::string dir_;
  std::string type_;
  json meta_;
  CheckpointMeta info_;
  std::map<std::string, SourceTensor> tensors_;
  mutable std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;  // opened lazily
};

// libtorch 2.x keys optimizer state by the parameter's TensorImpl pointer.
void* state_key(const at::Tensor& p);
// (stat name, tensor) of one parameter's optimizer state (exp_avg, exp_avg_sq, max_exp_avg_sq,
// momentum_buffer: the tensors the optimizer holds, not copies); empty when it has none yet.
// *step is Adam's step count (0 for SGD).
std::vector<std::pair<std::string, at::Tensor>> optimizer_stats(torch::optim::Optimizer& opt,
                                                                const at::Tensor& p,
                                                                int64_t* step);

// Called after this rank wrote the first tensor of the save of `step`: runs the failure a test
// injected there (InjectedHooks::during_checkpoint_save), if any.
void maybe_crash_during_save(int rank, int64_t step);

}  // namespace fsdp::ckpt
