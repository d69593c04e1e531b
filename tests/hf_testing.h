// Helpers for the Hugging Face interop tests: scratch folders, tensors exchanged with the
// Python reference (tests/hf_reference.py) through safetensors files.
#pragma once

#include "ckpt/layout.h"
#include "ckpt/safetensors.h"
#include "testing.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <unistd.h>

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

// Note [Shared referee runs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ctest runs every test of a suite as its own process, so a suite fixture that asks Python for
// reference values (SetUpTestSuite) starts the same referee once per test: the Bnb suite
// (tests/test_quantization.cpp) imported torch and bitsandbytes and quantized the same tensors
// five times. run_hf_reference_shared runs `hf_reference.py <command> <in> <out>` and keeps its
// output under the build tree with what produced it: the input file, hf_reference.py and the
// pinned requirements (scripts/requirements*.txt, which pin torch, transformers, peft and
// bitsandbytes). A later call whose input, script, pins and interpreter are byte for byte the
// same copies the kept output instead of starting Python; anything else runs the referee again.
// The tests compare against the same referee output either way.
inline std::string read_file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return {};
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline void write_file_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline void run_hf_reference_shared(const std::string& name, const std::string& command,
                                    const std::string& in, const std::string& out) {
  namespace fs = std::filesystem;
  const std::string src(FSDP_SOURCE_DIR);
  const std::string key = std::string(FSDP_PYTHON) + '\n' + command + '\n' +
                          read_file_bytes(src + "/tests/hf_reference.py") + '\n' +
                          read_file_bytes(src + "/scripts/requirements.txt") + '\n' +
                          read_file_bytes(src + "/scripts/requirements-nobuild.txt");
  const std::string input = read_file_bytes(in);
  const fs::path kept = fs::path(FSDP_BIN_DIR) / ".." / "tests" / "hf_scratch" / "shared" / name;
  std::error_code ec;
  if (read_file_bytes((kept / "key").string()) == key &&
      read_file_bytes((kept / "in.safetensors").string()) == input &&
      fs::copy_file(kept / "out.safetensors", out, fs::copy_options::overwrite_existing, ec)) {
    return;
  }
  ProcResult r = run_hf_reference({command, in, out});
  if (r.exit_code != 0) return;
  // Published whole or not at all: written beside, then renamed. A kept run of other inputs is
  // replaced; when a parallel test published the same run first, the rename fails and that one
  // stays.
  if (fs::exists(kept / "key") && read_file_bytes((kept / "key").string()) != key) {
    fs::remove_all(kept, ec);
  }
  const fs::path tmp = kept.string() + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  write_file_bytes((tmp / "in.safetensors").string(), input);
  fs::copy_file(out, tmp / "out.safetensors", fs::copy_options::overwrite_existing, ec);
  write_file_bytes((tmp / "key").string(), key);  // last: a kept folder without it is never used
  fs::rename(tmp, kept, ec);
  if (ec) fs::remove_all(tmp, ec);
}

inline double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

}  // namespace fsdp::testing
