// Gradient buckets: layout, gradient-ready hooks, in-order launches, collectives in flight. See
// Note [Gradient buckets] in grad_buckets.h.
#include "ddp/grad_buckets.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <memory>

namespace fsdp::detail {

std::vector<int> reverse_order(size_t n) {
  std::vector<int> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<int>(n - 1 - i);
  return order;
}

BucketLayout assign_buckets(const std::vector<BucketItem>& items, const std::vector<int>& order,
                            BucketCap rule) {
  TORCH_INTERNAL_ASSERT(order.size() == items.size(), "bucket order lists ", order.size(),
                        " parameters, there are ", items.size());
  BucketLayout out;
  out.bucket_of.assign(items.size(), -1);
  out.offset_of.assign(items.size(), 0);
  std::vector<int> open;  // the open bucket of each kind, indices into out.buckets
  for (int idx : order) {
    TORCH_INTERNAL_ASSERT(idx >= 0 && idx < static_cast<int>(items.size()) &&
                              out.bucket_of[idx] < 0,
                          "bucket order is not a permutation of the parameters (index ", idx, ")");
    const BucketItem& item = items[idx];
    auto it = std::find_if(open.begin(), open.end(),
                           [&](int b) { return items[out.buckets[b].params.front()].kind == item.kind; });
    if (it != open.end() && rule == BucketCap::kStayUnderCap) {
      const int64_t numel = out.buckets[*it].numel;
      if (numel > 0 && static_cast<double>(numel + item.numel) > item.cap) {
        open.erase(it);
        it = open.end();
      }
    }
    if (it == open.end()) {
      out.buckets.emplace_back();
      open.push_back(static_cast<int>(out.buckets.size()) - 1);
      it = open.end() - 1;
    }
    const int b = *it;
    BucketLayout::Bucket& bucket = out.buckets[b];
    out.bucket_of[idx] = b;
    out.offset_of[idx] = bucket.numel;
    bucket.numel += item.numel;
    bucket.params.push_back(idx);
    if (rule == BucketCap::kCloseAtCap && static_cast<double>(bucket.numel) >= item.cap) {
      open.erase(it);
    }
  }
  return out;
}

// --- GradReadyHooks --------------------------------------------------------------------------

namespace {

class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::shared_ptr<const std::function<void(int)>> checked, int index)
      : checked_(std::move(checked)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/)
      override {
    (*checked_)(index_);
    return outputs;
  }

 private:
  std::shared_ptr<const std::function<void(int)>> checked_;
  int index_;
};

}  // namespace

GradReadyHooks::GradReadyHooks(const std::vector<at::Tensor>& params,
                               std::function<void(int)> checked) {
  auto shared = std::make_shared<const std::function<void(int)>>(std::move(checked));
  installed_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    Installed h;
    h.grad_acc = torch::autograd::impl::grad_accumulator(params[i]);
    TORCH_INTERNAL_ASSERT(h.grad_acc, "parameter ", i,
                          " has no AccumulateGrad node (not a leaf that requires grad)");
    h.key = h.grad_acc->add_post_hook(std::make_unique<ReadyHook>(shared, static_cast<int>(i)));
    installed_.push_back(std::move(h));
  }
}

GradReadyHooks& GradReadyHooks::operator=(GradReadyHooks&& other) noexcept {
  if (this != &other) {
    remove();
    installed_ = std::move(other.installed_);
    other.installed_.clear();
  }
  return *this;
}

void GradReadyHooks::remove() noexcept {
  for (auto& h : installed_) h.grad_acc->del_post_hook(h.key);
  installed_.clear();
}

// --- GradBuckets -----------------------------------------------------------------------------

GradBuckets::GradBuckets(BucketLayout layout, int max_in_flight, Ops ops)
    : max_in_flight_(max_in_flight), ops_(std::move(ops)) {
  TORCH_INTERNAL_ASSERT(max_in_flight_ >= 0, "max_in_flight must be >= 0 (0: unbounded)");
  TORCH_INTERNAL_ASSERT(ops_.copy_in && ops_.issue && ops_.finish, "GradBuckets needs all ops");
  set_layout(std::move(layout));
}

void GradBuckets::set_layout(BucketLayout layout) {
  TORCH_INTERNAL_ASSERT(in_flight_.empty(), "bucket layout replaced while ", in_flight_.size(),
                        " collectives are in flight");
  layout_ = std::move(layout);
  ready_.assign(layout_.bucket_of.size(), false);
  pending_.assign(layout_.buckets.size(), 0);
  launched_.assign(layout_.buckets.size(), false);
  arm();
}

void GradBuckets::arm() {
  for (size_t b = 0; b < layout_.buckets.size(); ++b) {
    pending_[b] = static_cast<int>(layout_.buckets[b].params.size());
    launched_[b] = false;
  }
  std::fill(ready_.begin(), ready_.end(), false);
  next_to_launch_ = 0;
  held_ = 0;
  launch_order_.clear();
}

void GradBuckets::mark_ready(int param) {
  TORCH_INTERNAL_ASSERT(!ready_[param], "parameter ", param, " marked ready twice");
  ready_[param] = true;
  const int b = layout_.bucket_of[param];
  if (launched_[b]) return;  // launched without it (launch_remaining): its owner reduces it late
  TORCH_INTERNAL_ASSERT(pending_[b] > 0);
  if (--pending_[b] == 0 && b != next_to_launch_) ++held_;
}

void GradBuckets::launch_ready() {
  while (next_to_launch_ < num_buckets() && pending_[next_to_launch_] == 0) {
    launch_order_.push_back(next_to_launch_);
    launch(next_to_launch_++);
  }
}

void GradBuckets::launch_remaining() {
  while (next_to_launch_ < num_buckets()) {
    launch_order_.push_back(next_to_launch_);
    launch(next_to_launch_++);
  }
}

void GradBuckets::launch(int bucket) {
  launched_[bucket] = true;
  ops_.copy_in(bucket);
  while (max_in_flight_ != kUnbounded && static_cast<int>(in_flight_.size()) >= max_in_flight_) {
    const int oldest = in_flight_.front();
    in_flight_.pop_front();
    ops_.finish(oldest);
  }
  ops_.issue(bucket);
  in_flight_.push_back(bucket);
}

void GradBuckets::finish_all() {
  while (!in_flight_.empty()) {
    const int oldest = in_flight_.front();
    in_flight_.pop_front();
    ops_.finish(oldest);
  }
}

}  // namespace fsdp::detail
