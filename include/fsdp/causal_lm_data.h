// Fine-tuning data for causal language models: examples from a local JSONL or text file,
// tokenized, truncated and padded (transformers' DataCollatorForLanguageModeling(mlm=False)):
//
//   auto texts = fsdp::read_text_examples("train.jsonl");              // {"text": ...} per line
//   auto data = std::make_shared<fsdp::CausalLMDataset>(texts, tokenizer, /*max_length=*/512);
//   fsdp::DataLoader loader(data, batch_size, sampler);                 // (B, max_length) batches
//   int64_t n = fsdp::used_length(batch);                               // trim right padding
//
// Example i: input = its ids (BOS/EOS as the tokenizer adds them), right-padded with pad_id to
// max_length; target[t] = input[t+1] where both are real tokens, -100 elsewhere (padding and the
// last real position). The model's logits at position t are scored against target[t]: the same
// loss as transformers' shift of labels = input_ids with padding masked. One difference on
// purpose: the collator masks every label equal to pad_token_id, so with pad = eos (the recipe)
// transformers also masks each example's real EOS; here only padding is masked, so the model
// learns to end its examples.
#pragma once

#include "fsdp/data.h"
#include "fsdp/tokenizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

// Examples of a local file. ".jsonl"/".json" (one JSON object per line): the `text_field`
// string, or "prompt" + "completion" concatenated when the object has those instead. Any other
// file: plain text, one example per paragraph (blank lines separate; WikiText headings
// " = ... = " are examples too). Empty examples are skipped. Errors name the file and line.
std::vector<std::string> read_text_examples(const std::string& path,
                                            const std::string& text_field = "text");

class CausalLMDataset : public Dataset {
 public:
  CausalLMDataset(const std::vector<std::string>& texts, const Tokenizer& tokenizer,
                  int64_t max_length);
  // Already tokenized sequences.
  CausalLMDataset(std::vector<std::vector<int64_t>> sequences, int64_t max_length, int64_t pad_id);
  int64_t size() const override { return static_cast<int64_t>(sequences_.size()); }
  Example get(int64_t index) const override;  // input (max_length), target (max_length)
  int64_t max_length() const { return max_length_; }
  int64_t num_tokens() const;  // real (unpadded, truncated) tokens over all examples
  int64_t truncated() const { return truncated_; }

 private:
  std::vector<std::vector<int64_t>> sequences_;  // truncated to max_length
  int64_t max_length_;
  int64_t pad_id_;
  int64_t truncated_ = 0;
};

// Columns of `batch` up to the last one with a target (right padding beyond is dropped without
// changing the loss); at least 1.
int64_t used_length(const Batch& batch);

}  // namespace fsdp
