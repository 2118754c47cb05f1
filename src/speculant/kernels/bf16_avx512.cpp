// bf16 matmul for decoding and tree verification on AVX-512 BF16 without AMX (e.g. AMD Zen 4):
// y (M, N) = x (M, K) @ W.T (+ b), the same interface and packed layout as bf16_amx.cpp.
//
// Why: on such a CPU oneDNN's bf16 matmul costs a 16-row tree pass far more than reading the
// weights once and doing the arithmetic needs (docs/design-notes.md#bf16-kernel-without-amx). Here each 64-byte weight vector (16 channels x one
// input pair), once in a register, is multiplied by up to kRows rows with VDPBF16PS; a group of
// kBlocks channel blocks is read from DRAM once per call and, for more than kRows rows, again from
// L2 for each further kRows rows (inputs in chunks of kChunk so the group's slice stays in L2).
//
// Every row is computed on its own, in the same order for any M: fp32 partial sums over the
// inputs, pair by pair, chunk by chunk. A row's result never depends on the other rows of the
// call, so a tree verification pass gives each node exactly what a one-row pass gives.
//
// Packed layout (pack_bf16): wp (N/16, K/32, 16, 16, 2) bf16; within channel block nb the input
// pairs are contiguous: pair q (inputs 2q, 2q + 1) of the block's 16 channels is the 64 bytes at
// wp[nb] + 32 q, element [c, i] = W[16 nb + c, 2 q + i], which is VDPBF16PS's operand order.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "bf16_mm.h"

#include <array>
#include <utility>
#include <vector>

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed);  // attention.cpp

namespace {

constexpr int kRows = 6;         // rows per register tile (kRows x kBlocks fp32 accumulators)
constexpr int kBlocks = 4;       // channel blocks of 16 per group
constexpr int64_t kChunk = 256;  // input pairs per chunk (512 inputs: 4 blocks x 32 KB)

// rows R x blocks B over input pairs [q0, q1): c (R, ldc) fp32 partial sums, in and out.
template <int R, int B>
void tile(const int32_t* x, int64_t ldx, const at::BFloat16* w, int64_t block, int64_t q0, int64_t q1,
          float* c, int64_t ldc, bool first) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) acc[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16 * j);
  for (int64_t q = q0; q < q1; ++q) {
    __m512bh wv[B];
    for (int j = 0; j < B; ++j) wv[j] = (__m512bh)_mm512_loadu_si512((const void*)(w + j * block + 32 * q));
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * ldx + q]);
      for (int j = 0; j < B; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) _mm512_storeu_ps(c + r * ldc + 16 * j, acc[r][j]);
}

using TileFn = void (*)(const int32_t*, int64_t, const at::BFloat16*, int64_t, int64_t, int64_t, float*, int64_t, bool);

template <int B, int... R>
constexpr std::array<TileFn, sizeof...(R)> table(std::integer_sequence<int, R...>) {
  return {&tile<R + 1, B>...};
}

const auto kTiles4 = table<4>(std::make_integer_sequence<int, kRows>{});
const auto kTiles2 = table<2>(std::make_integer_sequence<int, kRows>{});

}  // namespace

// x (M, K) bf16 contiguous; wp (N/16, K/32, 16, 16, 2) bf16; bias (N,) bf16 or empty -> (M, N) bf16.
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor wp, torch::Tensor bias) {
  const speculant_bf16::Shape shape = speculant_bf16::check_args(x, wp, bias);
  const int64_t M = shape.M, K = shape.K, N = shape.N, NB = N / 16;
  const bool has_bias = shape.has_bias;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int32_t* xp = (const int32_t*)x.data_ptr<at::BFloat16>();  // rows as K/2 input pairs
  const at::BFloat16* w = wp.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = has_bias ? bias.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t block = K * 16, pairs = K / 2, groups = (NB + kBlocks - 1) / kBlocks;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(M * 16 * kBlocks);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t nb0 = g * kBlocks, B = std::min<int64_t>(kBlocks, NB - nb0), ldc = 16 * kBlocks;
      const auto& tiles = B == 4 ? kTiles4 : kTiles2;
      const at::BFloat16* wg = w + nb0 * block;
      for (int64_t q0 = 0; q0 < pairs; q0 += kChunk) {
        const int64_t q1 = std::min(pairs, q0 + kChunk);
        for (int64_t m0 = 0; m0 < M; m0 += kRows) {
          const int rows = (int)std::min<int64_t>(kRows, M - m0);
          tiles[rows - 1](xp + m0 * pairs, pairs, wg, block, q0, q1, buf.data() + m0 * ldc, ldc, q0 == 0);
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < B; ++j) {
          __m512 v = _mm512_loadu_ps(buf.data() + m * ldc + 16 * j);
          if (has_bias) v = _mm512_add_ps(v, speculant_bf16::load_fp32(bp + 16 * (nb0 + j)));
          _mm256_storeu_si256((__m256i*)(yp + m * N + 16 * (nb0 + j)), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bf16_mm", &bf16_mm, "bf16 matmul on AVX-512 BF16, each weight vector used by up to 6 rows at once");
  m.def("attend", &attend, "row-invariant attention of a few tokens over a bf16 KV cache (AVX-512)");
}
