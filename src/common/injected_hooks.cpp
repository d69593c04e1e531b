// See Note [Injected hooks] in src/common/injected_hooks.h.
#include "common/injected_hooks.h"

#include <utility>

namespace fsdp::detail {
namespace {

InjectedHooks& hooks() {
  static auto* h = new InjectedHooks();  // leaked: ranks may save during static destruction
  return *h;
}

}  // namespace

void install_injected_hooks(InjectedHooks hooks_to_install) { hooks() = std::move(hooks_to_install); }

const InjectedHooks& injected_hooks() { return hooks(); }

}  // namespace fsdp::detail
