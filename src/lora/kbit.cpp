// prepare_for_kbit_training for Llama models. See include/fsdp/lora.h.
#include "fsdp/activation_checkpointing.h"
#include "fsdp/llama.h"
#include "fsdp/lora.h"

namespace fsdp {

void prepare_for_kbit_training(LlamaForCausalLM& model, bool use_gradient_checkpointing,
                               KbitUpcast upcast) {
  freeze_and_upcast(model, upcast);
  if (!use_gradient_checkpointing) return;
  // PEFT (use_reentrant=True): enable_input_require_grads, then gradient_checkpointing_enable.
  model.model->input_require_grads = true;
  apply_activation_checkpointing(model, llama_layer_types());
}

}  // namespace fsdp
