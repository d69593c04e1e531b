// 4-bit NormalFloat (NF4) quantization with double quantization, bitsandbytes-exact, and the
// frozen Linear4bit layer QLoRA trains adapters on:
//
//   fsdp::QuantizationConfig q;                        // BitsAndBytesConfig(load_in_4bit=True,
//   q.double_quant = true;                             //   bnb_4bit_use_double_quant=True,
//   q.compute_dtype = at::kBFloat16;                   //   bnb_4bit_compute_dtype=torch.bfloat16)
//   fsdp::quantize_linears(*model, q);                 // every dense linear -> Linear4bit
//
//   auto nf4 = fsdp::quant::quantize_nf4(w);           // == bnb.functional.quantize_4bit(w,
//   at::Tensor back = fsdp::quant::dequantize_nf4(nf4, at::kFloat);   //  quant_type="nf4",
//                                                                      //  compress_statistics=True)
//
// Note [NF4 and double quantization]
// ----------------------------------
// A weight W of n elements is cut into blocks of 64 consecutive elements (row-major order).
// Each block stores its absmax m = max|w| (fp32) and, per element, the 4-bit index of the code
// nearest to w/m in the 16-value NF4 code book (quantiles of N(0,1) scaled to [-1, 1]; see
// nf4_code()). Two indices share a byte: element 2i in the high nibble, 2i+1 in the low one.
// Double quantization then stores the n/64 absmaxes themselves in 8 bits: offset = mean(m),
// and the m - offset are quantized block-wise (256 per block, each block with its own fp32
// absmax) to the signed 8-bit "dynamic" code book (dynamic_map()). Storage per parameter:
// 4 bits + 8/64 bits + 32/(64*256) bits = 0.5 + 0.0156 + 0.0002 bytes (+4 bytes of offset per
// tensor) instead of 0.5 + 32/64 bits = 0.5625 bytes with fp32 absmaxes.
//
// Exactness: quantize_nf4/dequantize_nf4 reproduce bitsandbytes 0.50.2 on CPU bit for bit --
// packed bytes, absmaxes, nested absmaxes, offset and the dequantized values (tested against
// the library): the 4-bit step as its default backend (x * (1/m) in fp32, clamp to [-1, 1],
// bucketize against the midpoints of adjacent codes, ties to the lower code; the last partial
// block divides by its absmax), the 8-bit step as its native CPU kernel (x / m, the nearest of
// the two codes around a binary search, ties to the lower), dequantization as code * absmax in
// fp32, then rounded to the output dtype.
#pragma once

#include "fsdp/linear.h"

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp {

namespace quant {

// bitsandbytes get_4bit_type("nf4"): 16 fp32 values, ascending, from -1 to 1.
const at::Tensor& nf4_code();
// bitsandbytes create_dynamic_map(signed): 256 fp32 values, ascending (computed with the same
// tensor ops, so bitwise equal).
const at::Tensor& dynamic_map(bool is_signed = true);

// Block-wise 8-bit quantization against a 256-entry code book (bitsandbytes quantize_blockwise
// on CPU): q (uint8, x's shape), absmax (fp32, one per block of `blocksize` flat elements).
struct Blockwise8 {
  at::Tensor q;
  at::Tensor absmax;
};
Blockwise8 quantize_blockwise(const at::Tensor& x, const at::Tensor& code, int64_t blocksize);
// Into existing q (uint8, numel of x) and absmax (fp32, blocks) tensors.
void quantize_blockwise_into(const at::Tensor& x, const at::Tensor& code, int64_t blocksize,
                             at::Tensor& q, at::Tensor& absmax);
// code[q] * absmax[block] in fp32, q's shape.
at::Tensor dequantize_blockwise(const at::Tensor& q, const at::Tensor& absmax,
                                const at::Tensor& code, int64_t blocksize);

// One NF4-quantized tensor.
struct Nf4Tensor {
  at::Tensor packed;         // uint8 ((n + 1) / 2): two 4-bit indices per byte, high nibble first
  at::Tensor absmax;         // fp32 (blocks), or uint8 (blocks) when nested
  at::Tensor nested_absmax;  // fp32 (ceil(blocks / 256)), nested only
  float offset = 0;          // mean of the fp32 absmaxes, nested only
  std::vector<int64_t> shape;
  int64_t blocksize = 64;
  bool nested = false;

  int64_t numel() const;
  int64_t blocks() const { return (numel() + blocksize - 1) / blocksize; }
  // Bytes of the stored representation (packed + absmax + nested absmax + offset).
  int64_t nbytes() const;
};

// bitsandbytes quantize_4bit(w, blocksize, quant_type="nf4", compress_statistics=double_quant).
// w: fp32, bf16 or fp16, any shape. blocksize: 32..4096, a power of two.
Nf4Tensor quantize_nf4(const at::Tensor& w, int64_t blocksize = 64, bool double_quant = true);
// The per-block fp32 absmaxes (dequantized when nested, plus the offset).
at::Tensor nf4_absmax(const Nf4Tensor& t);
// W in `dtype` (computed in fp32, then rounded), shape t.shape. See Note [NF4 dequantization
// kernel] in src/quant/nf4.cpp.
at::Tensor dequantize_nf4(const Nf4Tensor& t, at::ScalarType dtype);
// The same values from the straightforward kernel (one element at a time: a nibble, a code
// book lookup, a multiply): the reference dequantize_nf4 is tested against and the "old"
// column of fsdp-bench nf4.
at::Tensor dequantize_nf4_elementwise(const Nf4Tensor& t, at::ScalarType dtype);

}  // namespace quant

// transformers' BitsAndBytesConfig for 4-bit loading. Only NF4 is implemented (quant_type
// "fp4" is an error naming it).
struct QuantizationConfig {
  std::string quant_type = "nf4";                // bnb_4bit_quant_type
  int64_t blocksize = 64;
  bool double_quant = true;                       // bnb_4bit_use_double_quant
  at::ScalarType compute_dtype = at::kBFloat16;   // bnb_4bit_compute_dtype
  // Linear layers whose name (last FQN component) or FQN is listed stay dense
  // (llm_int8_skip_modules; transformers keeps the output head unquantized).
  std::vector<std::string> skip_modules = {"lm_head"};
  void validate() const;
};

// A frozen linear layer whose weight is stored in NF4. forward(x) dequantizes W block by block
// into compute_dtype, computes x.to(compute_dtype) W^T (+ bias) and returns it in x's dtype
// (bitsandbytes Linear4bit). Backward gives x its gradient (grad_out W, W dequantized again:
// only the 4-bit weight is kept for backward); W gets none.
//
// Parameters (requires_grad false), so FSDP shards them as any other tensor -- both uint8, so
// mixed precision never casts them:
//   weight       uint8 ((n + 1) / 2)  packed indices
//   quant_state  uint8 blob           see Note [Linear4bit quant_state layout] in
//                                     src/quant/linear4bit.cpp
//   bias         (out) in the original dtype, when the layer had one
class Linear4bit : public LinearLayer {
 public:
  // Quantizes `weight` (out, in) now; the dense tensor is not kept.
  Linear4bit(const at::Tensor& weight, const at::Tensor& bias, const QuantizationConfig& config);
  // Shape-only construction (meta planning): parameters of the right sizes, values unset.
  Linear4bit(int64_t in_features, int64_t out_features, bool bias, const QuantizationConfig& config);
  at::Tensor forward(const fsdp::nn::Inputs& inputs) override;

  int64_t in_features() const override { return in_; }
  int64_t out_features() const override { return out_; }
  at::Tensor dense_weight(at::ScalarType dtype) const override;
  at::Tensor dense_bias() const override { return bias; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // The stored tensor as a quant::Nf4Tensor (views of the parameters).
  quant::Nf4Tensor nf4() const;
  int64_t blocksize() const { return blocksize_; }
  bool double_quant() const { return nested_; }
  // The same from full packed / quant_state tensors held elsewhere (e.g. gathered from FSDP
  // shards): views of them, this layer's shape and settings.
  quant::Nf4Tensor nf4_of(const at::Tensor& packed, const at::Tensor& quant_state) const;
  // `w` (out, in) quantized into this layer's format: {packed weight, quant_state} tensors of
  // the parameters' sizes (what Linear4bit(w, ...) would store). See Note [Linear4bit
  // quant_state layout] in src/quant/linear4bit.cpp.
  std::pair<at::Tensor, at::Tensor> quantize_like(const at::Tensor& w) const;

  at::Tensor weight;       // uint8 packed
  at::Tensor quant_state;  // uint8
  at::Tensor bias;         // or undefined

 private:
  void register_storage(int64_t n, bool with_bias, at::ScalarType bias_dtype);
  int64_t in_, out_, blocksize_;
  bool nested_;
  at::ScalarType compute_dtype_;
};

// Replaces every dense linear layer (fsdp::Linear) under `root` whose name is not in
// config.skip_modules by a Linear4bit, one layer at a time (the dense weight is freed before
// the next is quantized). `prefix` is root's FQN for matching skip_modules. Returns the count.
int quantize_linears(torch::nn::Module& root, const QuantizationConfig& config,
                     const std::string& prefix = "");

// Bytes of a Linear4bit's stored state for an (out, in) weight (weight + quant_state, no bias).
int64_t linear4bit_nbytes(int64_t out_features, int64_t in_features, const QuantizationConfig& config);

}  // namespace fsdp
