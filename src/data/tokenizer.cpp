// Byte-level BPE tokenizer from tokenizer.json. See include/fsdp/tokenizer.h.
#include "fsdp/tokenizer.h"

#include "data/unicode.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <array>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace fsdp {
namespace detail {
namespace {

using json = nlohmann::json;

// The two pre-tokenizer regexes of byte-level BPE tokenizers, matched by hand (std::regex has
// no \p{L}); see Note [Pre-tokenizer regexes].
const char* const kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const char* const kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
    "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

enum class Pattern { kGpt2, kLlama3 };

// Note [Pre-tokenizer regexes]
// ----------------------------
// Both regexes are alternations tried in order at each position (the first alternative that
// matches wins, not the longest), and together they match every character, so splitting with
// behavior "Isolated" is "repeatedly take the match at the current position". Each alternative
// is written out below as the regex engine (Oniguruma, with backtracking) resolves it:
//   \s+(?!\S)   a whitespace run not followed by a non-space: the whole run at the end of the
//               text, otherwise the run minus its last character (which then starts the next
//               piece, e.g. " world"); a single space before a non-space fails here.
//   \s*[\r\n]+  a whitespace run up to and including its last newline (fails without one).
// \s is the Unicode White_Space property, \p{L} / \p{N} the general categories L* / N*.
bool is_newline(char32_t c) { return c == '\r' || c == '\n'; }
bool is_other(char32_t c) { return !is_whitespace(c) && !is_letter(c) && !is_number(c); }

char32_t lower_ascii(char32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// 's 't 're 've 'm 'll 'd at i; returns the match length or 0.
size_t match_contraction(const std::u32string& s, size_t i, bool ignore_case) {
  if (s[i] != '\'' || i + 1 >= s.size()) return 0;
  auto at = [&](size_t k) -> char32_t {
    if (k >= s.size()) return 0;
    return ignore_case ? lower_ascii(s[k]) : s[k];
  };
  const char32_t a = at(i + 1), b = at(i + 2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

size_t run(const std::u32string& s, size_t i, bool (*pred)(char32_t)) {
  size_t j = i;
  while (j < s.size() && pred(s[j])) ++j;
  return j - i;
}

// \s+(?!\S) then \s+ at i (s[i] is whitespace).
size_t match_space_run(const std::u32string& s, size_t i) {
  const size_t n = run(s, i, is_whitespace);
  if (i + n == s.size()) return n;  // end of text: the whole run
  if (n >= 2) return n - 1;         // leave the last one for the next piece
  return n;                          // \s+ (one character)
}

size_t match_gpt2(const std::u32string& s, size_t i) {
  if (size_t m = match_contraction(s, i, false)) return m;
  const size_t sp = (s[i] == ' ' && i + 1 < s.size()) ? 1 : 0;
  if (sp || !is_whitespace(s[i])) {
    const size_t j = i + sp;
    if (is_letter(s[j])) return sp + run(s, j, is_letter);
    if (is_number(s[j])) return sp + run(s, j, is_number);
    if (is_other(s[j])) return sp + run(s, j, is_other);
  }
  return match_space_run(s, i);
}

size_t match_llama3(const std::u32string& s, size_t i) {
  if (size_t m = match_contraction(s, i, true)) return m;
  const char32_t c = s[i];
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (!is_newline(c) && !is_letter(c) && !is_number(c) && i + 1 < s.size() && is_letter(s[i + 1])) {
    return 1 + run(s, i + 1, is_letter);
  }
  if (is_letter(c)) return run(s, i, is_letter);
  // \p{N}{1,3}
  if (is_number(c)) return std::min<size_t>(3, run(s, i, is_number));
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const size_t sp = (c == ' ' && i + 1 < s.size() && is_other(s[i + 1])) ? 1 : 0;
  if (sp || is_other(c)) {
    size_t j = i + sp;
    j += run(s, j, is_other);
    j += run(s, j, is_newline);
    return j - i;
  }
  // \s*[\r\n]+: through the last newline of the whitespace run.
  const size_t n = run(s, i, is_whitespace);
  for (size_t k = i + n; k > i; --k) {
    if (is_newline(s[k - 1])) return k - i;
  }
  return match_space_run(s, i);
}

std::vector<std::u32string> split_pattern(const std::u32string& s, Pattern p) {
  std::vector<std::u32string> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t m = p == Pattern::kGpt2 ? match_gpt2(s, i) : match_llama3(s, i);
    TORCH_INTERNAL_ASSERT(m > 0, "pre-tokenizer matched nothing at ", i);
    out.push_back(s.substr(i, m));
    i += m;
  }
  return out;
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to 256 + n.
const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    std::array<bool, 256> printable{};
    for (int b = '!'; b <= '~'; ++b) printable[b] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
    int n = 0;
    for (int b = 0; b < 256; ++b) t[b] = printable[b] ? static_cast<char32_t>(b) : 256 + n++;
    return t;
  }();
  return table;
}

struct AddedToken {
  std::u32string content;
  int64_t id;
  bool special;
};

struct PairHash {
  size_t operator()(const std::pair<int64_t, int64_t>& p) const {
    return std::hash<int64_t>()(p.first * 1000003 + p.second);
  }
};

std::string token_string(const json& t, const std::string& what) {
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content")) return t["content"].get<std::string>();
  TORCH_CHECK(false, "[Tokenizer] ", what, " must be a string or {\"content\": ...}");
}

}  // namespace

struct TokenizerImpl {
  std::unordered_map<std::string, int64_t> vocab;  // byte-level token -> id (model + added)
  std::vector<std::string> tokens;                  // id -> token
  std::unordered_map<std::pair<int64_t, int64_t>, std::pair<int64_t, int64_t>, PairHash>
      merges;  // (left id, right id) -> (rank, merged id)
  bool ignore_merges = false;
  Pattern pattern = Pattern::kGpt2;
  bool add_prefix_space = false;
  std::vector<AddedToken> added;  // longest first
  std::vector<bool> special;      // by id
  // TemplateProcessing "single": special ids before and after the sequence.
  std::vector<int64_t> prefix_ids, suffix_ids;
  std::unordered_map<char32_t, int> char_to_byte;

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int64_t>> cache;

  void add_token(const std::string& tok, int64_t id) {
    TORCH_CHECK(id >= 0 && id < (1ll << 31), "[Tokenizer] token id ", id, " out of range");
    vocab[tok] = id;
    if (static_cast<int64_t>(tokens.size()) <= id) tokens.resize(id + 1);
    tokens[id] = tok;
  }

  void parse(const json& j, const std::string& what);
  void parse_pre_tokenizer(const json& p, const std::string& what);
  void parse_post_processor(const json& p, const std::string& what);
  std::vector<int64_t> bpe(const std::string& byte_level) const;
  void encode_piece(const std::u32string& text, std::vector<int64_t>& out) const;
};

void TokenizerImpl::parse_pre_tokenizer(const json& p, const std::string& what) {
  auto unsupported = [&](const std::string& detail) {
    TORCH_CHECK(false, "[Tokenizer] ", what, ": pre_tokenizer ", detail,
                " is not supported; byte-level BPE with the GPT-2 or Llama 3 pattern is");
  };
  TORCH_CHECK(p.is_object(), "[Tokenizer] ", what, ": a byte-level BPE needs a pre_tokenizer");
  const std::string type = p.value("type", "");
  if (type == "ByteLevel") {
    TORCH_CHECK(p.value("use_regex", true), "[Tokenizer] ", what, ": a lone ByteLevel "
                "pre_tokenizer with use_regex=false is not supported");
    pattern = Pattern::kGpt2;
    add_prefix_space = p.value("add_prefix_space", false);
    return;
  }
  if (type != "Sequence") unsupported("'" + type + "'");
  const json& list = p.at("pretokenizers");
  if (list.size() != 2 || list[0].value("type", "") != "Split" ||
      list[1].value("type", "") != "ByteLevel" || list[1].value("use_regex", true)) {
    unsupported(list.dump().substr(0, 200));
  }
  const json& split = list[0];
  const std::string regex = split.at("pattern").value("Regex", "");
  if (regex == kLlama3Pattern) {
    pattern = Pattern::kLlama3;
  } else if (regex == kGpt2Pattern) {
    pattern = Pattern::kGpt2;
  } else {
    unsupported("Split pattern '" + regex + "'");
  }
  TORCH_CHECK(split.value("behavior", "") == "Isolated" && !split.value("invert", false),
              "[Tokenizer] ", what, ": Split must have behavior Isolated and invert false");
  add_prefix_space = list[1].value("add_prefix_space", false);
}

void TokenizerImpl::parse_post_processor(const json& p, const std::string& what) {
  if (p.is_null()) return;
  const std::string type = p.value("type", "");
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    for (const auto& q : p.at("processors")) parse_post_processor(q, what);
    return;
  }
  TORCH_CHECK(type == "TemplateProcessing", "[Tokenizer] ", what, ": post_processor '", type,
              "' is not supported (TemplateProcessing, ByteLevel and Sequence of them are)");
  bool seen_sequence = false;
  for (const auto& item : p.at("single")) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    const std::string name = item.at("SpecialToken").at("id").get<std::string>();
    const json& ids = p.at("special_tokens").at(name).at("ids");
    for (const auto& id : ids) (seen_sequence ? suffix_ids : prefix_ids).push_back(id.get<int64_t>());
  }
}

void TokenizerImpl::parse(const json& j, const std::string& what) {
  const json& model = j.at("model");
  const std::string type = model.value("type", "BPE");
  TORCH_CHECK(type == "BPE", "[Tokenizer] ", what, ": model type '", type,
              "' is not supported; byte-level BPE is");
  TORCH_CHECK(!model.value("byte_fallback", false) && model.value("dropout", json()).is_null() &&
                  model.value("continuing_subword_prefix", json()).is_null() &&
                  model.value("end_of_word_suffix", json()).is_null(),
              "[Tokenizer] ", what, ": BPE byte_fallback, dropout, continuing_subword_prefix and "
              "end_of_word_suffix are not supported");
  ignore_merges = model.value("ignore_merges", false);
  for (auto& [tok, id] : model.at("vocab").items()) add_token(tok, id.get<int64_t>());
  int64_t rank = 0;
  for (const auto& m : model.at("merges")) {
    std::string a, b;
    if (m.is_array()) {
      a = m.at(0).get<std::string>(), b = m.at(1).get<std::string>();
    } else {
      const std::string s = m.get<std::string>();
      const auto space = s.find(' ');
      TORCH_CHECK(space != std::string::npos, "[Tokenizer] ", what, ": merge '", s, "' has no space");
      a = s.substr(0, space), b = s.substr(space + 1);
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    TORCH_CHECK(ia != vocab.end() && ib != vocab.end() && iab != vocab.end(), "[Tokenizer] ",
                what, ": merge '", a, " ", b, "' uses tokens outside the vocabulary");
    merges.emplace(std::make_pair(ia->second, ib->second), std::make_pair(rank++, iab->second));
  }
  TORCH_CHECK(j.value("normalizer", json()).is_null(), "[Tokenizer] ", what, ": normalizer ",
              j["normalizer"].dump().substr(0, 100), " is not supported");
  parse_pre_tokenizer(j.value("pre_tokenizer", json()), what);
  for (const auto& t : j.value("added_tokens", json::array())) {
    TORCH_CHECK(!t.value("lstrip", false) && !t.value("rstrip", false) &&
                    !t.value("single_word", false),
                "[Tokenizer] ", what, ": added token '", t.value("content", ""),
                "' uses lstrip/rstrip/single_word, which are not supported");
    const std::string content = t.at("content").get<std::string>();
    const int64_t id = t.at("id").get<int64_t>();
    add_token(content, id);
    added.push_back({utf8_decode(content), id, t.value("special", false)});
  }
  std::sort(added.begin(), added.end(),
            [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  special.assign(tokens.size(), false);
  for (const auto& a : added) special[a.id] = a.special;
  parse_post_processor(j.value("post_processor", json()), what);
  const auto& b2c = byte_to_char();
  for (int b = 0; b < 256; ++b) char_to_byte[b2c[b]] = b;
}

std::vector<int64_t> TokenizerImpl::bpe(const std::string& word) const {
  if (ignore_merges) {
    if (auto it = vocab.find(word); it != vocab.end()) return {it->second};
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    if (auto it = cache.find(word); it != cache.end()) return it->second;
  }
  std::vector<int64_t> sym;
  for (char32_t c : utf8_decode(word)) {
    std::string one;
    utf8_append(one, c);
    auto it = vocab.find(one);
    TORCH_CHECK(it != vocab.end(), "[Tokenizer] the byte-level character '", one,
                "' is not in the vocabulary (train the tokenizer with the ByteLevel alphabet)");
    sym.push_back(it->second);
  }
  while (sym.size() > 1) {
    int64_t best_rank = std::numeric_limits<int64_t>::max(), merged = -1;
    size_t best = 0;
    for (size_t k = 0; k + 1 < sym.size(); ++k) {
      auto it = merges.find({sym[k], sym[k + 1]});
      if (it != merges.end() && it->second.first < best_rank) {
        best_rank = it->second.first, merged = it->second.second, best = k;
      }
    }
    if (merged < 0) break;
    sym[best] = merged;
    sym.erase(sym.begin() + static_cast<std::ptrdiff_t>(best) + 1);
  }
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() > 200000) cache.clear();
  cache.emplace(word, sym);
  return sym;
}

void TokenizerImpl::encode_piece(const std::u32string& text, std::vector<int64_t>& out) const {
  if (text.empty()) return;
  std::u32string s = text;
  if (add_prefix_space && s[0] != ' ') s.insert(s.begin(), ' ');
  const auto& b2c = byte_to_char();
  for (const std::u32string& piece : split_pattern(s, pattern)) {
    std::string bytes = utf8_encode(piece), mapped;
    for (unsigned char b : bytes) utf8_append(mapped, b2c[b]);
    for (int64_t id : bpe(mapped)) out.push_back(id);
  }
}

}  // namespace detail

namespace {

std::string read_text(const std::string& path, const std::string& hint) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), "[Tokenizer] cannot read '", path, "'", hint);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

Tokenizer Tokenizer::from_file(const std::string& path) {
  auto impl = std::make_shared<detail::TokenizerImpl>();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(path, "; pass a tokenizer.json written by the "
                                               "tokenizers library"));
    impl->parse(j, path);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "[Tokenizer] ", path, ": not a valid tokenizer.json: ", e.what());
  }
  Tokenizer t;
  t.impl_ = impl;
  // A TemplateProcessing prefix/suffix names the BOS/EOS the model expects.
  if (!impl->prefix_ids.empty()) t.bos_token_id = impl->prefix_ids.front();
  if (!impl->suffix_ids.empty()) t.eos_token_id = impl->suffix_ids.back();
  return t;
}

Tokenizer Tokenizer::from_pretrained(const std::string& dir) {
  namespace fs = std::filesystem;
  Tokenizer t = from_file((fs::path(dir) / "tokenizer.json").string());
  const fs::path cfg_path = fs::path(dir) / "tokenizer_config.json";
  if (!fs::exists(cfg_path)) return t;
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(read_text(cfg_path.string(), ""));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, "[Tokenizer] ", cfg_path.string(), ": not valid JSON: ", e.what());
  }
  auto id_of = [&](const char* key) -> int64_t {
    if (!cfg.contains(key) || cfg[key].is_null()) return -1;
    const std::string tok = detail::token_string(cfg[key], cfg_path.string() + " " + key);
    const int64_t id = t.token_to_id(tok);
    TORCH_CHECK(id >= 0, "[Tokenizer] ", cfg_path.string(), ": ", key, " '", tok,
                "' is not in the vocabulary");
    return id;
  };
  if (int64_t id = id_of("bos_token"); id >= 0) t.bos_token_id = id;
  if (int64_t id = id_of("eos_token"); id >= 0) t.eos_token_id = id;
  if (int64_t id = id_of("pad_token"); id >= 0) t.pad_token_id = id;
  t.add_bos_token = cfg.value("add_bos_token", false);
  t.add_eos_token = cfg.value("add_eos_token", false);
  return t;
}

std::vector<int64_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  const detail::TokenizerImpl& m = *impl_;
  const std::u32string s = detail::utf8_decode(text);
  std::vector<int64_t> ids;
  if (add_special_tokens) ids = m.prefix_ids;
  size_t start = 0, i = 0;
  while (i < s.size()) {
    const detail::AddedToken* hit = nullptr;
    for (const auto& a : m.added) {  // longest first
      if (!a.content.empty() && s.compare(i, a.content.size(), a.content) == 0) {
        hit = &a;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    m.encode_piece(s.substr(start, i - start), ids);
    ids.push_back(hit->id);
    i += hit->content.size();
    start = i;
  }
  m.encode_piece(s.substr(start), ids);
  if (add_special_tokens) {
    ids.insert(ids.end(), m.suffix_ids.begin(), m.suffix_ids.end());
    if (add_bos_token && bos_token_id >= 0 && (ids.empty() || ids.front() != bos_token_id)) {
      ids.insert(ids.begin(), bos_token_id);
    }
    if (add_eos_token && eos_token_id >= 0 && (ids.empty() || ids.back() != eos_token_id)) {
      ids.push_back(eos_token_id);
    }
  }
  return ids;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const detail::TokenizerImpl& m = *impl_;
  std::string out;
  for (int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(m.tokens.size()), "[Tokenizer] id ", id,
                " is outside the vocabulary (", m.tokens.size(), ")");
    if (m.special[id]) {
      if (!skip_special_tokens) out += m.tokens[id];
      continue;
    }
    bool is_added = false;
    for (const auto& a : m.added) is_added |= a.id == id;
    if (is_added) {
      out += m.tokens[id];
      continue;
    }
    for (char32_t c : detail::utf8_decode(m.tokens[id])) {
      auto it = m.char_to_byte.find(c);
      if (it != m.char_to_byte.end()) out.push_back(static_cast<char>(it->second));
    }
  }
  return out;
}

int64_t Tokenizer::token_to_id(const std::string& token) const {
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::string Tokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id >= static_cast<int64_t>(impl_->tokens.size())) return "";
  return impl_->tokens[id];
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->vocab.size()); }

bool Tokenizer::is_special(int64_t id) const {
  return id >= 0 && id < static_cast<int64_t>(impl_->special.size()) && impl_->special[id];
}

}  // namespace fsdp
