// Datasets, the distributed sampler and the data loader of the demos.
//
//   auto data = std::make_shared<fsdp::demos::SyntheticCorpus>(/*vocab=*/128, /*tokens=*/200000,
//                                                              /*seed=*/0);
//   fsdp::DistributedSampler sampler(data->size(), world, rank, /*shuffle=*/true, /*seed=*/42);
//   fsdp::DataLoader loader(data, /*batch_size_per_rank=*/4, sampler);
//   for (int64_t epoch = 0; epoch < 3; ++epoch) {
//     loader.set_epoch(epoch);                          // reshuffles
//     for (const fsdp::Batch& batch : loader) { ... }   // batch.input, batch.target: (B, T) int64
//   }
//
// Note [Sampler striding]
// One permutation of the dataset per epoch is shared by every rank (seeded by seed + epoch with
// the library's own PRNG, so it is the same on every platform and standard library). Rank r takes
// positions r, r+N, r+2N, ... of it (N = world), so at step k the N ranks with batch B together
// see permutation positions [k*B*N, (k+1)*B*N): exactly the samples that one process with batch
// B*N sees at step k. DDP/FSDP parity tests against a single process rely on this.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <iterator>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fsdp {

struct Example {
  at::Tensor input;   // (T) int64
  at::Tensor target;  // (T) int64: input shifted by one token
};

struct Batch {
  at::Tensor input;   // (B, T) int64
  at::Tensor target;  // (B, T) int64
  int64_t size() const { return input.defined() ? input.size(0) : 0; }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Example get(int64_t index) const = 0;
};
using DatasetPtr = std::shared_ptr<const Dataset>;

// A stream of token ids cut into blocks: example i is tokens[i*T, i*T+T) and the same range
// shifted by one. size() = numel / T - 1, as the Lightning demo's WikiText2 (the last block is
// dropped so that every target exists).
class TokenBlockDataset : public Dataset {
 public:
  TokenBlockDataset(at::Tensor tokens, int64_t vocab_size, int64_t block_size);
  int64_t size() const override;
  Example get(int64_t index) const override;  // views into tokens()
  int64_t vocab_size() const { return vocab_size_; }
  int64_t block_size() const { return block_size_; }
  const at::Tensor& tokens() const { return tokens_; }  // (num_tokens) int64

 protected:
  TokenBlockDataset() = default;
  void set_tokens(at::Tensor tokens, int64_t vocab_size, int64_t block_size);

 private:
  at::Tensor tokens_;
  int64_t vocab_size_ = 0;
  int64_t block_size_ = 0;
};

namespace demos {

// WikiText-2, word level, as lightning.pytorch.demos.WikiText2 tokenizes it: each line is split
// on whitespace and "<eos>" is appended; ids are given in order of first appearance. The
// dictionary is built over every split file present in `dir`, in the order train.txt, valid.txt,
// test.txt, so ids and vocab_size() are the same whichever split is read. The requested split
// (train | valid | test) must exist; an error names the directory and the missing file.
class WikiText2 : public TokenBlockDataset {
 public:
  explicit WikiText2(const std::string& dir, const std::string& split = "train",
                     int64_t block_size = 35);
  const std::vector<std::string>& words() const { return words_; }  // id -> word
  int64_t id(const std::string& word) const;                        // -1 when absent
  const std::string& split() const { return split_; }

 private:
  std::vector<std::string> words_;
  std::unordered_map<std::string, int64_t> ids_;  // word -> id
  std::string split_;
};

// A corpus that needs no files and that a model can learn: a seeded sparse Markov chain over
// vocab_size tokens. Each token has kSuccessors distinct successors, drawn once from the seed,
// taken with probabilities kSuccessorWeights; the next token depends only on the current one.
// The best achievable loss is the chain's entropy rate (entropy_rate(), about 1.2 nats), far
// below log(vocab_size). The tokens depend only on (vocab_size, num_tokens, seed): the generator
// is the library's own splitmix64, identical on every platform.
class SyntheticCorpus : public TokenBlockDataset {
 public:
  static constexpr int kSuccessors = 4;
  static constexpr int kSuccessorWeights[kSuccessors] = {50, 25, 15, 10};  // percent

  SyntheticCorpus(int64_t vocab_size, int64_t num_tokens, uint64_t seed, int64_t block_size = 35);
  // Entropy (nats) of the next token given the current one: the loss of a perfect model.
  static double entropy_rate();
  // successors()[a] = the kSuccessors tokens that may follow a, most likely first.
  const std::vector<std::vector<int64_t>>& successors() const { return successors_; }

 private:
  std::vector<std::vector<int64_t>> successors_;
};

}  // namespace demos

// Splits a dataset's indices over ranks (see Note [Sampler striding]).
//
// drop_last=false (PyTorch's default): the permutation is padded by wrapping around to its
// beginning until its length is a multiple of world, so every rank gets ceil(size / world)
// samples; a few samples are then seen twice per epoch.
// drop_last=true: the tail is dropped so every rank gets floor(size / world) samples; a few
// samples are then not seen in that epoch (which ones changes with the shuffle).
// shuffle=false uses the identity order.
class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int64_t world = 1, int64_t rank = 0,
                     bool shuffle = true, uint64_t seed = 0, bool drop_last = false);

  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  int64_t epoch() const { return epoch_; }
  int64_t num_samples() const { return num_samples_; }  // per rank, per epoch
  int64_t total_size() const { return num_samples_ * world_; }
  int64_t dataset_size() const { return dataset_size_; }
  int64_t world() const { return world_; }
  int64_t rank() const { return rank_; }
  bool shuffle() const { return shuffle_; }
  uint64_t seed() const { return seed_; }
  bool drop_last() const { return drop_last_; }

  // This rank's dataset indices for the current epoch, in order.
  std::vector<int64_t> indices() const;
  // The shared order of the whole epoch (size total_size(), before striding).
  std::vector<int64_t> epoch_order() const;

 private:
  int64_t dataset_size_, world_, rank_;
  bool shuffle_;
  uint64_t seed_;
  bool drop_last_;
  int64_t num_samples_ = 0;
  int64_t epoch_ = 0;
};

// Iterates batches of batch_size_per_rank examples in the sampler's order, collated by stacking
// into (B, T). The final partial batch (when num_samples is not a multiple of B) is yielded
// smaller unless drop_last is set; with drop_last every batch has exactly B examples.
// (For the B*N equivalence of Note [Sampler striding] across all steps, use full batches.)
class DataLoader {
 public:
  DataLoader(DatasetPtr dataset, int64_t batch_size_per_rank, DistributedSampler sampler,
             bool drop_last = false);

  int64_t num_batches() const;
  int64_t batch_size() const { return batch_size_; }
  bool drop_last() const { return drop_last_; }
  // Reshuffles: the next iteration (and batch(i)) uses the order of `epoch`.
  void set_epoch(int64_t epoch);
  // The i-th batch of the current epoch, 0 <= i < num_batches().
  Batch batch(int64_t i) const;

  const DistributedSampler& sampler() const { return sampler_; }
  const DatasetPtr& dataset() const { return dataset_; }

  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;
    Iterator(const DataLoader* loader, int64_t i);
    const Batch& operator*() const { return batch_; }
    const Batch* operator->() const { return &batch_; }
    Iterator& operator++();
    bool operator==(const Iterator& other) const { return i_ == other.i_; }
    bool operator!=(const Iterator& other) const { return i_ != other.i_; }

   private:
    const DataLoader* loader_;
    int64_t i_;
    Batch batch_;
  };
  Iterator begin() const { return Iterator(this, 0); }
  Iterator end() const { return Iterator(this, num_batches()); }

 private:
  DatasetPtr dataset_;
  int64_t batch_size_;
  DistributedSampler sampler_;
  bool drop_last_;
  std::vector<int64_t> indices_;  // this rank's indices for the current epoch
};

}  // namespace fsdp
