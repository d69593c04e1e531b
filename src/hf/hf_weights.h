// The tensors of a Hugging Face model folder, by name, across its safetensors files.
#pragma once

#include "ckpt/safetensors.h"

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace fsdp::detail {

class HfWeights {
 public:
  // `dir` holds model.safetensors or model.safetensors.index.json (+ its shard files), or, when
  // `file` is given, that one safetensors file (e.g. adapter_model.safetensors). Every file's
  // header is validated when it is opened (Note [Validate before touching memory]).
  explicit HfWeights(const std::string& dir, const std::string& file = "");

  const std::string& dir() const { return dir_; }
  bool has(const std::string& name) const { return file_of_.count(name) > 0; }
  std::vector<std::string> names() const;
  // The file's entry for `name` (dtype, shape); a clear error when no file holds it.
  const ckpt::TensorEntry& entry(const std::string& name) const;
  // A new tensor in the file's dtype.
  at::Tensor read(const std::string& name) const;
  // Reads `name` into `dst` (same shape, any dtype: converted), through dst.variable_data()
  // under no-grad, so a parameter keeps its identity and version. Marks `name` as used.
  void read_into(const std::string& name, const at::Tensor& dst) const;
  // Names never read (for the "unexpected tensors" report).
  std::vector<std::string> unused() const;

 private:
  const ckpt::SafetensorsReader& reader(const std::string& file) const;
  std::string dir_;
  std::map<std::string, std::string> file_of_;  // tensor name -> file name in dir_
  mutable std::map<std::string, std::unique_ptr<ckpt::SafetensorsReader>> readers_;
  mutable std::set<std::string> used_;
};

}  // namespace fsdp::detail
