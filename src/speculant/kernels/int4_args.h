// The arguments every int4 matmul entry point takes (int4_x86.cpp's int4_gemm, int4_prefill_amx.cpp's
// int4_prefill_mm): x (M, K) bf16 contiguous; qpack (N/16, K/8, 64) uint8 and scales (N/16, G, 2, 16)
// bf16 in pack_int4_x86's layout; bias (N,) float32 or empty. Checked once, here.
#pragma once

#include <torch/extension.h>

#include <algorithm>

namespace speculant_int4 {

struct Int4Shape {
  int64_t M, K, N, G;
  bool has_bias;
};

inline Int4Shape check_int4_args(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& scales,
                                 const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be (M, K) bf16 contiguous");
  TORCH_CHECK(qpack.dim() == 3 && qpack.scalar_type() == at::kByte && qpack.size(2) == 64 && qpack.is_contiguous(),
              "qpack must be (N/16, K/8, 64) uint8");
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
              scales.size(0) == qpack.size(0) && scales.size(2) == 2 && scales.size(3) == 16,
              "scales must be (N/16, G, 2, 16) bf16");
  const int64_t M = x.size(0), K = x.size(1), N = qpack.size(0) * 16, G = scales.size(1);
  TORCH_CHECK(qpack.size(1) * 8 == K, "x has ", K, " columns, the weight ", qpack.size(1) * 8);
  TORCH_CHECK(G > 0 && K % G == 0, "groups of ", K / std::max<int64_t>(G, 1), " inputs do not divide ", K);
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias must be (N,) float32");
  return {M, K, N, G, has_bias};
}

}  // namespace speculant_int4
