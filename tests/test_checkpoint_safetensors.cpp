// safetensors writer/reader: round trip, streaming in pieces, row reads, atomic replace, and a
// clear FormatError (never a crash) for every kind of damaged file.
#include "ckpt/safetensors.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace fs = std::filesystem;
using namespace fsdp::ckpt;

namespace {

std::string scratch(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("fsdp_st_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return (dir / name).string();
}

std::vector<float> iota(size_t n, float start) {
  std::vector<float> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

// Writes a: F32 [3, 4] = 0..11 and b: I64 [5] = 100..104.
void write_sample(const std::string& path) {
  SafetensorsWriter w(path, {{"a", DType::kF32, {3, 4}}, {"b", DType::kI64, {5}}},
                      {{"step", "7"}});
  auto a = iota(12, 0);
  w.write(a.data(), 5 * 4);  // in pieces, across no tensor boundary
  w.write(a.data() + 5, 7 * 4);
  std::vector<int64_t> b = {100, 101, 102, 103, 104};
  w.write(b.data(), b.size() * 8);
  w.commit();
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void put(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}
std::string with_header(const std::string& header_json, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header_json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header_json + std::string(data_bytes, '\x01');
}
std::string error_of(const std::string& path) {
  try {
    SafetensorsReader r(path);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripStreamedAndHeaderIsStandard) {
  std::string path = scratch("rt.safetensors");
  write_sample(path);
  SafetensorsReader r(path);
  ASSERT_EQ(r.header().tensors.size(), 2u);
  EXPECT_EQ(r.header().metadata.at("step"), "7");
  EXPECT_EQ(r.entry("a").shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(r.entry("b").dtype, DType::kI64);
  std::vector<float> a(12);
  r.read("a", a.data(), 48);
  EXPECT_EQ(a, iota(12, 0));
  std::vector<float> rows(8);
  r.read_rows("a", 1, 2, rows.data(), 32);
  EXPECT_EQ(rows, iota(8, 4));
  std::vector<int64_t> b(5);
  r.read("b", b.data(), 40);
  EXPECT_EQ(b[4], 104);
  // Header padded to 8 bytes, data section exactly the tensors.
  EXPECT_EQ(r.header().data_start % 8, 0u);
  EXPECT_EQ(r.header().data_size, 48u + 40u);
  EXPECT_THROW(r.read_rows("a", 2, 2, rows.data(), 32), FormatError);
  try {
    r.entry("missing");
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor 'missing'"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, IndependentPythonReaderAgrees) {
  std::string path = scratch("py.safetensors");
  write_sample(path);
  std::string script = std::string(FSDP_SOURCE_DIR) + "/tests/read_safetensors.py";
  auto res = fsdp::testing::run_process({FSDP_PYTHON, script, path});
  ASSERT_EQ(res.exit_code, 0) << res.err;
  auto doc = nlohmann::json::parse(res.out);
  EXPECT_EQ(doc["metadata"]["step"], "7");
  EXPECT_EQ(doc["tensors"]["a"]["shape"], nlohmann::json({3, 4}));
  for (int i = 0; i < 12; ++i) EXPECT_EQ(doc["tensors"]["a"]["values"][i].get<double>(), i);
  EXPECT_EQ(doc["tensors"]["b"]["values"][2].get<double>(), 102);
}

TEST(Safetensors, UncommittedWriterLeavesPreviousFile) {
  std::string path = scratch("atomic.safetensors");
  write_sample(path);
  std::string before = bytes_of(path);
  {
    SafetensorsWriter w(path, {{"z", DType::kF32, {1000}}});
    std::vector<float> half(500, 1.f);
    w.write(half.data(), 2000);
    EXPECT_THROW(w.commit(), FormatError);  // incomplete
  }  // destroyed without commit
  EXPECT_EQ(bytes_of(path), before);
  for (const auto& e : fs::directory_iterator(fs::path(path).parent_path())) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  }
  SafetensorsWriter w(path, {{"z", DType::kF32, {2}}});
  std::vector<float> three(3, 0.f);
  EXPECT_THROW(w.write(three.data(), 12), FormatError);  // more than declared
}

TEST(Safetensors, TruncatedFilesAreClearErrors) {
  std::string path = scratch("trunc.safetensors");
  write_sample(path);
  std::string good = bytes_of(path);
  std::string bad = scratch("bad.safetensors");
  // Every truncation point: an error, never a crash.
  for (size_t cut = 0; cut < good.size(); ++cut) {
    put(bad, good.substr(0, cut));
    std::string err = error_of(bad);
    EXPECT_FALSE(err.empty()) << "cut at " << cut << " accepted";
  }
  put(bad, good.substr(0, good.size() - 4));
  EXPECT_NE(error_of(bad).find("tensor 'b' offsets [48, 88) exceed the data section of 84 bytes; "
                               "the file is truncated or corrupt"),
            std::string::npos)
      << error_of(bad);
  put(bad, good.substr(0, 5));
  EXPECT_NE(error_of(bad).find("less than the 8-byte header length"), std::string::npos);
}

TEST(Safetensors, CorruptHeadersNameTheProblem) {
  std::string bad = scratch("corrupt.safetensors");
  struct Case {
    std::string header;
    size_t data;
    std::string expect;
  };
  std::vector<Case> cases = {
      {"{not json", 0, "not valid JSON"},
      {"[1,2]", 0, "not an object"},
      {R"({"w":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", 8, "unknown dtype \"F99\""},
      {R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8,
       "tensor 'w' shape [3] x F32 is 12 bytes but its offsets [0, 8) span 8"},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "negative dimension"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "end before they begin"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"v":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, "overlap"},
      {R"({"w":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", 8,
       "too large"},
      {R"({"w":{"dtype":"F32","shape":[2]}})", 8, "lacks one of"},
      {R"({"__metadata__":{"k":3}})", 0, "is not a string"},
  };
  for (const auto& c : cases) {
    put(bad, with_header(c.header, c.data));
    std::string err = error_of(bad);
    EXPECT_NE(err.find(c.expect), std::string::npos) << c.header << " -> " << err;
    EXPECT_NE(err.find("corrupt.safetensors"), std::string::npos) << err;  // names the file
  }
  // Header length larger than the file.
  std::string big(8, '\0');
  big[0] = '\x40';
  put(bad, big + "{}");
  EXPECT_NE(error_of(bad).find("header length 64 exceeds"), std::string::npos) << error_of(bad);
  // A zero-size tensor with a huge dimension is valid (no overflow).
  put(bad, with_header(R"({"e":{"dtype":"F32","shape":[0,4611686018427387904],"data_offsets":[0,0]}})", 0));
  EXPECT_EQ(error_of(bad), "");
}
