// HfWeights: tensors of a Hugging Face model folder. See hf_weights.h.
#include "hf/hf_weights.h"

#include "ckpt/layout.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace fsdp::detail {

namespace fs = std::filesystem;

HfWeights::HfWeights(const std::string& dir, const std::string& file) : dir_(dir) {
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / (file.empty() ? "model.safetensors" : file);
  if (!file.empty()) {
    TORCH_CHECK(fs::exists(single), "[hf] '", dir, "' has no ", file);
    for (const auto& e : reader(file).header().tensors) file_of_[e.name] = file;
  } else if (fs::exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ckpt::read_file(index.string()));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "[hf] ", index.string(), " is not valid JSON: ", e.what());
    }
    TORCH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "[hf] ",
                index.string(), " has no \"weight_map\" object");
    for (auto& [name, file] : j["weight_map"].items()) {
      TORCH_CHECK(file.is_string(), "[hf] ", index.string(), ": weight_map[\"", name,
                  "\"] is not a file name");
      const std::string f = file.get<std::string>();
      TORCH_CHECK(f.find('/') == std::string::npos && f.find("..") == std::string::npos,
                  "[hf] ", index.string(), ": shard file '", f,
                  "' must be a plain file name inside the folder");
      file_of_[name] = f;
    }
  } else if (fs::exists(single)) {
    for (const auto& e : reader("model.safetensors").header().tensors) {
      file_of_[e.name] = "model.safetensors";
    }
  } else {
    TORCH_CHECK(false, "[hf] '", dir, "' holds neither model.safetensors nor "
                "model.safetensors.index.json; pass a folder written by save_pretrained (.bin "
                "pickle checkpoints are not read: safetensors only)");
  }
}

const ckpt::SafetensorsReader& HfWeights::reader(const std::string& file) const {
  auto it = readers_.find(file);
  if (it == readers_.end()) {
    try {
      it = readers_.emplace(file, std::make_unique<ckpt::SafetensorsReader>(
                                      (fs::path(dir_) / file).string())).first;
    } catch (const ckpt::FormatError& e) {
      TORCH_CHECK(false, "[hf] ", e.what());
    }
  }
  return *it->second;
}

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : file_of_) out.push_back(name);
  return out;
}

const ckpt::TensorEntry& HfWeights::entry(const std::string& name) const {
  auto it = file_of_.find(name);
  TORCH_CHECK(it != file_of_.end(), "[hf] tensor '", name, "' is in no safetensors file of '",
              dir_, "'; the folder does not hold this model (check config.json against the "
              "weights, e.g. tie_word_embeddings)");
  try {
    return reader(it->second).entry(name);
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[hf] ", e.what());
    throw;
  }
}

at::Tensor HfWeights::read(const std::string& name) const {
  const ckpt::TensorEntry& e = entry(name);
  at::Tensor out = at::empty(e.shape, at::dtype(ckpt::to_scalar_type(e.dtype)));
  try {
    reader(file_of_.at(name)).read(name, out.data_ptr(), static_cast<size_t>(out.nbytes()));
  } catch (const ckpt::FormatError& e) {
    TORCH_CHECK(false, "[hf] ", e.what());
  }
  used_.insert(name);
  return out;
}

void HfWeights::read_into(const std::string& name, const at::Tensor& dst) const {
  const ckpt::TensorEntry& e = entry(name);
  TORCH_CHECK(dst.sizes().vec() == e.shape, "[hf] tensor '", name, "' has shape ",
              ckpt::shape_str(e.shape), " in '", dir_, "' but the model expects ", dst.sizes(),
              "; config.json does not match the weights");
  at::NoGradGuard no_grad;
  at::Tensor target = dst.variable_data();
  if (target.scalar_type() == ckpt::to_scalar_type(e.dtype) && target.is_contiguous()) {
    try {
      reader(file_of_.at(name)).read(name, target.data_ptr(), static_cast<size_t>(target.nbytes()));
    } catch (const ckpt::FormatError& err) {
      TORCH_CHECK(false, "[hf] ", err.what());
    }
    used_.insert(name);
    return;
  }
  target.copy_(read(name));
}

std::vector<std::string> HfWeights::unused() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : file_of_) {
    if (!used_.count(name)) out.push_back(name);
  }
  return out;
}

}  // namespace fsdp::detail
