// The built-in comm hooks by name: the one parser of hook and wrapper names (fsdp-train's
// --ddp-comm-hook / --ddp-comm-wrapper). See include/fsdp/ddp.h set_comm_hook.
#include "fsdp/ddp.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace fsdp {
namespace {

enum class HookKind { kNone, kAllreduce, kFp16, kBf16, kPowerSGD, kBatchedPowerSGD, kPostLocalSGD };

struct HookEntry {
  const char* name;
  HookKind kind;
};

const std::vector<HookEntry>& hook_entries() {
  static const std::vector<HookEntry> entries = {
      {"allreduce", HookKind::kAllreduce},       {"fp16_compress", HookKind::kFp16},
      {"bf16_compress", HookKind::kBf16},        {"powersgd", HookKind::kPowerSGD},
      {"batched_powersgd", HookKind::kBatchedPowerSGD},
      {"post_local_sgd", HookKind::kPostLocalSGD},
  };
  return entries;
}

std::string joined(const std::vector<std::string>& names) {
  std::ostringstream os;
  for (size_t i = 0; i < names.size(); ++i) os << (i ? ", " : "") << "'" << names[i] << "'";
  return os.str();
}

HookKind parse_hook(const std::string& name) {
  if (name.empty() || name == "none") return HookKind::kNone;
  for (const auto& e : hook_entries()) {
    if (name == e.name) return e.kind;
  }
  TORCH_CHECK(false, "[ddp] unknown comm hook '", name, "'; valid names: ",
              joined(comm_hook_names()), " (or 'none')");
}

}  // namespace

std::vector<std::string> comm_hook_names() {
  std::vector<std::string> out;
  for (const auto& e : hook_entries()) out.emplace_back(e.name);
  return out;
}

std::vector<std::string> comm_wrapper_names() { return {"fp16", "bf16"}; }

void set_comm_hook(DDPOptions& options, const std::string& hook, const std::string& wrapper,
                   const PowerSGDOptions& powersgd, const PostLocalSGDOptions& post_local_sgd) {
  options.comm_hook = nullptr;
  options.comm_state = nullptr;
  switch (parse_hook(hook)) {
    case HookKind::kNone:
      break;
    case HookKind::kAllreduce:
      options.comm_hook = allreduce_hook;
      break;
    case HookKind::kFp16:
      options.comm_hook = fp16_compress_hook;
      break;
    case HookKind::kBf16:
      options.comm_hook = bf16_compress_hook;
      break;
    case HookKind::kPowerSGD:
      options.comm_hook = powersgd_hook;
      options.comm_state = std::make_shared<PowerSGDState>(powersgd);
      break;
    case HookKind::kBatchedPowerSGD:
      options.comm_hook = batched_powersgd_hook;
      options.comm_state = std::make_shared<PowerSGDState>(powersgd);
      break;
    case HookKind::kPostLocalSGD:
      options.comm_hook = post_local_sgd_hook;
      options.comm_state = std::make_shared<PostLocalSGDState>(post_local_sgd);
      break;
  }
  if (wrapper.empty() || wrapper == "none") {
    options.comm_wrapper = nullptr;
  } else if (wrapper == "fp16") {
    options.comm_wrapper = fp16_compress_wrapper;
  } else if (wrapper == "bf16") {
    options.comm_wrapper = bf16_compress_wrapper;
  } else {
    TORCH_CHECK(false, "[ddp] unknown comm wrapper '", wrapper, "'; valid names: ",
                joined(comm_wrapper_names()), " (or 'none')");
  }
}

}  // namespace fsdp
