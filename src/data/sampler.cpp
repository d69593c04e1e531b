// DistributedSampler and DataLoader. See include/fsdp/data.h, Note [Sampler striding].
#include "fsdp/data.h"

#include "data/prng.h"

#include <ATen/ATen.h>

#include <numeric>

namespace fsdp {

// ---------------------------------------------------------------------------------------------
// DistributedSampler

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t world, int64_t rank,
                                       bool shuffle, uint64_t seed, bool drop_last)
    : dataset_size_(dataset_size),
      world_(world),
      rank_(rank),
      shuffle_(shuffle),
      seed_(seed),
      drop_last_(drop_last) {
  TORCH_CHECK(dataset_size >= 0, "[DistributedSampler] dataset_size must be >= 0, got ",
              dataset_size);
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "[DistributedSampler] rank ", rank,
              " is not in a world of ", world);
  // drop_last: floor(size / world) per rank; otherwise ceil (the tail is padded by wrapping).
  num_samples_ = drop_last ? dataset_size / world : (dataset_size + world - 1) / world;
}

std::vector<int64_t> DistributedSampler::epoch_order() const {
  std::vector<int64_t> order(dataset_size_);
  std::iota(order.begin(), order.end(), 0);
  if (shuffle_) {
    // Fisher-Yates with the library's PRNG, seeded by seed + epoch (as PyTorch's sampler seeds
    // its generator), so every rank computes the same permutation.
    detail::SplitMix64 rng(seed_ + static_cast<uint64_t>(epoch_));
    for (int64_t i = dataset_size_ - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i + 1)));
      std::swap(order[i], order[j]);
    }
  }
  const int64_t total = total_size();
  if (total <= dataset_size_) {
    order.resize(total);  // drop_last: drop the tail
  } else if (dataset_size_ > 0) {
    // Pad by wrapping around to the beginning of the order (repeatedly if world > size).
    for (int64_t i = dataset_size_; i < total; ++i) order.push_back(order[i - dataset_size_]);
  }
  return order;
}

std::vector<int64_t> DistributedSampler::indices() const {
  const std::vector<int64_t> order = epoch_order();
  std::vector<int64_t> mine;
  mine.reserve(num_samples_);
  for (int64_t i = rank_; i < total_size(); i += world_) mine.push_back(order[i]);
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(mine.size()) == num_samples_);
  return mine;
}

// ---------------------------------------------------------------------------------------------
// DataLoader

DataLoader::DataLoader(DatasetPtr dataset, int64_t batch_size_per_rank, DistributedSampler sampler,
                       bool drop_last)
    : dataset_(std::move(dataset)),
      batch_size_(batch_size_per_rank),
      sampler_(std::move(sampler)),
      drop_last_(drop_last) {
  TORCH_CHECK(dataset_, "[DataLoader] dataset is null");
  TORCH_CHECK(batch_size_ > 0, "[DataLoader] batch_size_per_rank must be positive, got ",
              batch_size_);
  TORCH_CHECK(sampler_.dataset_size() == dataset_->size(), "[DataLoader] the sampler was made for ",
              sampler_.dataset_size(), " samples but the dataset has ", dataset_->size(),
              "; construct DistributedSampler(dataset->size(), ...)");
  indices_ = sampler_.indices();
}

int64_t DataLoader::num_batches() const {
  const auto n = static_cast<int64_t>(indices_.size());
  return drop_last_ ? n / batch_size_ : (n + batch_size_ - 1) / batch_size_;
}

void DataLoader::set_epoch(int64_t epoch) {
  sampler_.set_epoch(epoch);
  indices_ = sampler_.indices();
}

Batch DataLoader::batch(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < num_batches(), "[DataLoader] batch ", i, " out of range (",
              num_batches(), " batches per epoch on this rank)");
  const int64_t begin = i * batch_size_;
  const int64_t end = std::min<int64_t>(begin + batch_size_, indices_.size());
  std::vector<at::Tensor> inputs, targets;
  inputs.reserve(end - begin);
  targets.reserve(end - begin);
  for (int64_t k = begin; k < end; ++k) {
    Example e = dataset_->get(indices_[k]);
    inputs.push_back(std::move(e.input));
    targets.push_back(std::move(e.target));
  }
  return Batch{at::stack(inputs), at::stack(targets)};  // (B, T) each
}

DataLoader::Iterator::Iterator(const DataLoader* loader, int64_t i) : loader_(loader), i_(i) {
  if (i_ < loader_->num_batches()) batch_ = loader_->batch(i_);
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  ++i_;
  batch_ = i_ < loader_->num_batches() ? loader_->batch(i_) : Batch{};
  return *this;
}

}  // namespace fsdp
