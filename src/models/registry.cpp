// Model presets by name. See models.h for the table.
#include "fsdp/models.h"

#include <algorithm>
#include <sstream>

namespace fsdp::demos {
namespace {

const std::vector<std::string>& names() {
  static const std::vector<std::string> kNames = {"transformer-tiny", "transformer-small",
                                                  "transformer-1b", "transformer-3b", "gpt2-tiny", "gpt2-mini",
                                                  "gpt2-124m"};
  return kNames;
}

[[noreturn]] void unknown_model(const std::string& name) {
  std::ostringstream valid;
  for (size_t i = 0; i < names().size(); ++i) valid << (i ? ", " : "") << names()[i];
  TORCH_CHECK(false, "[fsdp::demos] unknown model '", name, "'; valid names: ", valid.str());
}

// Presets with a published vocabulary keep it; a larger dataset vocabulary cannot fit.
int64_t fixed_vocab(const std::string& name, int64_t preset, int64_t requested) {
  TORCH_CHECK(requested <= preset, "[fsdp::demos] model '", name, "' has a fixed vocabulary of ",
              preset, " tokens but the data needs ", requested,
              "; use a smaller vocabulary or the transformer-small / transformer-tiny presets");
  return preset;
}

int64_t vocab_or(int64_t requested, int64_t preset) { return requested > 0 ? requested : preset; }

}  // namespace

std::vector<std::string> model_names() { return names(); }

bool is_transformer_model(const std::string& name) {
  if (std::find(names().begin(), names().end(), name) == names().end()) unknown_model(name);
  return name.rfind("transformer-", 0) == 0;
}

TransformerOptions transformer_preset(const std::string& name, int64_t vocab_size,
                                      double dropout) {
  TransformerOptions o;
  o.dropout = dropout;
  if (name == "transformer-tiny") {
    o.vocab_size = vocab_or(vocab_size, 128);
    o.ninp = 32, o.nhead = 2, o.nhid = 64, o.nlayers = 2;
  } else if (name == "transformer-small") {
    o.vocab_size = vocab_or(vocab_size, 33278);
    o.ninp = 512, o.nhead = 8, o.nhid = 2048, o.nlayers = 4;
  } else if (name == "transformer-1b") {
    o.vocab_size = fixed_vocab(name, 33278, vocab_size);
    o.ninp = 1024, o.nhead = 64, o.nhid = 4096, o.nlayers = 32;
  } else if (name == "transformer-3b") {  // the disk tier's demo: 48 GB of fp32 Adam state
    o.vocab_size = fixed_vocab(name, 33278, vocab_size);
    o.ninp = 2048, o.nhead = 16, o.nhid = 8192, o.nlayers = 25;
  } else {
    is_transformer_model(name);  // throws for an unknown name, listing the valid ones
    TORCH_CHECK(false, "[fsdp::demos] '", name,
                "' is not a transformer-* model; use gpt_preset");
  }
  return o;
}

GPTOptions gpt_preset(const std::string& name, int64_t vocab_size, double dropout) {
  GPTOptions o;
  o.dropout = dropout;
  if (name == "gpt2-tiny") {
    o.vocab_size = vocab_or(vocab_size, 128);
    o.block_size = 64, o.n_layer = 2, o.n_head = 2, o.n_embd = 32;
  } else if (name == "gpt2-mini") {
    o.vocab_size = vocab_or(vocab_size, 128);
    o.block_size = 128, o.n_layer = 4, o.n_head = 4, o.n_embd = 256;
  } else if (name == "gpt2-124m") {
    o.vocab_size = fixed_vocab(name, 50257, vocab_size);
    o.block_size = 1024, o.n_layer = 12, o.n_head = 12, o.n_embd = 768;
  } else {
    is_transformer_model(name);  // throws for an unknown name, listing the valid ones
    TORCH_CHECK(false, "[fsdp::demos] '", name,
                "' is not a gpt2-* model; use transformer_preset");
  }
  return o;
}

std::shared_ptr<fsdp::nn::Module> make_model(const std::string& name, int64_t vocab_size,
                                             double dropout) {
  if (is_transformer_model(name)) {
    return std::make_shared<Transformer>(transformer_preset(name, vocab_size, dropout));
  }
  return std::make_shared<GPT>(gpt_preset(name, vocab_size, dropout));
}

int64_t model_parameter_count(const std::string& name, int64_t vocab_size) {
  if (is_transformer_model(name)) return parameter_count(transformer_preset(name, vocab_size));
  return parameter_count(gpt_preset(name, vocab_size));
}

fsdp::nn::ModuleTypes layer_types(const std::string& name) {
  if (is_transformer_model(name)) return fsdp::nn::module_types<EncoderLayer, DecoderLayer>();
  return fsdp::nn::module_types<GPTBlock>();
}

fsdp::nn::ModuleTypes unit_types(const std::string& name) {
  fsdp::nn::ModuleTypes types = layer_types(name);
  types.insert(std::type_index(typeid(Vocabulary)));
  return types;
}

}  // namespace fsdp::demos
