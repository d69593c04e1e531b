// fsdp.cpp umbrella header: the whole public API, every header of include/fsdp/.
//
//   #include <fsdp/fsdp.h>
//
// See README.md and examples/ (examples/README.md lists them).
//
// The QLoRA headers (Llama, NF4, LoRA, 8-bit AdamW, tokenizer, fine-tuning data) are included
// when they are installed: a build configured with FSDP_WITH_QLORA=OFF installs neither them
// nor their library. (tests/cmake/umbrella_header.cmake checks that every header is listed here.)
#pragma once

#include "fsdp/activation_checkpointing.h"
#include "fsdp/callback.h"
#include "fsdp/checkpoint.h"
#include "fsdp/comm.h"
#include "fsdp/comm_hooks.h"
#include "fsdp/cpu_adam.h"
#include "fsdp/data.h"
#include "fsdp/ddp.h"
#include "fsdp/deepspeed.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/init.h"
#include "fsdp/launcher.h"
#include "fsdp/linear_cross_entropy.h"
#include "fsdp/lightning.h"
#include "fsdp/logger.h"
#include "fsdp/memory.h"
#include "fsdp/models.h"
#include "fsdp/nn.h"
#include "fsdp/offload.h"
#include "fsdp/precision.h"
#include "fsdp/sharded_compute.h"
#include "fsdp/single_strategy.h"
#include "fsdp/strategy.h"
#include "fsdp/strategy_registry.h"
#include "fsdp/trainer.h"
#include "fsdp/unit.h"

#if __has_include("fsdp/hf.h")
#include "fsdp/causal_lm_data.h"
#include "fsdp/hf.h"
#include "fsdp/linear.h"
#include "fsdp/llama.h"
#include "fsdp/lora.h"
#include "fsdp/optim8bit.h"
#include "fsdp/quantization.h"
#include "fsdp/tokenizer.h"
#endif
