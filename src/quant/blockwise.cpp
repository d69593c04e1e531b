// Code books and block-wise 8-bit quantization, as bitsandbytes computes them on CPU.
// See Note [NF4 and double quantization] in include/fsdp/quantization.h.
#include "fsdp/quantization.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <mutex>
#include <vector>

namespace fsdp::quant {
namespace {

// Note [Block-wise 8-bit lookup]
// ------------------------------
// bitsandbytes' CPU kernel (csrc/cpu_ops.cpp, quantize_cpu_impl) does not search the code book
// per element: it discretizes [-1, 1] into 65536 points, v_i = -1 + 2i/65535 (fp32), and maps
// each to the first code whose upper midpoint 0.5*(c_k + c_{k+1}) is not below v_i. An element
// x of a block with absmax m is then looked up at index trunc(((x*(1/m) clamped to [-1, 1]) +
// 1) * 0.5 * 65535 + 0.5), all in fp32. This is not always the nearest code (e.g. 0.0 maps to
// the code nearest to v_32768 = 1.5e-5, the dynamic map's 2.1e-5, not to 0.0): being exact
// means doing the same. A block whose absmax is 0 stores index 0 everywhere.
constexpr int kLutSize = 65536;

std::vector<uint8_t> build_lut(const float* code) {
  std::array<float, 255> mid;
  for (int i = 0; i < 255; ++i) mid[i] = 0.5f * (code[i] + code[i + 1]);
  std::vector<uint8_t> lut(kLutSize);
  int k = 0;
  for (int i = 0; i < kLutSize; ++i) {
    const float v = -1.0f + (2.0f * static_cast<float>(i)) / static_cast<float>(kLutSize - 1);
    while (k < 255 && mid[k] < v) ++k;
    lut[i] = static_cast<uint8_t>(k);
  }
  return lut;
}

inline uint16_t lut_index(float v) {
  v = std::min(std::max(v, -1.0f), 1.0f);
  return static_cast<uint16_t>((v + 1.0f) * 0.5f * static_cast<float>(kLutSize - 1) + 0.5f);
}

// The lookup table of a code book, cached by content (two code books are in use: the signed
// and unsigned dynamic maps).
const std::vector<uint8_t>& lut_for(const at::Tensor& code) {
  static std::mutex mutex;
  static std::vector<std::pair<std::vector<float>, std::vector<uint8_t>>> cache;
  const float* c = code.data_ptr<float>();
  std::vector<float> key(c, c + 256);
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, lut] : cache) {
    if (k == key) return lut;
  }
  cache.emplace_back(key, build_lut(c));
  return cache.back().second;
}

at::Tensor make_dynamic_map(bool is_signed) {
  // create_dynamic_map(signed, max_exponent_bits=7, total_bits=8) with the same tensor ops
  // (linspace, +, /, * by a double scalar, in fp32), so the values are bitwise bitsandbytes'.
  constexpr int kMaxExponentBits = 7, kNonSignBits = 7;
  std::vector<float> data;
  for (int i = 0; i < kMaxExponentBits; ++i) {
    const int64_t fraction_items =
        is_signed ? (int64_t{1} << (i + kNonSignBits - kMaxExponentBits)) + 1
                  : (int64_t{1} << (i + kNonSignBits - kMaxExponentBits + 1)) + 1;
    at::Tensor boundaries = at::linspace(0.1, 1, fraction_items, at::kFloat);
    at::Tensor means = (boundaries.narrow(0, 0, fraction_items - 1) +
                        boundaries.narrow(0, 1, fraction_items - 1)) / 2.0;
    const double scale = std::pow(10.0, -(kMaxExponentBits - 1) + i);
    at::Tensor pos = means * scale;
    const float* p = pos.data_ptr<float>();
    data.insert(data.end(), p, p + pos.numel());
    if (is_signed) {
      at::Tensor neg = means * (-scale);
      const float* q = neg.data_ptr<float>();
      data.insert(data.end(), q, q + neg.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  TORCH_INTERNAL_ASSERT(data.size() == 256, "dynamic map has ", data.size(), " entries");
  std::sort(data.begin(), data.end());
  return at::tensor(data, at::kFloat);
}

void check_code(const at::Tensor& code, const char* what) {
  TORCH_CHECK(code.scalar_type() == at::kFloat && code.numel() == 256 && code.is_contiguous(),
              "[", what, "] the code book must be 256 contiguous fp32 values, got ", code.sizes(),
              " ", code.scalar_type());
}

}  // namespace

const at::Tensor& nf4_code() {
  // get_4bit_type("nf4"): the literals are fp32 values (printed exactly), divided by max|c| = 1.
  static const at::Tensor code = at::tensor(
      std::vector<float>{-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
                         -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
                         0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f,
                         0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
                         0.7229568362236023f, 1.0f},
      at::kFloat);
  return code;
}

const at::Tensor& dynamic_map(bool is_signed) {
  static const at::Tensor signed_map = make_dynamic_map(true);
  static const at::Tensor unsigned_map = make_dynamic_map(false);
  return is_signed ? signed_map : unsigned_map;
}

void quantize_blockwise_into(const at::Tensor& x_in, const at::Tensor& code, int64_t blocksize,
                             at::Tensor& q, at::Tensor& absmax) {
  check_code(code, "quantize_blockwise");
  TORCH_CHECK(blocksize > 0, "[quantize_blockwise] blocksize must be positive, got ", blocksize);
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t n = x.numel(), blocks = (n + blocksize - 1) / blocksize;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.numel() == n && q.is_contiguous() &&
                  absmax.scalar_type() == at::kFloat && absmax.numel() == blocks &&
                  absmax.is_contiguous(),
              "[quantize_blockwise] outputs must be contiguous uint8 (", n, ") and fp32 (", blocks,
              ")");
  const std::vector<uint8_t>& lut = lut_for(code);
  const float* px = x.data_ptr<float>();
  uint8_t* pq = q.data_ptr<uint8_t>();
  float* pm = absmax.data_ptr<float>();
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
      float m = 0.0f;
      for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(px[i]));
      pm[b] = m;
      if (m == 0.0f) {
        std::fill(pq + begin, pq + end, uint8_t{0});
        continue;
      }
      const float inv = 1.0f / m;
      for (int64_t i = begin; i < end; ++i) pq[i] = lut[lut_index(px[i] * inv)];
    }
  });
}

Blockwise8 quantize_blockwise(const at::Tensor& x, const at::Tensor& code, int64_t blocksize) {
  TORCH_CHECK(blocksize > 0, "[quantize_blockwise] blocksize must be positive, got ", blocksize);
  const int64_t blocks = (x.numel() + blocksize - 1) / blocksize;
  Blockwise8 out{at::empty(x.sizes(), at::kByte), at::empty({blocks}, at::kFloat)};
  quantize_blockwise_into(x, code, blocksize, out.q, out.absmax);
  return out;
}

at::Tensor dequantize_blockwise(const at::Tensor& q_in, const at::Tensor& absmax_in,
                                const at::Tensor& code, int64_t blocksize) {
  check_code(code, "dequantize_blockwise");
  const at::Tensor q = q_in.contiguous(), absmax = absmax_in.to(at::kFloat).contiguous();
  const int64_t n = q.numel(), blocks = (n + blocksize - 1) / blocksize;
  TORCH_CHECK(q.scalar_type() == at::kByte && absmax.numel() == blocks,
              "[dequantize_blockwise] expected uint8 values and ", blocks, " absmaxes, got ",
              q.scalar_type(), " and ", absmax.numel());
  at::Tensor out = at::empty(q.sizes(), at::kFloat);
  const uint8_t* pq = q.data_ptr<uint8_t>();
  const float* pm = absmax.data_ptr<float>();
  const float* pc = code.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) po[i] = pc[pq[i]] * pm[i / blocksize];
  });
  return out;
}

}  // namespace fsdp::quant
