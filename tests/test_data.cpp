// Datasets (WikiText2, SyntheticCorpus), DistributedSampler and DataLoader.
#include "fsdp/data.h"

#include "data/prng.h"
#include "testing.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using fsdp::DataLoader;
using fsdp::DistributedSampler;

const std::string kFixtureDir = std::string(FSDP_SOURCE_DIR) + "/tests/fixtures/wikitext-mini";

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// A dataset whose example i is (i, i, ...) so batches reveal which indices they hold.
class IndexDataset : public fsdp::Dataset {
 public:
  explicit IndexDataset(int64_t n, int64_t t = 3) : n_(n), t_(t) {}
  int64_t size() const override { return n_; }
  fsdp::Example get(int64_t i) const override {
    return {at::full({t_}, i, at::kLong), at::full({t_}, i + 1000, at::kLong)};
  }

 private:
  int64_t n_, t_;
};

std::multiset<int64_t> batch_indices(const fsdp::Batch& b) {
  auto v = to_vector(b.input.select(1, 0));
  return std::multiset<int64_t>(v.begin(), v.end());
}

// ---------------------------------------------------------------------------------------------
// WikiText2

// Expected ids: Python's `line.split() + ["<eos>"]` over train.txt then valid.txt, ids in order
// of first appearance (a=0 b=1 c=2 <eos>=3 d=4 e=5 f=6 g=7).
TEST(WikiText2, FixtureTokenizationExactIds) {
  fsdp::demos::WikiText2 train(kFixtureDir, "train", /*block_size=*/3);
  EXPECT_EQ(train.vocab_size(), 8);
  EXPECT_EQ(to_vector(train.tokens()),
            (std::vector<int64_t>{0, 1, 2, 3, 1, 0, 3, 3, 2, 4, 5, 0, 3}));
  EXPECT_EQ(train.words(),
            (std::vector<std::string>{"a", "b", "c", "<eos>", "d", "e", "f", "g"}));
  EXPECT_EQ(train.id("<eos>"), 3);
  EXPECT_EQ(train.id("zebra"), -1);
  // 13 tokens / block 3 - 1 = 3 examples; example 2 is tokens[6, 9) -> tokens[7, 10).
  ASSERT_EQ(train.size(), 3);
  auto e = train.get(2);
  EXPECT_EQ(to_vector(e.input), (std::vector<int64_t>{3, 3, 2}));
  EXPECT_EQ(to_vector(e.target), (std::vector<int64_t>{3, 2, 4}));
  EXPECT_THROW(train.get(3), c10::Error);

  // The dictionary spans every present split, so valid's ids continue train's.
  fsdp::demos::WikiText2 valid(kFixtureDir, "valid", /*block_size=*/2);
  EXPECT_EQ(valid.vocab_size(), 8);
  EXPECT_EQ(to_vector(valid.tokens()), (std::vector<int64_t>{5, 6, 0, 3, 7, 3}));
}

TEST(WikiText2, LineEndingsMatchPythonTextMode) {
  // CRLF, a lone CR and a last line without newline: Python text mode sees lines
  // "x y", "y", "", "z" -> x y <eos> y <eos> <eos> z <eos>.
  fs::path dir = fs::temp_directory_path() / ("fsdp_wt2_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "test.txt", std::ios::binary) << "x y\r\ny\r\rz";
  fsdp::demos::WikiText2 data(dir.string(), "test", 1);
  EXPECT_EQ(to_vector(data.tokens()), (std::vector<int64_t>{0, 1, 2, 1, 2, 2, 3, 2}));
  fs::remove_all(dir);
}

TEST(WikiText2, MissingSplitNamesDirectoryAndFile) {
  const std::string msg = error_of([] { fsdp::demos::WikiText2(kFixtureDir, "test"); });
  EXPECT_NE(msg.find("test.txt"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kFixtureDir), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.txt valid.txt"), std::string::npos) << msg;  // what is there

  const std::string bad_split = error_of([] { fsdp::demos::WikiText2(kFixtureDir, "validation"); });
  EXPECT_NE(bad_split.find("train, valid, test"), std::string::npos) << bad_split;
  const std::string no_dir = error_of([] { fsdp::demos::WikiText2("/nonexistent/wt2", "train"); });
  EXPECT_NE(no_dir.find("/nonexistent/wt2"), std::string::npos) << no_dir;
}

TEST(WikiText2, SharedDataVocabularyOfValidAndTest) {
  const std::string dir = fsdp::testing::wikitext2_dir();
  if (dir.empty()) {
    GTEST_SKIP() << "[fsdp-skip] ../shared/data/wikitext-2 is absent; WikiText-2 test skipped";
  }
  fsdp::demos::WikiText2 valid(dir, "valid");
  fsdp::demos::WikiText2 test(dir, "test");
  EXPECT_EQ(valid.vocab_size(), test.vocab_size());

  // Independent count: distinct whitespace-separated words of both files, plus <eos>; token
  // count = words + lines.
  std::unordered_set<std::string> distinct{"<eos>"};
  int64_t valid_tokens = 0;
  for (const char* name : {"valid.txt", "test.txt"}) {
    std::ifstream in(fs::path(dir) / name);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      std::string w;
      int64_t n = 1;  // <eos>
      while (words >> w) distinct.insert(w), ++n;
      if (std::string(name) == "valid.txt") valid_tokens += n;
    }
  }
  EXPECT_EQ(valid.vocab_size(), static_cast<int64_t>(distinct.size()));
  EXPECT_EQ(valid.tokens().numel(), valid_tokens);
  // The Python reference tokenizer (lightning.pytorch.demos.tokenize, over valid then test)
  // gives 18328 words for this data.
  EXPECT_EQ(valid.vocab_size(), 18328);
  EXPECT_EQ(valid.size(), valid_tokens / 35 - 1);
}

// ---------------------------------------------------------------------------------------------
// SyntheticCorpus and the PRNG

TEST(SplitMix64, MatchesReferenceSequence) {
  // First outputs of the reference splitmix64.c for seed 0.
  fsdp::detail::SplitMix64 rng(0);
  EXPECT_EQ(rng.next(), 0xE220A8397B1DCDAFULL);
  EXPECT_EQ(rng.next(), 0x6E789E6AA1B965F4ULL);
  EXPECT_EQ(rng.next(), 0x06C45D188009454FULL);
  fsdp::detail::SplitMix64 bounded(7);
  for (int i = 0; i < 1000; ++i) EXPECT_LT(bounded.below(3), 3u);
}

TEST(SyntheticCorpus, DeterministicForSeed) {
  fsdp::demos::SyntheticCorpus a(64, 5000, 11), b(64, 5000, 11), c(64, 5000, 12);
  EXPECT_TRUE(at::equal(a.tokens(), b.tokens()));
  EXPECT_FALSE(at::equal(a.tokens(), c.tokens()));
  EXPECT_EQ(a.vocab_size(), 64);
  EXPECT_EQ(a.size(), 5000 / 35 - 1);
  EXPECT_GE(a.tokens().min().item<int64_t>(), 0);
  EXPECT_LT(a.tokens().max().item<int64_t>(), 64);
}

TEST(SyntheticCorpus, IsASparseMarkovChainWithLowEntropy) {
  const int64_t V = 128, N = 200000;
  fsdp::demos::SyntheticCorpus corpus(V, N, 3);
  auto tokens = to_vector(corpus.tokens());
  // Every transition is to one of the token's successors; count which rank it was.
  std::vector<int64_t> rank_counts(fsdp::demos::SyntheticCorpus::kSuccessors, 0);
  std::map<std::pair<int64_t, int64_t>, int64_t> pair_counts;
  std::vector<int64_t> from_counts(V, 0);
  for (int64_t i = 0; i + 1 < N; ++i) {
    const auto& next = corpus.successors()[tokens[i]];
    auto it = std::find(next.begin(), next.end(), tokens[i + 1]);
    ASSERT_NE(it, next.end()) << "transition " << tokens[i] << " -> " << tokens[i + 1];
    rank_counts[it - next.begin()]++;
    pair_counts[{tokens[i], tokens[i + 1]}]++;
    from_counts[tokens[i]]++;
  }
  for (int k = 0; k < fsdp::demos::SyntheticCorpus::kSuccessors; ++k) {
    EXPECT_NEAR(rank_counts[k] / double(N - 1),
                fsdp::demos::SyntheticCorpus::kSuccessorWeights[k] / 100.0, 0.01);
  }
  // Empirical conditional entropy ~ entropy_rate(), far below log(V).
  double h = 0;
  for (const auto& [pair, n] : pair_counts) {
    h -= (n / double(N - 1)) * std::log(n / double(from_counts[pair.first]));
  }
  const double rate = fsdp::demos::SyntheticCorpus::entropy_rate();
  EXPECT_NEAR(rate, 1.2080, 1e-3);
  EXPECT_NEAR(h, rate, 0.02);
  EXPECT_LT(rate, 0.3 * std::log(double(V)));
}

// ---------------------------------------------------------------------------------------------
// DistributedSampler

TEST(DistributedSampler, RanksAreDisjointAndCoverTheDataset) {
  const int64_t size = 100, world = 3;
  for (bool drop_last : {false, true}) {
    std::multiset<int64_t> all;
    for (int64_t r = 0; r < world; ++r) {
      DistributedSampler s(size, world, r, /*shuffle=*/true, /*seed=*/5, drop_last);
      auto idx = s.indices();
      EXPECT_EQ(static_cast<int64_t>(idx.size()), drop_last ? 33 : 34);
      all.insert(idx.begin(), idx.end());
    }
    std::set<int64_t> distinct(all.begin(), all.end());
    if (drop_last) {
      EXPECT_EQ(all.size(), 99u);       // one sample dropped...
      EXPECT_EQ(distinct.size(), 99u);  // ...and no sample on two ranks
    } else {
      EXPECT_EQ(all.size(), 102u);       // padded by wrapping around: 2 repeats
      EXPECT_EQ(distinct.size(), 100u);  // every sample seen
    }
    for (int64_t i : distinct) EXPECT_TRUE(i >= 0 && i < size);
  }
}

TEST(DistributedSampler, StridesOneSharedPermutation) {
  DistributedSampler r0(10, 3, 0, true, 9), r2(10, 3, 2, true, 9);
  auto order = r0.epoch_order();
  EXPECT_EQ(order, r2.epoch_order());
  ASSERT_EQ(order.size(), 12u);
  EXPECT_EQ(order[10], order[0]);  // wrap-around padding
  EXPECT_EQ(order[11], order[1]);
  EXPECT_EQ(r2.indices(), (std::vector<int64_t>{order[2], order[5], order[8], order[11]}));
  // No shuffle: identity order.
  DistributedSampler plain(7, 2, 1, /*shuffle=*/false);
  EXPECT_EQ(plain.indices(), (std::vector<int64_t>{1, 3, 5, 0}));
  // More ranks than samples: every rank still gets one.
  DistributedSampler tiny(2, 3, 2, false);
  EXPECT_EQ(tiny.indices(), (std::vector<int64_t>{0}));
}

TEST(DistributedSampler, ReshufflesPerEpochDeterministically) {
  DistributedSampler s(50, 1, 0, true, 123);
  auto e0 = s.indices();
  s.set_epoch(1);
  auto e1 = s.indices();
  EXPECT_NE(e0, e1);
  for (auto* v : {&e0, &e1}) {  // each epoch is a permutation
    std::vector<int64_t> sorted = *v;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < 50; ++i) EXPECT_EQ(sorted[i], i);
  }
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), e0);
  EXPECT_NE(DistributedSampler(50, 1, 0, true, 124).indices(), e0);  // the seed matters
}

TEST(DistributedSampler, RejectsBadRank) {
  EXPECT_THROW(DistributedSampler(10, 3, 3), c10::Error);
  EXPECT_THROW(DistributedSampler(10, 0, 0), c10::Error);
}

// ---------------------------------------------------------------------------------------------
// DataLoader

TEST(DataLoader, OneProcessWithBatchBNSeesWhatNRanksWithBatchBSee) {
  auto data = std::make_shared<IndexDataset>(120);
  const int64_t B = 4, N = 3;
  for (int64_t epoch : {0, 1}) {
    DataLoader single(data, B * N, DistributedSampler(120, 1, 0, true, 7));
    single.set_epoch(epoch);
    std::vector<DataLoader> ranks;
    for (int64_t r = 0; r < N; ++r) {
      ranks.emplace_back(data, B, DistributedSampler(120, N, r, true, 7));
      ranks.back().set_epoch(epoch);
      ASSERT_EQ(ranks.back().num_batches(), single.num_batches());
    }
    for (int64_t k = 0; k < single.num_batches(); ++k) {
      std::multiset<int64_t> together;
      for (auto& loader : ranks) {
        auto part = batch_indices(loader.batch(k));
        together.insert(part.begin(), part.end());
      }
      EXPECT_EQ(together, batch_indices(single.batch(k))) << "epoch " << epoch << " step " << k;
    }
  }
}

TEST(DataLoader, CollatesBatchesAndHandlesTheLastPartialBatch) {
  auto corpus = std::make_shared<fsdp::demos::SyntheticCorpus>(32, 35 * 11, 1);  // 10 examples
  ASSERT_EQ(corpus->size(), 10);
  DataLoader keep(corpus, 4, DistributedSampler(10, 1, 0, false));
  EXPECT_EQ(keep.num_batches(), 3);
  std::vector<int64_t> sizes;
  for (const fsdp::Batch& b : keep) {
    sizes.push_back(b.size());
    EXPECT_EQ(b.input.sizes(), b.target.sizes());
    EXPECT_EQ(b.input.size(1), 35);
    EXPECT_EQ(b.input.scalar_type(), at::kLong);
    // target is the input shifted by one token
    EXPECT_TRUE(at::equal(b.target.slice(1, 0, 34), b.input.slice(1, 1, 35)));
  }
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 4, 2}));
  // Unshuffled, batch 1 holds examples 4..7 in order.
  EXPECT_TRUE(at::equal(keep.batch(1).input[0], corpus->get(4).input));

  DataLoader drop(corpus, 4, DistributedSampler(10, 1, 0, false), /*drop_last=*/true);
  EXPECT_EQ(drop.num_batches(), 2);
  int64_t n = 0;
  for (const auto& b : drop) {
    EXPECT_EQ(b.size(), 4);
    ++n;
  }
  EXPECT_EQ(n, 2);
  EXPECT_THROW(drop.batch(2), c10::Error);
}

TEST(DataLoader, SetEpochReshuffles) {
  auto data = std::make_shared<IndexDataset>(40);
  DataLoader loader(data, 40, DistributedSampler(40, 1, 0, true, 3));
  auto first = to_vector(loader.batch(0).input.select(1, 0));
  loader.set_epoch(1);
  auto second = to_vector(loader.batch(0).input.select(1, 0));
  EXPECT_NE(first, second);
  EXPECT_EQ(loader.sampler().epoch(), 1);
}

TEST(DataLoader, SamplerSizeMustMatchDataset) {
  auto data = std::make_shared<IndexDataset>(40);
  const std::string msg = error_of([&] { DataLoader(data, 4, DistributedSampler(39)); });
  EXPECT_NE(msg.find("39"), std::string::npos) << msg;
  EXPECT_NE(msg.find("40"), std::string::npos) << msg;
}

}  // namespace
