// The one parser of precision names, and MixedPrecisionPolicy helpers. See fsdp/precision.h.
#include "fsdp/precision.h"

#include <ATen/autocast_mode.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace fsdp {
namespace {

std::string dtype_name(const std::optional<at::ScalarType>& t) {
  return t ? std::string(c10::toString(*t)) : std::string("unset");
}

}  // namespace

std::string MixedPrecisionPolicy::to_string() const {
  std::ostringstream os;
  os << "{param=" << dtype_name(param_dtype) << ", reduce=" << dtype_name(reduce_dtype)
     << ", buffer=" << dtype_name(buffer_dtype) << "}";
  return os.str();
}

std::vector<std::string> precision_names() {
  return {"32-true", "32", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true", "64"};
}

Precision parse_precision(const std::string& name) {
  if (name == "32-true" || name == "32") return Precision::k32True;
  if (name == "bf16-mixed") return Precision::kBf16Mixed;
  if (name == "bf16-true") return Precision::kBf16True;
  if (name == "16-mixed") return Precision::k16Mixed;
  if (name == "16-true") return Precision::k16True;
  if (name == "64-true" || name == "64") return Precision::k64True;
  std::string all;
  for (const auto& n : precision_names()) all += (all.empty() ? "'" : ", '") + n + "'";
  TORCH_CHECK(false, "[precision] unknown precision '", name, "'; valid values: ", all);
}

const char* to_string(Precision precision) {
  switch (precision) {
    case Precision::k32True:
      return "32-true";
    case Precision::kBf16Mixed:
      return "bf16-mixed";
    case Precision::kBf16True:
      return "bf16-true";
    case Precision::k16Mixed:
      return "16-mixed";
    case Precision::k16True:
      return "16-true";
    case Precision::k64True:
      return "64-true";
  }
  return "?";
}

void check_precision_supported(Precision precision) {
  if (precision != Precision::k16Mixed && precision != Precision::k16True) return;
  TORCH_CHECK(false, "[precision] '", to_string(precision),
              "' needs fp16 matmul, which CPU libtorch 1.13 does not implement "
              "(addmm_impl_cpu_ not implemented for 'Half'); use precision 'bf16-mixed' "
              "(--precision bf16-mixed) instead.");
}

MixedPrecisionPolicy bf16_mixed_policy() {
  MixedPrecisionPolicy p;
  p.param_dtype = at::kBFloat16;
  p.reduce_dtype = at::kBFloat16;
  p.buffer_dtype = at::kBFloat16;
  return p;
}

std::optional<at::ScalarType> true_precision_dtype(Precision precision) {
  if (precision == Precision::kBf16True) return at::kBFloat16;
  if (precision == Precision::k64True) return at::kDouble;
  return std::nullopt;
}

CpuAutocastGuard::CpuAutocastGuard(bool enabled, at::ScalarType dtype) : enabled_(enabled) {
  if (!enabled_) return;
  prev_enabled_ = at::autocast::is_cpu_enabled();
  prev_dtype_ = at::autocast::get_autocast_cpu_dtype();
  at::autocast::set_cpu_enabled(true);
  at::autocast::set_autocast_cpu_dtype(dtype);
  at::autocast::increment_nesting();
}

CpuAutocastGuard::~CpuAutocastGuard() {
  if (!enabled_) return;
  // Outermost guard: drop the cached bf16 copies of the fp32 weights (they change every step).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_cpu_enabled(prev_enabled_);
  at::autocast::set_autocast_cpu_dtype(prev_dtype_);
}

DefaultDtypeGuard::DefaultDtypeGuard(std::optional<at::ScalarType> dtype) {
  if (!dtype) return;
  prev_ = c10::get_default_dtype();
  c10::set_default_dtype(c10::scalarTypeToTypeMeta(*dtype));
}

DefaultDtypeGuard::~DefaultDtypeGuard() {
  if (prev_) c10::set_default_dtype(*prev_);
}

}  // namespace fsdp
