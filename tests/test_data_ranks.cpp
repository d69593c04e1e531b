// DistributedSampler and DataLoader across real rank processes (Note [Sampler striding]).
#include "fsdp/data.h"

#include "testing.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

namespace {

// Example i is (i, i, i): a batch's first column lists its dataset indices.
class IndexDataset : public fsdp::Dataset {
 public:
  explicit IndexDataset(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  fsdp::Example get(int64_t i) const override {
    return {at::full({3}, i, at::kLong), at::full({3}, i + 1, at::kLong)};
  }

 private:
  int64_t n_;
};

// Every rank loads its own batches; gathered, step k of the N ranks (batch B) holds exactly the
// samples of step k of one process with batch B*N, with no sample on two ranks.
void check_striding(fsdp::ProcessGroup& pg, int64_t dataset_size, int64_t B) {
  const int64_t N = pg.size();
  auto data = std::make_shared<IndexDataset>(dataset_size);
  fsdp::DataLoader mine(data, B, fsdp::DistributedSampler(dataset_size, N, pg.rank(), true, 7),
                        /*drop_last=*/true);
  fsdp::DataLoader single(data, B * N, fsdp::DistributedSampler(dataset_size, 1, 0, true, 7),
                          /*drop_last=*/true);
  ASSERT_EQ(mine.num_batches(), single.num_batches());
  for (int64_t epoch : {0, 1, 2}) {
    mine.set_epoch(epoch);
    single.set_epoch(epoch);
    for (int64_t k = 0; k < mine.num_batches(); ++k) {
      at::Tensor local = mine.batch(k).input.select(1, 0).contiguous();  // (B)
      at::Tensor gathered = at::empty({N * B}, at::kLong);
      pg.all_gather_into_tensor(gathered, local);
      auto g = gathered.data_ptr<int64_t>();
      std::multiset<int64_t> together(g, g + N * B);
      EXPECT_EQ(std::set<int64_t>(g, g + N * B).size(), static_cast<size_t>(N * B))
          << "a sample is on two ranks at epoch " << epoch << " step " << k;
      at::Tensor ref = single.batch(k).input.select(1, 0).contiguous();
      auto r = ref.data_ptr<int64_t>();
      EXPECT_EQ(together, std::multiset<int64_t>(r, r + N * B))
          << "rank " << pg.rank() << " epoch " << epoch << " step " << k;
    }
  }
}

TEST(DataRanks, ThreeRanksStrideOneSharedPermutation) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup& pg) { check_striding(pg, 100, 4); });
}

TEST(DataRanks, TwoRanksStrideOneSharedPermutation) {
  fsdp::testing::run_ranks(2, "gloo", [](fsdp::ProcessGroup& pg) { check_striding(pg, 37, 3); });
}

// Each rank process builds the synthetic corpus from the seed alone: all get the same tokens.
TEST(DataRanks, SyntheticCorpusIsIdenticalOnEveryRank) {
  fsdp::testing::run_ranks(3, "gloo", [](fsdp::ProcessGroup& pg) {
    fsdp::demos::SyntheticCorpus corpus(128, 20000, 99);
    at::Tensor t = corpus.tokens();
    at::Tensor weights = at::arange(t.numel(), at::kLong) % 1009 + 1;
    at::Tensor checksum = (t * weights).sum().reshape({1});  // (1) int64
    at::Tensor all = at::empty({pg.size()}, at::kLong);
    pg.all_gather_into_tensor(all, checksum);
    for (int r = 0; r < pg.size(); ++r) {
      EXPECT_EQ(all[r].item<int64_t>(), checksum.item<int64_t>()) << "rank " << r;
    }
  });
}

}  // namespace
