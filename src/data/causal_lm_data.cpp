// Causal-LM fine-tuning data. See include/fsdp/causal_lm_data.h.
#include "fsdp/causal_lm_data.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace fsdp {
namespace {

bool has_suffix(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool blank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

}  // namespace

std::vector<std::string> read_text_examples(const std::string& path, const std::string& text_field) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "[read_text_examples] cannot read '", path, "'");
  std::vector<std::string> out;
  std::string line;
  if (has_suffix(path, ".jsonl") || has_suffix(path, ".json")) {
    int64_t lineno = 0;
    while (std::getline(in, line)) {
      ++lineno;
      if (blank(line)) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "[read_text_examples] ", path, ":", lineno, " is not a JSON object: ", e.what());
      }
      std::string text;
      if (j.contains(text_field) && j[text_field].is_string()) {
        text = j[text_field].get<std::string>();
      } else if (j.contains("prompt") && j.contains("completion")) {
        text = j["prompt"].get<std::string>() + j["completion"].get<std::string>();
      } else {
        TORCH_CHECK(false, "[read_text_examples] ", path, ":", lineno, " has no string field '",
                    text_field, "' (nor \"prompt\" + \"completion\"); pass --text-field NAME");
      }
      if (!blank(text)) out.push_back(text);
    }
    return out;
  }
  std::string paragraph;
  auto flush = [&] {
    if (!blank(paragraph)) out.push_back(paragraph);
    paragraph.clear();
  };
  while (std::getline(in, line)) {
    if (blank(line)) {
      flush();
      continue;
    }
    paragraph += line + "\n";
  }
  flush();
  return out;
}

CausalLMDataset::CausalLMDataset(std::vector<std::vector<int64_t>> sequences, int64_t max_length,
                                 int64_t pad_id)
    : sequences_(std::move(sequences)), max_length_(max_length), pad_id_(pad_id) {
  TORCH_CHECK(max_length >= 2, "[CausalLMDataset] max_length must be at least 2, got ", max_length);
  TORCH_CHECK(pad_id >= 0, "[CausalLMDataset] a pad token id is needed (the recipe uses eos)");
  for (auto& s : sequences_) {
    if (static_cast<int64_t>(s.size()) > max_length_) {
      s.resize(max_length_);
      ++truncated_;
    }
  }
}

CausalLMDataset::CausalLMDataset(const std::vector<std::string>& texts, const Tokenizer& tokenizer,
                                 int64_t max_length)
    : CausalLMDataset(
          [&] {
            std::vector<std::vector<int64_t>> seqs;
            seqs.reserve(texts.size());
            for (const auto& t : texts) seqs.push_back(tokenizer.encode(t));
            return seqs;
          }(),
          max_length, tokenizer.pad_token_id >= 0 ? tokenizer.pad_token_id : tokenizer.eos_token_id) {}

Example CausalLMDataset::get(int64_t index) const {
  const auto& s = sequences_.at(index);
  const int64_t n = static_cast<int64_t>(s.size());
  Example e;
  e.input = at::full({max_length_}, pad_id_, at::kLong);
  e.target = at::full({max_length_}, -100, at::kLong);
  int64_t* in = e.input.data_ptr<int64_t>();
  int64_t* tg = e.target.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) in[t] = s[t];
  for (int64_t t = 0; t + 1 < n; ++t) tg[t] = s[t + 1];
  return e;
}

int64_t CausalLMDataset::num_tokens() const {
  int64_t n = 0;
  for (const auto& s : sequences_) n += static_cast<int64_t>(s.size());
  return n;
}

int64_t used_length(const Batch& batch) {
  const at::Tensor has = batch.target.ne(-100).any(0);  // (T)
  const at::Tensor idx = at::nonzero(has);
  return idx.numel() == 0 ? 1 : idx.max().item<int64_t>() + 1;
}

}  // namespace fsdp
