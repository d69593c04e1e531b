// The one parser of precision names, and MixedPrecisionPolicy helpers. See fsdp/precision.h.
#include "fsdp/precision.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DefaultDtype.h>
#include <c10/util/Exception.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>

#include <map>
#include <mutex>
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

void check_cpu_matmul_supported(at::ScalarType dtype, const std::string& who) {
  // Probed once per dtype: "" when a 2x2 matmul works, else libtorch's message (libtorch 1.13:
  // "addmm_impl_cpu_ not implemented for 'Half'"; 2.x implements fp16 matmul on CPU).
  static std::mutex mutex;
  static std::map<at::ScalarType, std::string> probed;
  std::string error;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = probed.find(dtype);
    if (it == probed.end()) {
      try {
        at::mm(at::ones({2, 2}, dtype), at::ones({2, 2}, dtype));
      } catch (const c10::Error& e) {
        error = e.what_without_backtrace();
        error = error.substr(0, error.find('\n'));
      }
      it = probed.emplace(dtype, error).first;
    }
    error = it->second;
  }
  TORCH_CHECK(error.empty(), who, " needs ", c10::toString(dtype), " matmul on CPU, which this "
              "libtorch (", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ".",
              TORCH_VERSION_PATCH, ") does not implement (", error, "); use precision "
              "'bf16-mixed' (--precision bf16-mixed) instead, or build against libtorch 2.13.");
}

namespace {

// Whether libtorch's oneDNN has fp16 kernels on this CPU (the op behind Python's
// torch.ops.mkldnn._is_mkldnn_fp16_supported); true when the op is absent (no claim then).
bool onednn_fp16_supported() {
  static const bool supported = [] {
    auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_is_mkldnn_fp16_supported", ""});
    return !op.has_value() || op->typed<bool()>().call();
  }();
  return supported;
}

}  // namespace

std::optional<std::string> precision_performance_warning(Precision precision) {
  if (precision != Precision::k16Mixed && precision != Precision::k16True) return std::nullopt;
  if (onednn_fp16_supported()) return std::nullopt;
  return std::string("[precision] '") + to_string(precision) +
         "': this CPU has no oneDNN fp16 kernels (they need AVX512-FP16 or AMX-FP16), so fp16 "
         "matmuls run in libtorch's fallback, 30-1000x slower than fp32 as measured on such a CPU "
         "(docs/precision.md); 'bf16-mixed' is the fast choice here.";
}

void check_precision_supported(Precision precision) {
  if (precision != Precision::k16Mixed && precision != Precision::k16True) return;
  check_cpu_matmul_supported(at::kHalf,
                             std::string("[precision] '") + to_string(precision) + "'");
}

namespace {

// All-gather, compute, reduce-scatter and buffers in `dtype` (Lightning's FSDPPrecision).
MixedPrecisionPolicy uniform_policy(at::ScalarType dtype) {
  MixedPrecisionPolicy p;
  p.param_dtype = dtype;
  p.reduce_dtype = dtype;
  p.buffer_dtype = dtype;
  return p;
}

}  // namespace

MixedPrecisionPolicy bf16_mixed_policy() { return uniform_policy(at::kBFloat16); }

MixedPrecisionPolicy fp16_mixed_policy() { return uniform_policy(at::kHalf); }

std::optional<MixedPrecisionPolicy> mixed_precision_policy(Precision precision) {
  if (precision == Precision::kBf16Mixed) return bf16_mixed_policy();
  if (precision == Precision::k16Mixed) return fp16_mixed_policy();
  return std::nullopt;
}

std::optional<at::ScalarType> autocast_dtype(Precision precision) {
  if (precision == Precision::kBf16Mixed) return at::kBFloat16;
  if (precision == Precision::k16Mixed) return at::kHalf;
  return std::nullopt;
}

bool uses_grad_scaler(Precision precision) { return precision == Precision::k16Mixed; }

std::optional<at::ScalarType> true_precision_dtype(Precision precision) {
  if (precision == Precision::kBf16True) return at::kBFloat16;
  if (precision == Precision::k16True) return at::kHalf;
  if (precision == Precision::k64True) return at::kDouble;
  return std::nullopt;
}

void check_optimizer_precision(const torch::optim::Optimizer& optimizer, Precision precision) {
  if (precision != Precision::k16True) return;
  for (size_t i = 0; i < optimizer.param_groups().size(); ++i) {
    const auto& group = optimizer.param_groups()[i];
    double eps = 0;
    if (const auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&group.options())) {
      eps = o->eps();
    } else if (const auto* o = dynamic_cast<const torch::optim::AdamWOptions*>(&group.options())) {
      eps = o->eps();
    } else {
      continue;
    }
    const double in_fp16 = at::scalar_tensor(eps, at::kHalf).item<double>();
    TORCH_CHECK(in_fp16 != 0.0, "[precision] '16-true': Adam eps=", eps, " of parameter group ",
                i, " rounds to 0 in fp16 (smallest fp16 value 6e-8), so the first exactly-zero "
                "gradient (e.g. an embedding row not in the batch) becomes 0/0 = NaN; set eps to "
                "1e-4 (AdamOptions(lr).eps(1e-4); fsdp-train --adam-eps 1e-4) or use "
                "precision '16-mixed' (fp32 master weights).");
  }
}

AutocastGuard::AutocastGuard(c10::DeviceType device_type, std::optional<at::ScalarType> dtype)
    : device_type_(device_type), enabled_(dtype.has_value()) {
  if (!enabled_) return;
  prev_enabled_ = at::autocast::is_autocast_enabled(device_type_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_type_);
  at::autocast::set_autocast_enabled(device_type_, true);
  at::autocast::set_autocast_dtype(device_type_, *dtype);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  if (!enabled_) return;
  // Outermost guard: drop the cached low-precision copies of the fp32 weights (they change
  // every step).
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  at::autocast::set_autocast_enabled(device_type_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_type_, prev_dtype_);
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
