// The arguments the int4 matmul entry points take (int4_x86.cpp's int4_gemm, int4_gemm_f32 and k-quant
// entry points, int4_prefill_amx.cpp's int4_prefill_mm): x (M, K) bf16 contiguous; qpack (N/16, K/8,
// 64) uint8 in pack_int4_x86's layout; bias (N,) float32 or empty; for int4_gemm, scales (N/16, G, 2,
// 16) bf16. Checked once, here.
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

}  // namespace speculant_int4
