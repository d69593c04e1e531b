// fsdp.cpp umbrella header: everything a user of the library calls.
//
//   #include <fsdp/fsdp.h>
//
// See README and examples/train_transformer.cpp.
#pragma once

#include "fsdp/activation_checkpointing.h"
#include "fsdp/comm.h"
#include "fsdp/cpu_adam.h"
#include "fsdp/data.h"
#include "fsdp/ddp.h"
#include "fsdp/deepspeed.h"
#include "fsdp/fsdp_strategy.h"
#include "fsdp/init.h"
#include "fsdp/launcher.h"
#include "fsdp/lightning.h"
#include "fsdp/logger.h"
#include "fsdp/memory.h"
#include "fsdp/models.h"
#include "fsdp/nn.h"
#include "fsdp/precision.h"
#include "fsdp/single_strategy.h"
#include "fsdp/strategy.h"
#include "fsdp/strategy_registry.h"
#include "fsdp/trainer.h"
