// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (GPT-2, Llama 3 and the
// tokenizers library's ByteLevel BPE trainer write this format):
//
//   auto tok = fsdp::Tokenizer::from_pretrained("Meta-Llama-3-8B");   // tokenizer.json (+ config)
//   std::vector<int64_t> ids = tok.encode("Hello world");             // as tokenizer(text).input_ids
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
//
// encode() gives the ids of the `tokenizers` library's Tokenizer.encode(text).ids:
//   1. added tokens (tokenizer.json "added_tokens") are cut out of the text first, longest match
//      at each position; each is one id;
//   2. every other piece is pre-tokenized: ByteLevel with its GPT-2 regex (use_regex), or the
//      Llama 3 Split regex followed by ByteLevel(use_regex=false); then each piece's UTF-8 bytes
//      are mapped to GPT-2's printable byte alphabet;
//   3. BPE merges by rank (lowest first, leftmost first among equal ranks); with ignore_merges a
//      piece that is itself in the vocabulary is one token;
//   4. the post-processor (TemplateProcessing, alone or in a Sequence with ByteLevel) adds its
//      special tokens when add_special_tokens is true.
// BOS/EOS as the QLoRA recipe asks (AutoTokenizer(..., add_bos_token=True, add_eos_token=True)):
// set add_bos_token / add_eos_token; encode(text, true) then starts with exactly one BOS and ends
// with one EOS whatever the post-processor adds.
//
// Limits (each an error naming what was found): BPE models only (no WordPiece/Unigram);
// normalizers other than none/NFC; pre-tokenizer regexes other than GPT-2's and Llama 3's;
// byte_fallback, dropout, continuing_subword_prefix/end_of_word_suffix. \p{L}/\p{N} come from
// Unicode 14 tables (scripts/gen_unicode_tables.py); case-insensitive contractions fold ASCII only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

namespace detail {
struct TokenizerImpl;
}

class Tokenizer {
 public:
  // tokenizer.json alone.
  static Tokenizer from_file(const std::string& tokenizer_json);
  // A model folder: tokenizer.json, plus tokenizer_config.json when present (bos_token,
  // eos_token, pad_token, add_bos_token, add_eos_token).
  static Tokenizer from_pretrained(const std::string& dir);

  std::vector<int64_t> encode(const std::string& text, bool add_special_tokens = true) const;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = false) const;

  int64_t token_to_id(const std::string& token) const;  // -1 when unknown
  std::string id_to_token(int64_t id) const;             // "" when unknown
  int64_t vocab_size() const;                            // model vocabulary + added tokens
  bool is_special(int64_t id) const;

  // -1 when the tokenizer has none. Set them (e.g. pad = eos, as the recipe does) freely.
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  int64_t pad_token_id = -1;
  bool add_bos_token = false;
  bool add_eos_token = false;

 private:
  std::shared_ptr<const detail::TokenizerImpl> impl_;
};

}  // namespace fsdp
