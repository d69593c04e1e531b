// save_safetensors: named tensors to one safetensors file. See include/fsdp/checkpoint.h.
#include "fsdp/checkpoint.h"

#include "ckpt/layout.h"

#include <c10/util/Exception.h>

namespace fsdp {

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<ckpt::TensorSpec> specs;
  std::vector<at::Tensor> data;  // contiguous CPU copies (or the tensors themselves)
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(t.defined(), "[save_safetensors] tensor '", name, "' is undefined (writing ",
                path, ")");
    data.push_back(t.detach().to(at::kCPU).contiguous());
    specs.push_back({name, ckpt::to_dtype(t.scalar_type()),
                     std::vector<int64_t>(t.sizes().begin(), t.sizes().end())});
  }
  ckpt::SafetensorsWriter w(path, specs, metadata);
  for (const auto& t : data) w.write(t.data_ptr(), static_cast<size_t>(t.nbytes()));
  w.commit();
}

}  // namespace fsdp
