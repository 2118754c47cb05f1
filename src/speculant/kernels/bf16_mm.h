// What both bf16 matmul kernels (bf16_amx.cpp, bf16_avx512.cpp) share: the checks of bf16_mm's
// arguments (one interface and one packed layout, pack_bf16 in kernels/__init__.py) and the
// widening of 16 bf16 values to fp32.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

namespace speculant_bf16 {

struct Shape {
  int64_t M, K, N;
  bool has_bias;
};

// x (M, K) bf16 contiguous; wp (N/16, K/32, 16, 16, 2) bf16, N a multiple of 32; bias (N,) bf16 or empty.
inline Shape check_args(const torch::Tensor& x, const torch::Tensor& wp, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be (M, K) bf16 contiguous");
  TORCH_CHECK(wp.dim() == 5 && wp.scalar_type() == at::kBFloat16 && wp.is_contiguous() && wp.size(2) == 16 &&
              wp.size(3) == 16 && wp.size(4) == 2, "wp must be (N/16, K/32, 16, 16, 2) bf16");
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), N = NB * 16;
  TORCH_CHECK(wp.size(1) * 32 == K, "x has ", K, " columns, the weight ", wp.size(1) * 32);
  TORCH_CHECK(NB % 2 == 0, "the weight needs a multiple of 32 output channels, has ", N);
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.numel() == N && bias.scalar_type() == at::kBFloat16 && bias.is_contiguous()),
              "bias must be (N,) bf16");
  return {M, K, N, has_bias};
}

// 16 bf16 values at p, widened to fp32 (exact: bf16 is fp32's upper half).
inline __m512 load_fp32(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

}  // namespace speculant_bf16
