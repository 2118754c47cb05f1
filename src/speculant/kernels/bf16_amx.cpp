// bf16 matmul for decoding and tree verification on AMX-BF16: y (M, N) = x (M, K) @ W.T (+ b).
//
// Why: oneDNN's bf16 matmul takes its rows 16 at a time, one pass over the weights per 16 rows,
// so on a CPU that streams the weights from DRAM a 17- to 32-row tree pass costs a second pass
// (docs/design-notes.md#bf16-kernel-with-amx). Here every weight tile, once loaded, multiplies
// both 16-row halves of up to 32 rows (two A tiles, two B tiles, four C accumulators: the eight
// AMX tiles), so up to 32 rows cost one pass over the weights. Larger inputs (prefill) go in slabs
// of 256 rows, each slab 32 rows at a time inside each pair of channel blocks, whose weights
// (2 x 16 channels x K) stay in L2 meanwhile (oneDNN's GEMM blocking is better there; the kernel
// is for decoding).
//
// Packed layout (pack_bf16 in kernels/__init__.py): wp (N/16, K/32, 16, 16, 2) bf16, the B tile of
// channel block nb and inputs 32 ks .. 32 ks + 31 in VNNI order: wp[nb, ks, p, c, i] =
// W[16 nb + c, 32 ks + 2 p + i]. Products accumulate in fp32 in the tiles over all of K.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_bf16_pair.h"
#include "bf16_mm.h"

// x (M, K) bf16 contiguous; wp (N/16, K/32, 16, 16, 2) bf16; bias (N,) bf16 or empty -> (M, N) bf16.
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor wp, torch::Tensor bias) {
  TORCH_CHECK(speculant_amx::permitted(), "bf16_mm needs AMX (the kernel refused the tile-data permission)");
  const speculant_bf16::Shape shape = speculant_bf16::check_args(x, wp, bias);
  const int64_t M = shape.M, K = shape.K, N = shape.N, NB = N / 16;
  const bool has_bias = shape.has_bias;
  auto y = torch::empty({M, N}, x.options());
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* w = wp.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = has_bias ? bias.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t block = K * 16;  // elements per channel block
  // rows in slabs of kSlab: a slab's activations and a pair's weights stay in L2 while the slab's
  // 32-row chunks go over them (one pass over the weights per slab)
  constexpr int64_t kSlab = 256;
  for (int64_t s0 = 0; s0 < M; s0 += kSlab) {
    const int64_t S = std::min(kSlab, M - s0);
    at::parallel_for(0, NB / 2, 4, [&](int64_t p0, int64_t p1) {
      alignas(64) float c[32 * 32];
      int conf_r0 = -1, conf_r1 = -1;
      for (int64_t p = p0; p < p1; ++p) {
        const at::BFloat16* w0 = w + 2 * p * block;
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        if (has_bias) {
          b0 = speculant_bf16::load_fp32(bp + 32 * p);
          b1 = speculant_bf16::load_fp32(bp + 32 * p + 16);
        }
        for (int64_t m0 = s0; m0 < s0 + S; m0 += 32) {
          const int rows = (int)std::min<int64_t>(32, s0 + S - m0), r0 = std::min(rows, 16), r1 = rows - r0;
          if (r0 != conf_r0 || r1 != conf_r1) {  // tile state is per thread
            speculant_amx::configure_bf16_pair(r0, r1);
            conf_r0 = r0, conf_r1 = r1;
          }
          speculant_amx::bf16_pair(xp + m0 * K, K, r0, r1, w0, w0 + block, c);
          for (int m = 0; m < rows; ++m) {
            const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c + m * 32), b0);
            const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + m * 32 + 16), b1);
            at::BFloat16* out = yp + (m0 + m) * N + 32 * p;
            _mm256_storeu_si256((__m256i*)out, (__m256i)_mm512_cvtneps_pbh(v0));
            _mm256_storeu_si256((__m256i*)(out + 16), (__m256i)_mm512_cvtneps_pbh(v1));
          }
        }
      }
      if (conf_r0 >= 0) _tile_release();
    });
  }
  return y;
}
