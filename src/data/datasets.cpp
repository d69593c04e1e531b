// TokenBlockDataset, WikiText2, SyntheticCorpus. See include/fsdp/data.h.
#include "fsdp/data.h"

#include "data/prng.h"

#include <ATen/ATen.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

namespace fsdp {

// ---------------------------------------------------------------------------------------------
// TokenBlockDataset

TokenBlockDataset::TokenBlockDataset(at::Tensor tokens, int64_t vocab_size, int64_t block_size) {
  set_tokens(std::move(tokens), vocab_size, block_size);
}

void TokenBlockDataset::set_tokens(at::Tensor tokens, int64_t vocab_size, int64_t block_size) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong,
              "[TokenBlockDataset] tokens must be a 1-D int64 tensor, got ", tokens.sizes(), " ",
              tokens.scalar_type());
  TORCH_CHECK(block_size > 0, "[TokenBlockDataset] block_size must be positive, got ", block_size);
  TORCH_CHECK(vocab_size > 0, "[TokenBlockDataset] vocab_size must be positive, got ", vocab_size);
  tokens_ = tokens.contiguous();
  vocab_size_ = vocab_size;
  block_size_ = block_size;
}

int64_t TokenBlockDataset::size() const {
  return std::max<int64_t>(tokens_.numel() / block_size_ - 1, 0);
}

Example TokenBlockDataset::get(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < size(), "[TokenBlockDataset] index ", index,
              " out of range for a dataset of ", size(), " examples");
  const int64_t start = index * block_size_;
  return Example{tokens_.narrow(0, start, block_size_), tokens_.narrow(0, start + 1, block_size_)};
}

namespace demos {

// ---------------------------------------------------------------------------------------------
// WikiText2

namespace {

// Python's str.split() whitespace, restricted to ASCII (the data has no other).
bool is_space(unsigned char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' ||
         (c >= 0x1c && c <= 0x1f);
}

// Longest line a text split may have. WikiText holds one paragraph per line (the longest in
// WikiText-2 is under 4 KiB); a longer "line" means a wrong or binary file, refused with its
// size rather than read as one giant word.
constexpr size_t kMaxLineBytes = size_t{1} << 20;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "[WikiText2] cannot open ", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A split must be plain text: no NUL byte, no line over kMaxLineBytes.
void check_text(const std::filesystem::path& path, const std::string& text) {
  const size_t nul = text.find('\0');
  TORCH_CHECK(nul == std::string::npos, "[WikiText2] ", path.string(),
              " is not a text file (a NUL byte at offset ", nul,
              "); pass a directory of plain-text train.txt/valid.txt/test.txt");
  size_t start = 0, line = 1;
  while (start < text.size()) {
    size_t end = text.find_first_of("\r\n", start);
    if (end == std::string::npos) end = text.size();
    TORCH_CHECK(end - start <= kMaxLineBytes, "[WikiText2] line ", line, " of ", path.string(),
                " is ", end - start, " bytes long (the limit is ", kMaxLineBytes,
                "): text splits hold one paragraph per line; is this the right file?");
    start = end + (text.compare(end, 2, "\r\n") == 0 ? 2 : 1);
    ++line;
  }
}

// Calls on_word(word) for every word of every line and "<eos>" at every line end, as
// `for line in f: line.split() + ["<eos>"]` does in Python text mode (\n, \r\n and \r end lines;
// a last line without a newline still counts).
template <typename F>
void for_each_token(const std::string& text, F&& on_word) {
  static const std::string kEos = "<eos>";
  std::string word;
  bool line_open = false;  // characters seen since the last line end
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const bool line_end = c == '\n' || c == '\r';
    if (is_space(static_cast<unsigned char>(c))) {
      if (!word.empty()) on_word(word), word.clear();
    } else {
      word.push_back(c);
    }
    if (line_end) {
      if (c == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
      on_word(kEos);
      line_open = false;
    } else {
      line_open = true;
    }
  }
  if (!word.empty()) on_word(word);
  if (line_open) on_word(kEos);
}

}  // namespace

WikiText2::WikiText2(const std::string& dir, const std::string& split, int64_t block_size)
    : split_(split) {
  namespace fs = std::filesystem;
  static const std::vector<std::string> kSplits = {"train", "valid", "test"};
  TORCH_CHECK(std::find(kSplits.begin(), kSplits.end(), split) != kSplits.end(),
              "[WikiText2] unknown split '", split, "'; valid splits: train, valid, test");
  TORCH_CHECK(fs::is_directory(dir), "[WikiText2] data directory '", dir,
              "' does not exist; pass the folder that holds train.txt/valid.txt/test.txt");
  std::vector<std::string> present;
  for (const auto& s : kSplits) {
    if (fs::is_regular_file(fs::path(dir) / (s + ".txt"))) present.push_back(s);
  }
  if (std::find(present.begin(), present.end(), split) == present.end()) {
    std::ostringstream found;
    for (const auto& s : present) found << " " << s << ".txt";
    TORCH_CHECK(false, "[WikiText2] split '", split, "' needs ", (fs::path(dir) / (split + ".txt")).string(),
                ", which does not exist (files present in '", dir, "':",
                present.empty() ? std::string(" none") : found.str(),
                "); use one of the present splits or add the file");
  }

  // One pass over the present files in train/valid/test order: the dictionary grows in order of
  // first appearance over all of them; only the requested split's ids are kept.
  std::vector<int64_t> data;
  for (const auto& s : present) {
    const bool keep = s == split;
    const std::string text = read_file(fs::path(dir) / (s + ".txt"));
    TORCH_CHECK(!keep || text.find_first_not_of(" \t\r\n") != std::string::npos, "[WikiText2] ",
                (fs::path(dir) / (s + ".txt")).string(), " is empty: no text to train on");
    check_text(fs::path(dir) / (s + ".txt"), text);
    for_each_token(text, [&](const std::string& word) {
      auto [it, inserted] = ids_.emplace(word, static_cast<int64_t>(words_.size()));
      if (inserted) words_.push_back(word);
      if (keep) data.push_back(it->second);
    });
  }
  at::Tensor tokens = at::empty({static_cast<int64_t>(data.size())}, at::kLong);
  std::copy(data.begin(), data.end(), tokens.data_ptr<int64_t>());
  set_tokens(tokens, static_cast<int64_t>(words_.size()), block_size);
  TORCH_CHECK(size() > 0, "[WikiText2] split '", split, "' in '", dir, "' has ", data.size(),
              " tokens: too few for one example of block_size ", block_size, " (needs ",
              2 * block_size, ")");
}

int64_t WikiText2::id(const std::string& word) const {
  auto it = ids_.find(word);
  return it == ids_.end() ? -1 : it->second;
}

// ---------------------------------------------------------------------------------------------
// SyntheticCorpus

static_assert(SyntheticCorpus::kSuccessorWeights[0] + SyntheticCorpus::kSuccessorWeights[1] +
                      SyntheticCorpus::kSuccessorWeights[2] +
                      SyntheticCorpus::kSuccessorWeights[3] ==
                  100,
              "successor weights are percentages");

SyntheticCorpus::SyntheticCorpus(int64_t vocab_size, int64_t num_tokens, uint64_t seed,
                                 int64_t block_size) {
  TORCH_CHECK(vocab_size >= kSuccessors, "[SyntheticCorpus] vocab_size must be at least ",
              kSuccessors, ", got ", vocab_size);
  TORCH_CHECK(num_tokens >= 2 * block_size, "[SyntheticCorpus] num_tokens (", num_tokens,
              ") must be at least 2 * block_size (", 2 * block_size, ") for one example");
  detail::SplitMix64 rng(seed);
  const auto V = static_cast<uint64_t>(vocab_size);

  // The chain: kSuccessors distinct successors per token.
  successors_.resize(vocab_size);
  for (auto& next : successors_) {
    while (static_cast<int>(next.size()) < kSuccessors) {
      const auto candidate = static_cast<int64_t>(rng.below(V));
      if (std::find(next.begin(), next.end(), candidate) == next.end()) next.push_back(candidate);
    }
  }

  // A walk on it.
  at::Tensor tokens = at::empty({num_tokens}, at::kLong);
  int64_t* out = tokens.data_ptr<int64_t>();
  int64_t current = static_cast<int64_t>(rng.below(V));
  for (int64_t i = 0; i < num_tokens; ++i) {
    out[i] = current;
    int64_t r = static_cast<int64_t>(rng.below(100));
    int k = 0;
    while (r >= kSuccessorWeights[k]) r -= kSuccessorWeights[k++];
    current = successors_[current][k];
  }
  set_tokens(tokens, vocab_size, block_size);
}

double SyntheticCorpus::entropy_rate() {
  double h = 0;
  for (int w : kSuccessorWeights) h -= (w / 100.0) * std::log(w / 100.0);
  return h;
}

}  // namespace demos
}  // namespace fsdp
