// The fused Adam/AdamW element loop, compiled once per instruction set: CMakeLists.txt builds
// this file three times with CPU_CAPABILITY = DEFAULT, AVX2, AVX512 (and the matching -m flags),
// as ATen builds its own kernels, so Vectorized<float> is 8 lanes (scalar array / AVX2) or 16
// (AVX512). No precompiled header: its flags differ. See Note [CPU Adam] in docs/design.md.
#include "optim/cpu_adam_kernel.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>

#ifndef CPU_CAPABILITY
#error "cpu_adam_kernel.cpp is compiled once per instruction set with CPU_CAPABILITY defined"
#endif

namespace fsdp::detail::cpu_adam {
namespace CPU_CAPABILITY {
namespace {

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kF = fVec::size();
// Elements per iteration: one Vectorized<BFloat16/Half> = two Vectorized<float>.
constexpr int64_t kBlock = 2 * kF;

struct Pair {
  fVec lo, hi;
};

// n <= kBlock elements of `ptr` as floats (lanes past n are zero).
template <typename T>
inline Pair load(const T* ptr, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == kBlock) return {fVec::loadu(ptr), fVec::loadu(ptr + kF)};
    if (n <= kF) return {fVec::loadu(ptr, n), fVec(0.f)};
    return {fVec::loadu(ptr), fVec::loadu(ptr + kF, n - kF)};
  } else {
    using V = at::vec::Vectorized<T>;
    static_assert(V::size() == kBlock, "a 16-bit vector holds two float vectors");
    const V v = n == kBlock ? V::loadu(ptr) : V::loadu(ptr, n);
    auto [lo, hi] = at::vec::convert_to_float<T>(v);
    return {lo, hi};
  }
}

// Writes n <= kBlock elements (16-bit: rounded to nearest even, as Tensor::to does).
template <typename T>
inline void store(T* ptr, const Pair& x, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    if (n == kBlock) {
      x.lo.store(ptr);
      x.hi.store(ptr + kF);
    } else if (n <= kF) {
      x.lo.store(ptr, n);
    } else {
      x.lo.store(ptr);
      x.hi.store(ptr + kF, n - kF);
    }
  } else {
    const auto v = at::vec::convert_from_float<T>(x.lo, x.hi);
    if (n == kBlock) {
      v.store(ptr);
    } else {
      v.store(ptr, static_cast<int>(n));
    }
  }
}

// The update of one vector, in libtorch's operation order (torch/csrc/api/src/optim/adam.cpp,
// adamw.cpp) so results agree to fp32 rounding: each line names the op it replaces.
template <bool kL2, bool kDecay, bool kAmsgrad>
struct Update {
  fVec beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, neg_step_size, eps, l2, decay;

  explicit Update(const Scalars& s)
      : beta1(s.beta1), one_minus_beta1(s.one_minus_beta1), beta2(s.beta2),
        one_minus_beta2(s.one_minus_beta2), bc2_sqrt(s.bias_correction2_sqrt),
        neg_step_size(s.neg_step_size), eps(s.eps), l2(s.l2), decay(s.decay) {}

  inline void operator()(fVec& p, fVec g, fVec& m, fVec& v, fVec& vmax) const {
    if constexpr (kDecay) p = p * decay;                  // AdamW: p.mul_(1 - lr * wd)
    if constexpr (kL2) g = at::vec::fmadd(p, l2, g);      // Adam: grad = grad.add(p, wd)
    m = at::vec::fmadd(g, one_minus_beta1, m * beta1);    // exp_avg.mul_(b1).add_(g, 1 - b1)
    v = v * beta2 + one_minus_beta2 * g * g;              // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
    fVec second = v;
    if constexpr (kAmsgrad) {
      vmax = at::vec::maximum(vmax, v);                   // max_out(max_exp_avg_sq, exp_avg_sq)
      second = vmax;
    }
    const fVec denom = second.sqrt() / bc2_sqrt + eps;    // (sqrt(v) / sqrt(bc2)).add_(eps)
    p = p + neg_step_size * m / denom;                    // p.addcdiv_(exp_avg, denom, -step_size)
  }
};

template <typename T, bool kL2, bool kDecay, bool kAmsgrad>
void run(const Span& s, int64_t begin, int64_t end) {
  T* p = static_cast<T*>(s.param);
  const T* g = static_cast<const T*>(s.grad);
  float* m = s.exp_avg;
  float* v = s.exp_avg_sq;
  float* vmax = s.max_exp_avg_sq;
  const Update<kL2, kDecay, kAmsgrad> update(s.s);
  for (int64_t i = begin; i < end; i += kBlock) {
    const int64_t n = std::min(kBlock, end - i);
    Pair P = load(p + i, n);
    const Pair G = load(g + i, n);
    Pair M = load(m + i, n);
    Pair V = load(v + i, n);
    Pair X{fVec(0.f), fVec(0.f)};
    if constexpr (kAmsgrad) X = load(vmax + i, n);
    update(P.lo, G.lo, M.lo, V.lo, X.lo);
    update(P.hi, G.hi, M.hi, V.hi, X.hi);
    store(p + i, P, n);
    store(m + i, M, n);
    store(v + i, V, n);
    if constexpr (kAmsgrad) store(vmax + i, X, n);
  }
}

template <typename T>
RangeFn pick(bool l2, bool decay, bool amsgrad) {
  const int k = (l2 ? 4 : 0) | (decay ? 2 : 0) | (amsgrad ? 1 : 0);
  switch (k) {
    case 0: return run<T, false, false, false>;
    case 1: return run<T, false, false, true>;
    case 2: return run<T, false, true, false>;
    case 3: return run<T, false, true, true>;
    case 4: return run<T, true, false, false>;
    case 5: return run<T, true, false, true>;
    case 6: return run<T, true, true, false>;
    default: return run<T, true, true, true>;
  }
}

}  // namespace

void adam_range(const Span& span, int64_t begin, int64_t end) {
  const bool l2 = span.s.l2 != 0.f;
  const bool decay = span.s.decay != 1.f;
  RangeFn fn = nullptr;
  switch (span.dtype) {
    case c10::ScalarType::BFloat16: fn = pick<c10::BFloat16>(l2, decay, span.s.amsgrad); break;
    case c10::ScalarType::Half: fn = pick<c10::Half>(l2, decay, span.s.amsgrad); break;
    default: fn = pick<float>(l2, decay, span.s.amsgrad); break;  // the caller checked: Float
  }
  fn(span, begin, end);
}

int vector_width() { return static_cast<int>(kF); }

}  // namespace CPU_CAPABILITY
}  // namespace fsdp::detail::cpu_adam
