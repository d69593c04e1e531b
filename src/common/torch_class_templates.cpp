// The one definition of libtorch's class templates that src/pch.h declares extern: Note
// [libtorch's class templates, instantiated once] in src/torch_class_templates.h.
#include <torch/torch.h>

#include "torch_class_templates.h"

#if FSDP_TORCH_EXTERN_TEMPLATES
#define FSDP_DEFINE_INSTANCE(...) template class __VA_ARGS__;
FSDP_TORCH_CLASS_TEMPLATES(FSDP_DEFINE_INSTANCE)
#undef FSDP_DEFINE_INSTANCE
#endif
