// Prompt prefill through int4 weights on AMX-BF16: y (M, N) = x (M, K) @ W.T (+ bias), W the int4
// weights of int4_x86.cpp's packed layout (w = q * scale + offset per group of inputs; the scales
// as bf16 pairs, or a GGUF file's blocks as int4_gemm_kquant, _q5k, _q6k and _f32 take them: codes
// of 5 or 6 bits, k-quant or fp32 scales), widened to bf16 two channel blocks at a time in a
// per-thread buffer (in L2), then multiplied with every row of x by bf16_amx.cpp's tile loop (bf16
// products, fp32 sums over all of K in the tiles).
//
// Why: a prompt of hundreds of tokens is bound by arithmetic, not by reading the weights, and
// there int4_gemm's exact path pays for its per-group fold (int32 tile -> fp32, two multiply-adds
// per group of 64 inputs, ~3.5x the tile multiplies' own time; docs/design-notes.md#int4-on-amx).
// Widening the weights once per call costs less than a row of 16 tiles' folds, and then the
// tiles accumulate over all of K with nothing in between (measurements:
// docs/design-notes.md#prompt-prefill-on-amx).
//
// The result is not int4_gemm's bits (bf16 activations, not int8; the tiles' own summation order),
// which is why only prompt tokens come here (every method prefills a prompt the same way, so
// speculative output still equals plain decoding's); generated and verified tokens always take
// int4_gemm. Each row is still computed on its own: a row's result does not depend on M or on
// the other rows.
//
// Widening: w = fma(q, scale, offset) in fp32 (the group's scale and offset as int4_gemm's fold
// takes them: scales16), rounded to bf16 to nearest even, into the B tiles of pack_bf16's layout
// (channel block, 32 inputs: 16 input pairs x 16 channels x 2). For a GGUF file's blocks that is
// its own weight (exact in fp32) rounded once to bf16.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "amx_bf16_pair.h"
#include "int4_args.h"
#include "int4_problem.h"

namespace {

using speculant_int4::BlockScales;
using speculant_int4::Problem;

// The 16 channels of block nb of P's weights (codes, high bits HB per code, scales) widened to bf16
// B tiles: out (K/32, 16, 16, 2), element [ks, p, c, i] = w[c, 32 ks + 2 p + i].
template <int HB>
void widen_block(const Problem& P, int64_t nb, at::BFloat16* out) {
  const uint8_t* qb = P.q + nb * (P.K / 8) * 64;
  const uint8_t* hb = HB ? P.qh + nb * (P.K / (HB == 2 ? 16 : 32)) * 64 : nullptr;
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // VPERMT2W indices: lane 2c takes channel c of the even input, lane 2c + 1 of the odd one
  alignas(64) uint16_t order[32];
  for (int c = 0; c < 16; ++c) order[2 * c] = c, order[2 * c + 1] = 32 + c;
  const __m512i interleave = _mm512_load_si512((const void*)order);
  __m512 s = _mm512_setzero_ps(), off = _mm512_setzero_ps();
  for (int64_t o = 0, g = -1; o < P.K / 8; ++o) {  // octet o: inputs 8 o .. 8 o + 7, 4 bytes per channel
    if (8 * o / P.gsize != g) {
      g = 8 * o / P.gsize;
      speculant_int4::scales16(P, nb, g, s, off);
    }
    __m512i half[2];
    speculant_int4::octet_codes512<HB>(qb, hb, o, half[0], half[1]);
    __m256bh v[8];  // input 8 o + j for the 16 channels
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) {
        const __m512i q = _mm512_and_si512(_mm512_srli_epi32(half[h], 8 * i), byte);
        v[4 * h + i] = _mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, off));
      }
    // tile row p = 4 (o % 4) + t of tile o / 4 holds inputs 8 o + 2 t and 8 o + 2 t + 1
    at::BFloat16* dst = out + (o / 4) * 512 + (o % 4) * 4 * 32;
    for (int t = 0; t < 4; ++t) {
      const __m512i even = _mm512_castsi256_si512((__m256i)v[2 * t]), odd = _mm512_castsi256_si512((__m256i)v[2 * t + 1]);
      _mm512_store_si512((void*)(dst + 32 * t), _mm512_permutex2var_epi16(even, interleave, odd));
    }
  }
}

// y = x @ W.T (+ bias) for P's weights (P.q and its scales; P's activation fields unused).
template <int HB>
void prefill(const Problem& P, const at::BFloat16* xp, float* y32, at::BFloat16* y16) {
  const int64_t M = P.M, K = P.K, N = P.N, NB = N / 16;
  const int64_t block = K * 16;  // bf16 elements of one widened channel block
  at::parallel_for(0, M > 0 ? (NB + 1) / 2 : 0, 1, [&](int64_t p0, int64_t p1) {
    std::unique_ptr<at::BFloat16, decltype(&std::free)> buf(
        static_cast<at::BFloat16*>(std::aligned_alloc(64, 2 * block * sizeof(at::BFloat16))), &std::free);
    alignas(64) float c[32 * 32];
    int conf_r0 = -1, conf_r1 = -1;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb0 = 2 * p, nbs = std::min<int64_t>(2, NB - nb0);  // an odd last block goes alone
      for (int64_t j = 0; j < nbs; ++j) widen_block<HB>(P, nb0 + j, buf.get() + j * block);
      const at::BFloat16* w1 = buf.get() + (nbs == 2 ? block : 0);
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int rows = (int)std::min<int64_t>(32, M - m0), r0 = std::min(rows, 16), r1 = rows - r0;
        if (r0 != conf_r0 || r1 != conf_r1) {
          speculant_amx::configure_bf16_pair(r0, r1);
          conf_r0 = r0, conf_r1 = r1;
        }
        speculant_amx::bf16_pair(xp + m0 * K, K, r0, r1, buf.get(), w1, c);
        for (int m = 0; m < rows; ++m)
          for (int64_t j = 0; j < nbs; ++j) {
            const int64_t n0 = 16 * (nb0 + j);
            __m512 v = _mm512_load_ps(c + m * 32 + 16 * j);
            if (P.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(P.bias + n0));
            if (y32) _mm512_storeu_ps(y32 + (m0 + m) * N + n0, v);
            else _mm256_storeu_si256((__m256i*)(y16 + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
    if (conf_r0 >= 0) _tile_release();
  });
}

// The prefill of x (checked) through qpack with bf16 scale pairs sz or a GGUF file's block scales b
// (b.G: the number of groups either way).
torch::Tensor run_prefill(const torch::Tensor& x, const torch::Tensor& qpack, const uint16_t* sz, const BlockScales& b,
                          const torch::Tensor& bias, bool out_fp32) {
  const int64_t G = b.G;
  TORCH_CHECK(speculant_amx::permitted(), "the prefill kernels need AMX (the kernel refused the tile-data permission)");
  const int64_t M = x.size(0), K = x.size(1), N = qpack.size(0) * 16;
  TORCH_CHECK(K % 32 == 0, "the prefill kernels need a multiple of 32 inputs, got ", K);
  TORCH_CHECK((K / G) % 8 == 0, "groups of ", K / G, " inputs: need a multiple of 8");
  auto y = torch::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  Problem P{nullptr, nullptr, nullptr, qpack.data_ptr<uint8_t>(), sz, bias.numel() ? bias.data_ptr<float>() : nullptr,
            M, K, N, G, K / G, nullptr, nullptr, b.kd, b.km, b.qh, b.hbits, b.sf};
  float* y32 = out_fp32 ? y.data_ptr<float>() : nullptr;
  at::BFloat16* y16 = out_fp32 ? nullptr : y.data_ptr<at::BFloat16>();
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  if (b.hbits == 2) prefill<2>(P, xp, y32, y16);
  else if (b.hbits == 1) prefill<1>(P, xp, y32, y16);
  else prefill<0>(P, xp, y32, y16);
  return y;
}

}  // namespace

// x (M, K) bf16 contiguous; qpack (N/16, K/8, 64) uint8 and scales (N/16, G, 2, 16) bf16 as
// int4_gemm takes them; bias (N,) fp32 or empty (added in fp32); out_fp32: fp32 output, else bf16.
torch::Tensor int4_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor scales, torch::Tensor bias,
                              bool out_fp32) {
  const speculant_int4::Int4Shape shape = speculant_int4::check_int4_args(x, qpack, scales, bias);
  BlockScales b;
  b.G = shape.G;
  return run_prefill(x, qpack, reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), b, bias, out_fp32);
}

// The same for a GGUF file's blocks, their arguments as int4_gemm_kquant, _q5k, _q6k and _f32 take them.
torch::Tensor kquant_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor kd, torch::Tensor km,
                                torch::Tensor bias, bool out_fp32) {
  const BlockScales b = speculant_int4::check_q4k_scales(x, qpack, kd, km, bias, nullptr);
  return run_prefill(x, qpack, nullptr, b, bias, out_fp32);
}

torch::Tensor q5k_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                             torch::Tensor bias, bool out_fp32) {
  const BlockScales b = speculant_int4::check_q4k_scales(x, qpack, kd, km, bias, &qh);
  return run_prefill(x, qpack, nullptr, b, bias, out_fp32);
}

torch::Tensor q6k_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                             torch::Tensor bias, bool out_fp32) {
  const BlockScales b = speculant_int4::check_q6k_scales(x, qpack, qh, kd, km, bias);
  return run_prefill(x, qpack, nullptr, b, bias, out_fp32);
}

torch::Tensor f32_prefill_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor sf, torch::Tensor qh,
                             torch::Tensor bias, bool out_fp32) {
  const BlockScales b = speculant_int4::check_f32_scales(x, qpack, sf, qh, bias);
  return run_prefill(x, qpack, nullptr, b, bias, out_fp32);
}
