// CommFuture and GradBucket (include/fsdp/comm_hooks.h).
#include "fsdp/comm_hooks.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace fsdp {

namespace detail {
struct CommFutureAccess {
  static const std::shared_ptr<CommFuture::State>& state(const CommFuture& f) { return f.state_; }
};
}  // namespace detail

// Note [Comm hook futures]
// A hook returns a CommFuture: either a value already there, the output of a collective (a Work
// and the tensor it fills), or a continuation of another future. Continuations are lazy: they
// run on the thread that calls wait(), when it does. DDP waits on the bucket futures in bucket
// order after backward (Reducer::finish_backward), on every rank, so every collective a
// continuation starts (PowerSGD's Q all-reduce) is issued in the same order everywhere, which
// Gloo and MPI both require. Running continuations on a completion thread instead (as PyTorch
// does) would order them by timing, which can differ between ranks.
// What overlaps backward is therefore the communication a hook starts when it is called: the
// whole all-reduce for allreduce/fp16/bf16, the uncompressed part and P for PowerSGD (whose
// Q all-reduce needs P reduced first, so it runs after backward).

struct CommFuture::State {
  std::mutex mutex;  // wait() from several threads is safe (the reducer uses one)
  bool done = false;
  at::Tensor value;
  std::exception_ptr error;
  // Exactly one of the following describes how the value is made.
  std::vector<WorkPtr> works;                   // of_work(s): value filled when all complete
  std::shared_ptr<State> parent;                // then/then_future: runs fn on parent's value
  std::function<CommFuture(at::Tensor)> fn;
  std::shared_ptr<State> inner;                 // the future fn returned, once fn ran
};

namespace {

at::Tensor resolve(const std::shared_ptr<CommFuture::State>& s);

// Waits on the already-started part of the chain only.
void drain_state(const std::shared_ptr<CommFuture::State>& s) noexcept {
  if (!s) return;
  std::shared_ptr<CommFuture::State> parent, inner;
  std::vector<WorkPtr> works;
  {
    std::lock_guard<std::mutex> lock(s->mutex);
    if (s->done) return;
    works = s->works;
    parent = s->parent;
    inner = s->inner;
  }
  for (const auto& work : works) {
    try {
      work->wait();
    } catch (...) {
    }
  }
  drain_state(parent);
  drain_state(inner);
}

at::Tensor resolve(const std::shared_ptr<CommFuture::State>& s) {
  std::unique_lock<std::mutex> lock(s->mutex);
  if (s->done) {
    if (s->error) std::rethrow_exception(s->error);
    return s->value;
  }
  try {
    if (!s->parent) {
      for (const auto& work : s->works) work->wait();
      s->works.clear();
    } else {
      TORCH_INTERNAL_ASSERT(s->parent && s->fn, "CommFuture without a source");
      at::Tensor parent_value = resolve(s->parent);
      CommFuture next = s->fn(parent_value);
      TORCH_CHECK(next.valid(), "[comm hook] a continuation returned an invalid CommFuture");
      s->fn = nullptr;
      s->parent.reset();
      // Keep the chain reachable for drain() while it is waited on.
      s->inner = detail::CommFutureAccess::state(next);
      s->value = next.wait();
      s->inner.reset();
    }
  } catch (...) {
    s->error = std::current_exception();
    s->done = true;
    throw;
  }
  s->done = true;
  return s->value;
}

}  // namespace

CommFuture CommFuture::ready(at::Tensor value) {
  CommFuture f;
  f.state_ = std::make_shared<State>();
  f.state_->value = std::move(value);
  f.state_->done = true;
  return f;
}

CommFuture CommFuture::of_work(WorkPtr work, at::Tensor value) {
  return of_works({std::move(work)}, std::move(value));
}

CommFuture CommFuture::of_works(std::vector<WorkPtr> works, at::Tensor value) {
  CommFuture f;
  f.state_ = std::make_shared<State>();
  for (auto& w : works) {
    if (w) f.state_->works.push_back(std::move(w));  // null: nothing to wait for
  }
  f.state_->value = std::move(value);
  return f;
}

CommFuture CommFuture::then_future(std::function<CommFuture(at::Tensor)> fn) const {
  TORCH_CHECK(valid(), "[CommFuture::then] on an invalid future");
  CommFuture f;
  f.state_ = std::make_shared<State>();
  f.state_->parent = state_;
  f.state_->fn = std::move(fn);
  return f;
}

CommFuture CommFuture::then(std::function<at::Tensor(at::Tensor)> fn) const {
  return then_future([fn = std::move(fn)](at::Tensor v) { return CommFuture::ready(fn(std::move(v))); });
}

at::Tensor CommFuture::wait() const {
  TORCH_CHECK(valid(), "[CommFuture::wait] on an invalid future (a hook returned CommFuture())");
  return resolve(state_);
}

bool CommFuture::completed() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

void CommFuture::drain() const noexcept { drain_state(state_); }

GradBucket::GradBucket(int index, int num_buckets, at::Tensor buffer,
                       std::vector<at::Tensor> parameters, std::vector<int64_t> offsets,
                       std::vector<std::string> names)
    : index_(index),
      num_buckets_(num_buckets),
      buffer_(std::move(buffer)),
      parameters_(std::move(parameters)),
      offsets_(std::move(offsets)),
      names_(std::move(names)) {
  TORCH_CHECK(index_ >= 0 && index_ < num_buckets_, "[GradBucket] index ", index_,
              " outside [0, ", num_buckets_, ")");
  TORCH_CHECK(buffer_.dim() == 1 && buffer_.is_contiguous(),
              "[GradBucket] the buffer must be a contiguous 1-D tensor, got sizes ",
              buffer_.sizes());
  TORCH_CHECK(parameters_.size() == offsets_.size(), "[GradBucket] ", parameters_.size(),
              " parameters but ", offsets_.size(), " offsets");
  TORCH_CHECK(names_.empty() || names_.size() == parameters_.size(), "[GradBucket] ",
              parameters_.size(), " parameters but ", names_.size(), " names");
  for (size_t i = 0; i < parameters_.size(); ++i) {
    TORCH_CHECK(offsets_[i] >= 0 && offsets_[i] + parameters_[i].numel() <= buffer_.numel(),
                "[GradBucket] parameter ", i, " (", parameters_[i].numel(),
                " elements at offset ", offsets_[i], ") does not fit the buffer of ",
                buffer_.numel(), " elements");
  }
}

void GradBucket::set_buffer(at::Tensor buffer) {
  TORCH_CHECK(buffer.dim() == 1 && buffer.is_contiguous() && buffer.numel() == buffer_.numel(),
              "[GradBucket::set_buffer] bucket ", index_, ": the new buffer must be a "
              "contiguous 1-D tensor of ", buffer_.numel(), " elements, got sizes ",
              buffer.sizes());
  buffer_ = std::move(buffer);
}

std::vector<at::Tensor> GradBucket::gradients() const {
  std::vector<at::Tensor> out;
  out.reserve(parameters_.size());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    out.push_back(buffer_.narrow(0, offsets_[i], parameters_[i].numel())
                      .view(parameters_[i].sizes()));
  }
  return out;
}

}  // namespace fsdp
