// Byte-level BPE tokenizer against the `tokenizers` library: a tokenizer.json trained in the test
// (tests/hf_reference.py tokenizer) on WikiText-2 test (the shared copy has no train split), then
// every line of WikiText-2 valid (plus text with special tokens inside and a 200-line block)
// must give identical ids -- for GPT-2's ByteLevel pre-tokenizer and for Llama 3's Split regex
// with ignore_merges and a BOS template. Also BOS/EOS handling as the recipe's add_bos_token /
// add_eos_token, and decode.
#include "fsdp/tokenizer.h"
#include "hf_testing.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace {

using fsdp::testing::hf_scratch;
using fsdp::testing::read_tensors;
using fsdp::testing::run_hf_reference;

struct Trained {
  std::string dir;
  std::vector<std::string> lines;
  std::vector<std::vector<int64_t>> want;
};

Trained train(const std::string& style) {
  const std::string data = fsdp::testing::wikitext2_dir();
  Trained t;
  if (data.empty()) return t;
  t.dir = hf_scratch("tokenizer_" + style);
  run_hf_reference({"tokenizer", t.dir, "--style", style, "--vocab", "3000", "--train",
                    data + "/test.txt", "--encode", data + "/valid.txt"});
  std::ifstream in(t.dir + "/lines.json");
  std::stringstream ss;
  ss << in.rdbuf();
  t.lines = nlohmann::json::parse(ss.str()).get<std::vector<std::string>>();
  auto tensors = read_tensors(t.dir + "/ids.safetensors");
  const at::Tensor ids = tensors.at("ids"), offsets = tensors.at("offsets");
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (size_t i = 0; i < t.lines.size(); ++i) t.want.emplace_back(id + off[i], id + off[i + 1]);
  return t;
}

void expect_identical(const Trained& t, const fsdp::Tokenizer& tok) {
  ASSERT_GT(t.lines.size(), 3000u);  // all of valid.txt
  size_t mismatches = 0, tokens = 0;
  for (size_t i = 0; i < t.lines.size(); ++i) {
    std::vector<int64_t> got = tok.encode(t.lines[i]);
    tokens += got.size();
    if (got != t.want[i] && mismatches++ < 5) {
      ADD_FAILURE() << "line " << i << " differs: '" << t.lines[i].substr(0, 120) << "'";
    }
  }
  EXPECT_EQ(mismatches, 0u);
  EXPECT_GT(tokens, 100000u);
}

TEST(Tokenizer, Gpt2ByteLevelIdsEqualTokenizersOnWikiText2) {
  Trained t = train("gpt2");
  if (t.dir.empty()) GTEST_SKIP() << "[fsdp-skip] WikiText-2 is not available";
  fsdp::Tokenizer tok = fsdp::Tokenizer::from_pretrained(t.dir);
  expect_identical(t, tok);
  // decode inverts encode (byte-level is lossless).
  for (size_t i = 0; i < 200; ++i) EXPECT_EQ(tok.decode(tok.encode(t.lines[i])), t.lines[i]);
}

TEST(Tokenizer, Llama3SplitIdsEqualTokenizersOnWikiText2) {
  Trained t = train("llama3");
  if (t.dir.empty()) GTEST_SKIP() << "[fsdp-skip] WikiText-2 is not available";
  fsdp::Tokenizer tok = fsdp::Tokenizer::from_pretrained(t.dir);
  expect_identical(t, tok);
  const int64_t bos = tok.token_to_id("<|begin_of_text|>"), eos = tok.token_to_id("<|end_of_text|>");
  EXPECT_EQ(tok.bos_token_id, bos);
  EXPECT_EQ(tok.eos_token_id, eos);
  // The template adds BOS; the recipe's add_bos_token/add_eos_token give one BOS and one EOS.
  std::vector<int64_t> plain = tok.encode(" The game", /*add_special_tokens=*/false);
  EXPECT_EQ(tok.encode(" The game"), [&] { auto v = plain; v.insert(v.begin(), bos); return v; }());
  tok.add_bos_token = tok.add_eos_token = true;
  std::vector<int64_t> both = tok.encode(" The game");
  ASSERT_EQ(both.size(), plain.size() + 2);
  EXPECT_EQ(both.front(), bos);
  EXPECT_EQ(both.back(), eos);
  EXPECT_EQ(tok.decode(both, /*skip_special_tokens=*/true), " The game");
  EXPECT_EQ(tok.decode(both), "<|begin_of_text|> The game<|end_of_text|>");
}

TEST(Tokenizer, UnsupportedModelIsAClearError) {
  const std::string dir = hf_scratch("tokenizer_bad");
  std::ofstream(dir + "/tokenizer.json")
      << R"({"model": {"type": "WordPiece", "vocab": {}}, "pre_tokenizer": null})";
  try {
    fsdp::Tokenizer::from_file(dir + "/tokenizer.json");
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("WordPiece"), std::string::npos) << e.what();
  }
}

}  // namespace
