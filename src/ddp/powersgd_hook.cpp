// PowerSGD: PowerSGDState, powersgd_hook and batched_powersgd_hook, PyTorch's
// torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py in C++ with the same algorithm,
// defaults and random numbers. See docs/ddp_comm_hooks.md for the algorithm and the differences.
#include "fsdp/comm_hooks.h"

#include "ddp/hook_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace fsdp {

// Note [PowerSGD random Q]
// PyTorch draws a fresh Q as: seed = state.rng.randint(1_000_000_000) with rng =
// numpy.random.RandomState(random_seed) (legacy MT19937, init_genrand(seed)), then
// torch.manual_seed(seed) inside fork_rng and torch.randn for each Q in turn. numpy's legacy
// randint(high) masks 32-bit outputs to the next power of two minus one and rejects values
// >= high, so next_seed() does the same with std::mt19937 (the same generator and seeding);
// a CPU generator seeded with `seed` then gives torch.randn's numbers. The global RNG is not
// touched (fork_rng). Tested against numpy in tests/test_ddp_comm_hooks.cpp.

PowerSGDState::PowerSGDState(PowerSGDOptions options, ProcessGroupPtr process_group)
    : CommHookState(std::move(process_group)), options_(options), rng_(options.random_seed) {
  TORCH_CHECK(options_.matrix_approximation_rank >= 1,
              "[PowerSGDState] matrix_approximation_rank must be >= 1, got ",
              options_.matrix_approximation_rank);
  TORCH_CHECK(!(options_.use_error_feedback || options_.warm_start) ||
                  options_.start_powersgd_iter > 1,
              "[PowerSGDState] start_powersgd_iter must be > 1 when use_error_feedback or "
              "warm_start is on (got ", options_.start_powersgd_iter, "): PowerSGD starts after "
              "DDP's first iterations, in which buckets may be rebuilt (static_graph); PyTorch "
              "has the same rule");
  TORCH_CHECK(options_.min_compression_rate >= 0, "[PowerSGDState] min_compression_rate must "
              "be >= 0, got ", options_.min_compression_rate);
  TORCH_CHECK(options_.orthogonalization_epsilon >= 0, "[PowerSGDState] "
              "orthogonalization_epsilon must be >= 0, got ", options_.orthogonalization_epsilon);
}

double PowerSGDState::compression_rate() const {
  return total_numel_after_ > 0 ? static_cast<double>(total_numel_before_) / total_numel_after_
                                : 0.0;
}

void PowerSGDState::maybe_increase_iter(bool bucket_is_last) {
  if (bucket_is_last) ++iter_;
}

uint32_t PowerSGDState::next_seed() {
  // See Note [PowerSGD random Q]: numpy RandomState.randint(1_000_000_000).
  constexpr uint32_t kMax = 1000000000u - 1;  // closed range [0, kMax]
  constexpr uint32_t kMask = (1u << 30) - 1;  // smallest 2^k - 1 >= kMax
  for (;;) {
    const uint32_t v = static_cast<uint32_t>(rng_()) & kMask;
    if (v <= kMax) return v;
  }
}

CommHookStateDict PowerSGDState::state_dict() const {
  CommHookStateDict d;
  d.values["iter"] = std::to_string(iter_);
  d.values["numel_before_compression"] = std::to_string(total_numel_before_);
  d.values["numel_after_compression"] = std::to_string(total_numel_after_);
  std::ostringstream rng;
  rng << rng_;
  d.values["rng"] = rng.str();
  for (const auto& [b, t] : error_dict) d.tensors["error." + std::to_string(b)] = t;
  for (const auto& [b, t] : p_memory_dict) d.tensors["p." + std::to_string(b)] = t;
  for (const auto& [b, t] : q_memory_dict) d.tensors["q." + std::to_string(b)] = t;
  return d;
}

namespace {

int64_t int_value(const CommHookStateDict& d, const std::string& key, const char* who) {
  auto it = d.values.find(key);
  TORCH_CHECK(it != d.values.end(), "[", who, "] saved state lacks '", key, "'");
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    TORCH_CHECK(false, "[", who, "] saved '", key, "' is not an integer: '", it->second, "'");
  }
}

}  // namespace

void PowerSGDState::load_state_dict(const CommHookStateDict& d, bool same_world) {
  iter_ = int_value(d, "iter", "PowerSGDState::load_state_dict");
  total_numel_before_ = int_value(d, "numel_before_compression", "PowerSGDState::load_state_dict");
  total_numel_after_ = int_value(d, "numel_after_compression", "PowerSGDState::load_state_dict");
  auto rng = d.values.find("rng");
  TORCH_CHECK(rng != d.values.end(), "[PowerSGDState::load_state_dict] saved state lacks 'rng'");
  std::istringstream in(rng->second);
  in >> rng_;
  TORCH_CHECK(!in.fail(), "[PowerSGDState::load_state_dict] saved 'rng' is not an MT19937 state");
  error_dict.clear();
  p_memory_dict.clear();
  q_memory_dict.clear();
  if (!same_world) return;  // errors are per rank; P and Q are rebuilt on the next step
  for (const auto& [key, t] : d.tensors) {
    const auto dot = key.find('.');
    TORCH_CHECK(dot != std::string::npos, "[PowerSGDState::load_state_dict] unexpected tensor '",
                key, "'");
    const std::string kind = key.substr(0, dot);
    const int b = std::stoi(key.substr(dot + 1));
    if (kind == "error") error_dict[b] = t;
    else if (kind == "p") p_memory_dict[b] = t;
    else if (kind == "q") q_memory_dict[b] = t;
    else TORCH_CHECK(false, "[PowerSGDState::load_state_dict] unexpected tensor '", key, "'");
  }
}

namespace {

// PyTorch's _orthogonalize_gram_schmidt on a batch of matrices (B, n, r), in place.
void gram_schmidt(const at::Tensor& matrices, double epsilon) {
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::linalg_vector_norm(col, 2, at::IntArrayRef{1}, /*keepdim=*/true);
    // epsilon 0 divides by the norm itself: a zero column becomes NaN, as in PyTorch (whose
    // ZeroDivisionError branch never runs for tensors).
    if (epsilon == 0) col.div_(norm);
    else col.div_(norm + epsilon);
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, at::IntArrayRef{1}, /*keepdim=*/true) * col);
    }
  }
}

// PyTorch's _orthogonalize: Gram-Schmidt for rank <= 2 or half precision, else QR.
void orthogonalize(const at::Tensor& matrices, double epsilon) {
  TORCH_INTERNAL_ASSERT(matrices.dim() == 3 && matrices.size(2) <= matrices.size(1));
  const auto dtype = matrices.scalar_type();
  if (matrices.size(2) <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    gram_schmidt(matrices, epsilon);
  } else {
    matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
  }
}

at::Generator seeded_generator(uint32_t seed) {
  return at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
}

void check_error_size(const at::Tensor& error, int64_t expected, int bucket, const char* hook) {
  TORCH_CHECK(error.numel() == expected, "[", hook, "] the error-feedback memory of bucket ",
              bucket, " has ", error.numel(), " elements but the bucket now needs ", expected,
              ": the bucket layout changed since it was made (a different bucket_cap_mb, model "
              "or static_graph order than the run that saved it?); resume with the same DDP "
              "options");
}

}  // namespace

CommFuture powersgd_hook(CommHookState& s, GradBucket& bucket) {
  constexpr const char* kHook = "powersgd_hook";
  PowerSGDState& state = detail::state_as<PowerSGDState>(s, kHook, "PowerSGDState");
  ProcessGroupPtr group = state.process_group;
  const int64_t world = detail::hook_group(state, kHook).size();
  const PowerSGDOptions& o = state.options();
  at::Tensor input = bucket.buffer();
  const bool is_last = bucket.is_last();

  if (state.iter() < o.start_powersgd_iter) {
    state.maybe_increase_iter(is_last);
    return detail::allreduce_average(*group, input);
  }

  const int b = bucket.index();
  at::Tensor input_copy;
  if (o.use_error_feedback) {
    auto it = state.error_dict.find(b);
    if (it != state.error_dict.end()) {
      check_error_size(it->second, input.numel(), b, kHook);
      input.add_(it->second);
    } else {
      state.error_dict[b] = at::zeros({input.numel()}, input.options());
    }
    input_copy = input.clone();
  }

  // Which gradients are worth compressing: (n + m) * r * rate < n * m for the matrix view
  // (shape[0], -1); the rest (vectors, small matrices) goes uncompressed.
  std::vector<at::Tensor> to_compress;   // (n, m) views into the buffer
  std::vector<at::Tensor> uncompressed;  // gradient views
  int64_t total_ps = 0, total_qs = 0, before = 0, after = 0;
  for (const at::Tensor& t : bucket.gradients()) {
    at::Tensor matrix = t.dim() == 0 ? t.view({1, 1}) : t.view({t.size(0), -1});
    const int64_t n = matrix.size(0), m = matrix.size(1);
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    before += n * m;
    if (static_cast<double>((n + m) * r) * o.min_compression_rate < static_cast<double>(n * m)) {
      to_compress.push_back(matrix);
      total_ps += n * r;
      total_qs += m * r;
      after += (n + m) * r;
    } else {
      uncompressed.push_back(t);
      after += n * m;
    }
  }
  state.count(before, after);

  at::Tensor uncompressed_memory = at::empty({0}, input.options());
  if (!uncompressed.empty()) {
    std::vector<at::Tensor> flat;
    for (const auto& t : uncompressed) flat.push_back(t.reshape({-1}));
    uncompressed_memory = at::cat(flat);
  }

  bool randomize_qs = false;
  if (!o.warm_start || state.p_memory_dict.count(b) == 0) {
    randomize_qs = true;
    state.p_memory_dict[b] = at::empty({total_ps}, input.options());
    state.q_memory_dict[b] = at::empty({total_qs}, input.options());
  }
  at::Tensor p_memory = state.p_memory_dict[b];
  at::Tensor q_memory = state.q_memory_dict[b];
  TORCH_CHECK(p_memory.numel() == total_ps && q_memory.numel() == total_qs, "[", kHook,
              "] the warm-start P/Q of bucket ", b, " do not fit the bucket's matrices: the "
              "bucket layout changed since they were made; resume with the same DDP options");

  // Same-shaped matrices grouped in order of first appearance (PyTorch's shape_to_tensors),
  // batched into one (B, n, m) tensor each when batch_tensors_with_same_shape.
  std::vector<std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_shape;
  for (const auto& t : to_compress) {
    std::vector<int64_t> shape = t.sizes().vec();
    auto it = std::find_if(by_shape.begin(), by_shape.end(),
                           [&](const auto& e) { return e.first == shape; });
    if (it == by_shape.end()) by_shape.push_back({shape, {t}});
    else it->second.push_back(t);
  }
  std::vector<at::Tensor> batches, ps, qs;  // (B, n, m), (B, n, r), (B, m, r)
  std::vector<const std::vector<at::Tensor>*> stacked_from;  // originals of a stacked batch
  for (const auto& [shape, group_tensors] : by_shape) {
    if (o.batch_tensors_with_same_shape) {
      if (group_tensors.size() == 1) {
        batches.push_back(group_tensors[0].unsqueeze(0));
        stacked_from.push_back(nullptr);
      } else {
        batches.push_back(at::stack(group_tensors));
        stacked_from.push_back(&group_tensors);
      }
    } else {
      for (const auto& t : group_tensors) {
        batches.push_back(t.unsqueeze(0));
        stacked_from.push_back(nullptr);
      }
    }
  }
  // Copies of the original lists (by_shape dies with this call; decompress needs them).
  std::vector<std::vector<at::Tensor>> originals(batches.size());
  for (size_t i = 0; i < batches.size(); ++i) {
    if (stacked_from[i]) originals[i] = *stacked_from[i];
  }
  int64_t p_idx = 0, q_idx = 0;
  for (const auto& t : batches) {
    const int64_t bs = t.size(0), n = t.size(1), m = t.size(2);
    const int64_t r = std::min({n, m, o.matrix_approximation_rank});
    ps.push_back(p_memory.narrow(0, p_idx, bs * n * r).view({bs, n, r}));
    qs.push_back(q_memory.narrow(0, q_idx, bs * m * r).view({bs, m, r}));
    p_idx += bs * n * r;
    q_idx += bs * m * r;
  }

  const double eps = o.orthogonalization_epsilon;
  if (!randomize_qs) {
    for (const auto& q : qs) orthogonalize(q, eps);
  } else if (!qs.empty()) {
    // See Note [PowerSGD random Q].
    at::Generator gen = seeded_generator(state.next_seed());
    for (const auto& q : qs) {
      q.copy_(at::randn(q.sizes(), gen, q.options().device(at::kCPU)));
      orthogonalize(q, eps);
    }
  } else {
    state.next_seed();  // PyTorch draws the seed even when the bucket has nothing to compress
  }
  for (size_t i = 0; i < batches.size(); ++i) at::bmm_out(ps[i], batches[i], qs[i]);

  // The uncompressed part and P go out now (P does not depend on the uncompressed result;
  // PyTorch chains them, the values are the same). See Note [Comm hook futures].
  WorkPtr uncompressed_work =
      uncompressed_memory.numel() > 0 ? group->all_reduce_async(uncompressed_memory, ReduceOp::kSum)
                                      : nullptr;
  WorkPtr p_work = p_memory.numel() > 0 ? group->all_reduce_async(p_memory, ReduceOp::kSum) : nullptr;

  PowerSGDState* st = &state;  // the state outlives the step (DDP owns it)
  return CommFuture::of_works({uncompressed_work, p_work}, input)
      .then_future([=](at::Tensor) mutable {
        uncompressed_memory.div_(world);
        int64_t idx = 0;
        for (const auto& t : uncompressed) {
          t.copy_(uncompressed_memory.narrow(0, idx, t.numel()).view(t.sizes()));
          idx += t.numel();
        }
        // P was summed, not averaged: orthogonalization does not care about its scale.
        for (const auto& p : ps) orthogonalize(p, eps);
        for (size_t i = 0; i < batches.size(); ++i) {
          at::bmm_out(qs[i], batches[i].transpose(1, 2), ps[i]);
        }
        if (q_memory.numel() == 0) return CommFuture::ready(q_memory);
        return CommFuture::of_work(group->all_reduce_async(q_memory, ReduceOp::kSum), q_memory);
      })
      .then([=](at::Tensor) mutable {
        q_memory.div_(world);
        for (size_t i = 0; i < batches.size(); ++i) {
          at::bmm_out(batches[i], ps[i], qs[i].transpose(1, 2));
        }
        for (size_t i = 0; i < batches.size(); ++i) {
          for (size_t k = 0; k < originals[i].size(); ++k) originals[i][k].copy_(batches[i][k]);
        }
        if (st->options().use_error_feedback) st->error_dict[b] = input_copy - input;
        if (!st->options().warm_start) {
          st->p_memory_dict.clear();
          st->q_memory_dict.clear();
        }
        st->maybe_increase_iter(is_last);
        return input;
      });
}

CommFuture batched_powersgd_hook(CommHookState& s, GradBucket& bucket) {
  constexpr const char* kHook = "batched_powersgd_hook";
  PowerSGDState& state = detail::state_as<PowerSGDState>(s, kHook, "PowerSGDState");
  ProcessGroupPtr group = state.process_group;
  const int64_t world = detail::hook_group(state, kHook).size();
  const PowerSGDOptions& o = state.options();
  at::Tensor input = bucket.buffer();
  const bool is_last = bucket.is_last();

  if (state.iter() < o.start_powersgd_iter) {
    state.maybe_increase_iter(is_last);
    return detail::allreduce_average(*group, input);
  }

  const int64_t total = input.numel();
  const int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
  const int64_t rank = o.matrix_approximation_rank;
  TORCH_CHECK(rank <= side, "[", kHook, "] matrix_approximation_rank ", rank, " exceeds the "
              "side of bucket ", bucket.index(), "'s square matrix (", side, ")");
  state.count(total, side * rank * 2);
  // The bucket as a zero-padded side x side matrix. PyTorch resizes the bucket buffer in
  // place; here the padded matrix is a copy (the buffer holds the parameters' .grad views).
  at::Tensor padded = at::zeros({side * side}, input.options());
  padded.narrow(0, 0, total).copy_(input);

  const int b = bucket.index();
  at::Tensor padded_copy;
  if (o.use_error_feedback) {
    auto it = state.error_dict.find(b);
    if (it != state.error_dict.end()) {
      check_error_size(it->second, side * side, b, kHook);
      padded.add_(it->second);
    } else {
      state.error_dict[b] = at::zeros({side * side}, input.options());
    }
    padded_copy = padded.clone();
  }
  at::Tensor matrix = padded.view({side, side});

  if (!o.warm_start || state.p_memory_dict.count(b) == 0) {
    state.p_memory_dict[b] = at::empty({side, rank}, input.options());
    // See Note [PowerSGD random Q].
    at::Generator gen = seeded_generator(state.next_seed());
    state.q_memory_dict[b] = at::randn({side, rank}, gen, input.options().device(at::kCPU))
                                 .to(input.device());
  }
  at::Tensor p = state.p_memory_dict[b];
  at::Tensor q = state.q_memory_dict[b];
  TORCH_CHECK(p.size(0) == side && q.size(0) == side, "[", kHook, "] the warm-start P/Q of "
              "bucket ", b, " do not fit the bucket: the bucket layout changed since they were "
              "made; resume with the same DDP options");
  // PyTorch 2.13 passes these 2-D matrices to its 3-D-only _orthogonalize and fails with an
  // AssertionError; orthogonalized as a batch of one here. The epsilon is the state's (PyTorch's
  // batched hook uses 0 whatever the state says).
  const double eps = o.orthogonalization_epsilon;
  orthogonalize(q.unsqueeze(0), eps);
  at::matmul_out(p, matrix, q);
  WorkPtr p_work = group->all_reduce_async(p, ReduceOp::kSum);

  PowerSGDState* st = &state;
  return CommFuture::of_work(p_work, p)
      .then_future([=](at::Tensor) mutable {
        orthogonalize(p.unsqueeze(0), eps);
        at::matmul_out(q, matrix.t(), p);
        return CommFuture::of_work(group->all_reduce_async(q, ReduceOp::kSum), q);
      })
      .then([=](at::Tensor) mutable {
        q.div_(world);
        at::matmul_out(matrix, p, q.t());
        if (st->options().use_error_feedback) st->error_dict[b] = padded_copy - padded;
        if (!st->options().warm_start) {
          st->p_memory_dict.clear();
          st->q_memory_dict.clear();
        }
        input.copy_(padded.narrow(0, 0, total));
        st->maybe_increase_iter(is_last);
        return input;
      });
}

}  // namespace fsdp
