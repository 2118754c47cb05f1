// The arguments the int4 matmul entry points take (int4_x86.cpp's int4_gemm, int4_gemm_f32 and k-quant
// entry points, int4_prefill_amx.cpp's prefill entry points): x (M, K) bf16 contiguous; qpack (N/16,
// K/8, 64) uint8 in pack_int4_x86's layout; bias (N,) float32 or empty; for int4_gemm, scales (N/16,
// G, 2, 16) bf16; for a GGUF file's blocks, their scales and high bits (BlockScales). Checked once,
// here.
#pragma once

#include <torch/extension.h>

#include <algorithm>

namespace speculant_int4 {

struct Int4Shape {
  int64_t M, K, N, G;
  bool has_bias;
};

// x (M, K) bf16 contiguous, qpack (N/16, K/8, 64) uint8 of the same K inputs, bias (N,) float32 or
// empty: what every int4 matmul entry point checks first, whatever form its scales take.
inline void check_x_qpack_bias(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be (M, K) bf16 contiguous");
  TORCH_CHECK(qpack.dim() == 3 && qpack.scalar_type() == at::kByte && qpack.size(2) == 64 && qpack.is_contiguous(),
              "qpack must be (N/16, K/8, 64) uint8");
  TORCH_CHECK(qpack.size(1) * 8 == x.size(1), "x has ", x.size(1), " columns, the weight ", qpack.size(1) * 8);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == qpack.size(0) * 16 && bias.scalar_type() == at::kFloat &&
              bias.is_contiguous()), "bias must be (N,) float32");
}

inline Int4Shape check_int4_args(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& scales,
                                 const torch::Tensor& bias) {
  check_x_qpack_bias(x, qpack, bias);
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
              scales.size(0) == qpack.size(0) && scales.size(2) == 2 && scales.size(3) == 16,
              "scales must be (N/16, G, 2, 16) bf16");
  const int64_t M = x.size(0), K = x.size(1), N = qpack.size(0) * 16, G = scales.size(1);
  TORCH_CHECK(G > 0 && K % G == 0, "groups of ", K / std::max<int64_t>(G, 1), " inputs do not divide ", K);
  return {M, K, N, G, bias.numel() > 0};
}

// The scales beside qpack, once checked: a GGUF file's block scales and high bits (what Problem
// takes of them: its kd, km, qh, hbits, sf), none of them for int4_gemm's bf16 pairs, and the
// number of groups G either way.
struct BlockScales {
  const float* kd = nullptr;
  const uint8_t* km = nullptr;
  const uint8_t* qh = nullptr;
  int hbits = 0;
  const float* sf = nullptr;
  int64_t G = 0;
};

// x and qpack with K a whole number of 256-input k-quant blocks, bias (N,) float32 or empty.
inline void check_kquant_args(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& bias) {
  check_x_qpack_bias(x, qpack, bias);
  TORCH_CHECK(x.size(1) % 256 == 0, "k-quant blocks are 256 inputs: K = ", x.size(1), " is not a multiple of 256");
}

// Q4_K's scales (and Q5_K's, with qh (N/16, K/32, 64) uint8 their fifth bits when five):
// kd (N/16, K/256, 2, 16) float32, km (N/16, K/32, 2, 16) uint8.
inline BlockScales check_q4k_scales(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& kd,
                                    const torch::Tensor& km, const torch::Tensor& bias, const torch::Tensor* qh) {
  check_kquant_args(x, qpack, bias);
  const int64_t K = x.size(1), NB = qpack.size(0);
  TORCH_CHECK(kd.dim() == 4 && kd.scalar_type() == at::kFloat && kd.is_contiguous() && kd.size(0) == NB &&
              kd.size(1) == K / 256 && kd.size(2) == 2 && kd.size(3) == 16, "kd must be (N/16, K/256, 2, 16) float32");
  TORCH_CHECK(km.dim() == 4 && km.scalar_type() == at::kByte && km.is_contiguous() && km.size(0) == NB &&
              km.size(1) == K / 32 && km.size(2) == 2 && km.size(3) == 16, "km must be (N/16, K/32, 2, 16) uint8");
  BlockScales b{kd.data_ptr<float>(), km.data_ptr<uint8_t>(), nullptr, 0, nullptr, K / 32};
  if (qh) {
    TORCH_CHECK(qh->dim() == 3 && qh->scalar_type() == at::kByte && qh->is_contiguous() && qh->size(0) == NB &&
                qh->size(1) == K / 32 && qh->size(2) == 64, "qh must be (N/16, K/32, 64) uint8");
    b.qh = qh->data_ptr<uint8_t>(), b.hbits = 1;
  }
  return b;
}

// Q6_K's: qh (N/16, K/16, 64) uint8, kd (N/16, K/256, 16) float32, km (N/16, K/16, 16) int8.
inline BlockScales check_q6k_scales(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& qh,
                                    const torch::Tensor& kd, const torch::Tensor& km, const torch::Tensor& bias) {
  check_kquant_args(x, qpack, bias);
  const int64_t K = x.size(1), NB = qpack.size(0);
  TORCH_CHECK(qh.dim() == 3 && qh.scalar_type() == at::kByte && qh.is_contiguous() && qh.size(0) == NB &&
              qh.size(1) == K / 16 && qh.size(2) == 64, "qh must be (N/16, K/16, 64) uint8");
  TORCH_CHECK(kd.dim() == 3 && kd.scalar_type() == at::kFloat && kd.is_contiguous() && kd.size(0) == NB &&
              kd.size(1) == K / 256 && kd.size(2) == 16, "kd must be (N/16, K/256, 16) float32");
  TORCH_CHECK(km.dim() == 3 && km.scalar_type() == at::kChar && km.is_contiguous() && km.size(0) == NB &&
              km.size(1) == K / 16 && km.size(2) == 16, "km must be (N/16, K/16, 16) int8");
  return {kd.data_ptr<float>(), reinterpret_cast<const uint8_t*>(km.data_ptr<int8_t>()), qh.data_ptr<uint8_t>(), 2,
          nullptr, K / 16};
}

// fp32 scales: sf (N/16, G, 2, 16) float32; qh empty, or (N/16, K/32, 64) uint8 the fifth bits of
// 5-bit codes (groups of 32).
inline BlockScales check_f32_scales(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& sf,
                                    const torch::Tensor& qh, const torch::Tensor& bias) {
  check_x_qpack_bias(x, qpack, bias);
  const int64_t K = x.size(1), NB = qpack.size(0);
  TORCH_CHECK(sf.dim() == 4 && sf.scalar_type() == at::kFloat && sf.is_contiguous() && sf.size(0) == NB &&
              sf.size(2) == 2 && sf.size(3) == 16, "sf must be (N/16, G, 2, 16) float32");
  const int64_t G = sf.size(1);
  TORCH_CHECK(G > 0 && K % G == 0, "groups of ", K / std::max<int64_t>(G, 1), " inputs do not divide ", K);
  const bool five = qh.numel() > 0;
  TORCH_CHECK(!five || (qh.dim() == 3 && qh.scalar_type() == at::kByte && qh.is_contiguous() && qh.size(0) == NB &&
              qh.size(1) == K / 32 && qh.size(2) == 64 && G == K / 32), "qh must be empty or (N/16, K/32, 64) uint8 "
              "with groups of 32");
  return {nullptr, nullptr, five ? qh.data_ptr<uint8_t>() : nullptr, five ? 1 : 0, sf.data_ptr<float>(), G};
}

}  // namespace speculant_int4
