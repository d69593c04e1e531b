// Misuses that must be compile-time errors with a sentence that says what to do (built by
// tests/cmake/compile_errors.cmake, one FSDP_MISUSE case per target; none is part of `all`).
#include <fsdp/fsdp.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>

void misuse() {
#if FSDP_MISUSE == 1
  fsdp::wrap(torch::nn::Linear(2, 2));  // a plain module handle
#elif FSDP_MISUSE == 2
  torch::nn::Sequential seq(torch::nn::Linear(2, 2));
  fsdp::wrap(seq->ptr(0));  // a Sequential's child, as torch::nn::Module
#elif FSDP_MISUSE == 3
  fsdp::nn::unit(torch::nn::LSTM(2, 2));  // forward returns a tuple
#endif
}
