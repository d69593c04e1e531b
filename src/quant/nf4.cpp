// NF4 quantization and double quantization. See Note [NF4 and double quantization] in
// include/fsdp/quantization.h.
#include "fsdp/quantization.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fsdp::quant {
namespace {

constexpr int64_t kNestedBlocksize = 256;

// Midpoints between adjacent NF4 codes, (c_k + c_{k+1}) / 2 in fp32 (bitsandbytes'
// _get_4bit_quantize_bounds).
const std::array<float, 15>& nf4_midpoints() {
  static const std::array<float, 15> mid = [] {
    std::array<float, 15> m{};
    const float* c = nf4_code().data_ptr<float>();
    for (int i = 0; i < 15; ++i) m[i] = (c[i] + c[i + 1]) / 2.0f;
    return m;
  }();
  return mid;
}

// torch.bucketize(x, midpoints, right=False): the number of midpoints strictly below x
// (x on a midpoint goes to the lower code).
inline uint8_t nf4_index(float x, const std::array<float, 15>& mid) {
  uint8_t k = 0;
  while (k < 15 && mid[k] < x) ++k;
  return k;
}

template <typename T>
void quantize_4bit_blocks(const T* w, int64_t n, int64_t blocksize, uint8_t* packed, float* absmax) {
  const auto& mid = nf4_midpoints();
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  const int64_t full = n / blocksize;
  // Blocks are processed in pairs of elements; blocksize is even, so no byte straddles two
  // blocks except the last (odd n): its missing element is quantized as 0.0.
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> idx(blocksize + 1);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
      float m = 0.0f;
      for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(static_cast<float>(w[i])));
      const float safe = std::max(m, 1e-38f);  // absmax.clamp(min=1e-38)
      absmax[b] = b < full ? m : safe;         // the partial block stores the clamped value
      const float inv = 1.0f / safe;
      int64_t k = 0;
      for (int64_t i = begin; i < end; ++i, ++k) {
        // Full blocks multiply by the reciprocal, the trailing partial block divides (as the
        // default backend's two code paths do).
        const float v = b < full ? static_cast<float>(w[i]) * inv : static_cast<float>(w[i]) / safe;
        idx[k] = nf4_index(std::min(std::max(v, -1.0f), 1.0f), mid);
      }
      if (k % 2) idx[k++] = nf4_index(0.0f, mid);  // padding of an odd total
      for (int64_t j = 0; j < k; j += 2) {
        packed[(begin + j) / 2] = static_cast<uint8_t>((idx[j] << 4) | idx[j + 1]);
      }
    }
  });
}

// The straightforward kernel: per element a nibble, a code book lookup and a multiply.
template <typename T>
void dequantize_4bit_elementwise(const uint8_t* packed, const float* absmax, int64_t n,
                                 int64_t blocksize, T* out) {
  const float* code = nf4_code().data_ptr<float>();
  at::parallel_for(0, n, 8192, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t byte = packed[i / 2];
      const uint8_t nib = (i % 2 == 0) ? (byte >> 4) : (byte & 0x0F);
      out[i] = static_cast<T>(code[nib] * absmax[i / blocksize]);
    }
  });
}

#if defined(__x86_64__)
bool has_ssse3() {
  static const bool yes = __builtin_cpu_supports("ssse3");
  return yes;
}

// The 16-bit table lookups of Note [NF4 dequantization kernel] with SSSE3 byte shuffles: the
// table's low and high bytes are two 16-byte registers, and pshufb looks up 16 nibbles at once.
// 16 packed bytes -> 32 values per iteration. Returns the pairs done (a multiple of 16).
__attribute__((target("ssse3"))) int64_t shuffle_pairs_ssse3(const uint8_t* src, int64_t pairs,
                                                             const uint16_t* lut16, uint16_t* dst) {
  alignas(16) uint8_t lo_bytes[16], hi_bytes[16];
  for (int k = 0; k < 16; ++k) {
    lo_bytes[k] = static_cast<uint8_t>(lut16[k] & 0xFF);
    hi_bytes[k] = static_cast<uint8_t>(lut16[k] >> 8);
  }
  const __m128i lut_lo = _mm_load_si128(reinterpret_cast<const __m128i*>(lo_bytes));
  const __m128i lut_hi = _mm_load_si128(reinterpret_cast<const __m128i*>(hi_bytes));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  int64_t j = 0;
  for (; j + 16 <= pairs; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    const __m128i even = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);  // high nibbles
    const __m128i odd = _mm_and_si128(b, nibble);                       // low nibbles
    const __m128i idx[2] = {_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd)};
    for (int h = 0; h < 2; ++h) {  // elements 16h .. 16h + 15 of this group of 32
      const __m128i lo = _mm_shuffle_epi8(lut_lo, idx[h]);
      const __m128i hi = _mm_shuffle_epi8(lut_hi, idx[h]);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j + 16 * h), _mm_unpacklo_epi8(lo, hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * j + 16 * h + 8), _mm_unpackhi_epi8(lo, hi));
    }
  }
  return j;
}
#endif

// Note [NF4 dequantization kernel]
// --------------------------------
// A Linear4bit dequantizes its whole weight at every use (forward, the recomputing forward of
// activation checkpointing, backward), so this loop runs three times per layer per step and
// was most of a QLoRA step (measured before: ~12 s of a 24.7 s llama-1b step). The values are
// code[k] * absmax[block] in fp32, rounded to T: within one block only 16 distinct values
// occur. So per block: a 16-entry table of the already rounded values (16 multiplies instead
// of 64), then per byte two table lookups (high nibble = even element, low = odd) stored
// together -- for 2-byte T one 32-bit store of the pair, or on x86 with SSSE3 16 lookups at
// once with byte shuffles (shuffle_pairs_ssse3). Blocks are independent and split over
// at::parallel_for. Bitwise equal to the elementwise kernel (the same fp32 product rounded the
// same way; tested), `fsdp-bench nf4` measures both against a memory-bandwidth floor.
template <typename T>
void dequantize_4bit_blocks(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize,
                            T* out) {
  const float* code = nf4_code().data_ptr<float>();
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  // blocksize is even (a power of two >= 32): every block starts on a byte boundary.
  at::parallel_for(0, blocks, std::max<int64_t>(1, 16384 / blocksize), [&](int64_t b0, int64_t b1) {
    T lut[16];
    for (int64_t b = b0; b < b1; ++b) {
      const float m = absmax[b];
      for (int k = 0; k < 16; ++k) lut[k] = static_cast<T>(code[k] * m);
      const int64_t begin = b * blocksize, end = std::min(n, begin + blocksize);
      const int64_t pairs = (end - begin) / 2;
      const uint8_t* src = packed + begin / 2;
      T* dst = out + begin;
      if constexpr (sizeof(T) == 2) {
        // Two 16-bit values per 32-bit store (little-endian: the even element is the low half).
        uint16_t lut16[16];
        std::memcpy(lut16, lut, sizeof(lut16));
        int64_t j = 0;
#if defined(__x86_64__)
        if (has_ssse3()) j = shuffle_pairs_ssse3(src, pairs, lut16, reinterpret_cast<uint16_t*>(dst));
#endif
        for (; j < pairs; ++j) {
          const uint8_t byte = src[j];
          const uint32_t pair = static_cast<uint32_t>(lut16[byte >> 4]) |
                                (static_cast<uint32_t>(lut16[byte & 0x0F]) << 16);
          std::memcpy(dst + 2 * j, &pair, 4);
        }
      } else {
        for (int64_t j = 0; j < pairs; ++j) {
          const uint8_t byte = src[j];
          dst[2 * j] = lut[byte >> 4];
          dst[2 * j + 1] = lut[byte & 0x0F];
        }
      }
      if ((end - begin) % 2) dst[2 * pairs] = lut[src[pairs] >> 4];  // odd n: the last element
    }
  });
}

}  // namespace

int64_t Nf4Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t Nf4Tensor::nbytes() const {
  int64_t b = packed.numel() + absmax.numel() * absmax.element_size();
  if (nested) b += nested_absmax.numel() * 4 + 4;
  return b;
}

Nf4Tensor quantize_nf4(const at::Tensor& w_in, int64_t blocksize, bool double_quant) {
  TORCH_CHECK(blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0,
              "[quantize_nf4] blocksize must be a power of two in [32, 4096] (bitsandbytes' "
              "valid sizes), got ", blocksize);
  TORCH_CHECK(w_in.scalar_type() == at::kFloat || w_in.scalar_type() == at::kBFloat16 ||
                  w_in.scalar_type() == at::kHalf,
              "[quantize_nf4] expects fp32, bf16 or fp16 values, got ", w_in.scalar_type());
  const at::Tensor w = w_in.detach().contiguous();
  Nf4Tensor t;
  t.shape = w.sizes().vec();
  t.blocksize = blocksize;
  t.nested = double_quant;
  const int64_t n = w.numel(), blocks = (n + blocksize - 1) / blocksize;
  TORCH_CHECK(n > 0, "[quantize_nf4] cannot quantize an empty tensor");
  t.packed = at::empty({(n + 1) / 2}, at::kByte);
  at::Tensor absmax = at::empty({blocks}, at::kFloat);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "quantize_nf4", [&] {
    quantize_4bit_blocks<scalar_t>(w.data_ptr<scalar_t>(), n, blocksize, t.packed.data_ptr<uint8_t>(),
                                   absmax.data_ptr<float>());
  });
  if (!double_quant) {
    t.absmax = absmax;
    return t;
  }
  // offset = absmax.mean() (torch's fp32 mean, as bitsandbytes); absmax - offset in 8 bits.
  at::Tensor offset = absmax.mean();
  t.offset = offset.item<float>();
  Blockwise8 q = quantize_blockwise(absmax - offset, dynamic_map(true), kNestedBlocksize);
  t.absmax = q.q;
  t.nested_absmax = q.absmax;
  return t;
}

at::Tensor nf4_absmax(const Nf4Tensor& t) {
  if (!t.nested) return t.absmax.to(at::kFloat);
  at::Tensor a = dequantize_blockwise(t.absmax, t.nested_absmax, dynamic_map(true), kNestedBlocksize);
  return a + t.offset;  // fp32 add of the offset, as `absmax += quant_state.offset`
}

namespace {

at::Tensor dequantize_with(const Nf4Tensor& t, at::ScalarType dtype, bool elementwise) {
  const at::Tensor absmax = nf4_absmax(t).contiguous();
  const int64_t n = t.numel();
  TORCH_CHECK(t.packed.numel() * 2 >= n && absmax.numel() == t.blocks(),
              "[dequantize_nf4] stored sizes do not match the shape ", at::IntArrayRef(t.shape));
  TORCH_CHECK(t.blocksize % 2 == 0, "[dequantize_nf4] blocksize must be even, got ", t.blocksize);
  const at::Tensor packed = t.packed.contiguous();
  at::Tensor out = at::empty(t.shape, dtype);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "dequantize_nf4", [&] {
    if (elementwise) {
      dequantize_4bit_elementwise<scalar_t>(packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n,
                                            t.blocksize, out.data_ptr<scalar_t>());
    } else {
      dequantize_4bit_blocks<scalar_t>(packed.data_ptr<uint8_t>(), absmax.data_ptr<float>(), n,
                                       t.blocksize, out.data_ptr<scalar_t>());
    }
  });
  return out;
}

}  // namespace

at::Tensor dequantize_nf4(const Nf4Tensor& t, at::ScalarType dtype) {
  return dequantize_with(t, dtype, /*elementwise=*/false);
}

at::Tensor dequantize_nf4_elementwise(const Nf4Tensor& t, at::ScalarType dtype) {
  return dequantize_with(t, dtype, /*elementwise=*/true);
}

}  // namespace fsdp::quant
