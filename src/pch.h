// Precompiled header shared by every target (see CMakeLists.txt).
#pragma once
#include <torch/torch.h>

// Defined once, in src/common/torch_class_templates.cpp (Note [libtorch's class templates,
// instantiated once] in src/torch_class_templates.h).
#if FSDP_TORCH_EXTERN_TEMPLATES
#include "torch_class_templates.h"
#define FSDP_DECLARE_EXTERN(...) extern template class __VA_ARGS__;
FSDP_TORCH_CLASS_TEMPLATES(FSDP_DECLARE_EXTERN)
#undef FSDP_DECLARE_EXTERN
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>
