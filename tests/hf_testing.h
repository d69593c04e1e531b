// Helpers for the Hugging Face interop tests: scratch folders, tensors exchanged with the
// Python reference (tests/hf_reference.py) through safetensors files.
#pragma once

#include "ckpt/layout.h"
#include "ckpt/safetensors.h"
#include "testing.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::testing {

// A folder under the build tree named after the test; the same path in every rank of a
// run_ranks test (ranks re-execute the binary), emptied by the parent only (unless keep).
inline std::string hf_scratch(const std::string& name, bool keep = false) {
  namespace fs = std::filesystem;
  fs::path dir = fs::path(FSDP_BIN_DIR) / ".." / "tests" / "hf_scratch" / name;
  if (!in_child_rank() && !keep) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  return fs::weakly_canonical(dir).string();
}

inline void write_tensors(const std::string& path,
                          const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<ckpt::TensorSpec> specs;
  for (const auto& [name, t] : tensors) {
    specs.push_back({name, ckpt::to_dtype(t.scalar_type()), t.sizes().vec()});
  }
  ckpt::SafetensorsWriter writer(path, specs);
  for (const auto& [name, t] : tensors) {
    at::Tensor c = t.contiguous();
    writer.write(c.data_ptr(), static_cast<size_t>(c.nbytes()));
  }
  writer.commit();
}

inline std::map<std::string, at::Tensor> read_tensors(const std::string& path) {
  ckpt::SafetensorsReader reader(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& e : reader.header().tensors) {
    at::Tensor t = at::empty(e.shape, at::dtype(ckpt::to_scalar_type(e.dtype)));
    reader.read(e.name, t.data_ptr(), static_cast<size_t>(t.nbytes()));
    out[e.name] = t;
  }
  return out;
}

// Runs tests/hf_reference.py with `args` in the project's Python environment; fails the test
// (with Python's stderr) unless it exits 0.
inline ProcResult run_hf_reference(const std::vector<std::string>& args, double timeout_s = 600) {
  std::vector<std::string> argv = {FSDP_PYTHON, std::string(FSDP_SOURCE_DIR) + "/tests/hf_reference.py"};
  argv.insert(argv.end(), args.begin(), args.end());
  ProcResult r = run_process(argv, {{"PYTHONWARNINGS", "ignore"}, {"OMP_NUM_THREADS", "1"}},
                             timeout_s);
  EXPECT_EQ(r.exit_code, 0) << "hf_reference.py " << (args.empty() ? "" : args[0]) << " failed:\n"
                            << r.err.substr(r.err.size() > 4000 ? r.err.size() - 4000 : 0);
  return r;
}

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace fsdp::testing
