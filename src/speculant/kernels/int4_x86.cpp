// Weight-only int4 matmul for every x86-64 CPU: AVX-512 VNNI (Intel Ice Lake and later, AMD Zen 4
// and later), AVX2 with or without AVX-VNNI, a portable C++ path, and on AMX CPUs (Intel Sapphire
// Rapids and later) AMX for passes of kAmxMinRows rows or more (int4_amx_x86.cpp).
//
// y (M, N) = x (M, K) @ W.T (+ bias), W stored as 4-bit codes q in [0, 15] with one (scale, offset)
// per group of G inputs: w = q * scale + offset. x is bf16; y is bf16 or fp32.
//
// Why: decoding is bound by reading the weights, so a tree verification pass of a few rows should
// cost about what one row costs. Here every 64-byte vector of codes (16 channels x 8 inputs) is
// loaded and unpacked once per pass and multiplied with up to kRows rows of activations before the
// next is read; rows past kRows re-read the codes from cache, not from memory.
//
// Arithmetic (what llama.cpp does for its Q4 x Q8 dot products): activations are quantized per row
// and per group to int8 (absmax): x[m, k] ~ a[m, g] * xq[m, k]. Per group the integer dot product
// d = sum_k q xq is exact (VPDPBUSD, or VPMADDUBSW + VPMADDWD, or plain C++), and
//     acc[m, n] += a[m, g] * (scale[n, g] * d + offset[n, g] * sum_k xq)
// is folded in fp32 with separate multiplies and adds (no FMA), in group order. So every row is
// computed on its own, in the same order whatever M is (a tree verification pass gives each row
// bit for bit what a one-row pass gives), and every code path (AVX-512, AVX2, portable) gives the
// same bits: the output does not depend on which of these CPUs runs it. The file is compiled with
// -ffp-contract=off so that the compiler does not fuse the fold's multiplies and adds.
//
// Packed layout (pack_int4_x86 in kernels/__init__.py):
//   qpack  (N/16, K/8, 64) uint8: block nb (channels 16 nb .. 16 nb + 15), input octet p (inputs
//          8 p .. 8 p + 7): byte 4 c + i holds q[16 nb + c, 8 p + i] in its low nibble and
//          q[16 nb + c, 8 p + 4 + i] in its high nibble. Unpacked, the low nibbles are VPDPBUSD's
//          16 lanes x 4 bytes for inputs 8p..8p+3, the high nibbles for 8p+4..8p+7.
//   scales (N/16, K/G, 2, 16) bf16: (scale, offset) of group g for the block's 16 channels.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "int4_args.h"
#include "int4_problem.h"

namespace speculant_int4 {
bool amx_int8_ready();         // int4_amx_x86.cpp
bool gemm_amx_takes(int64_t gsize, int hbits);  // the group sizes and high bits gemm_amx runs
void gemm_amx(const Problem&);  // needs gemm_amx_takes and xq, a, ax padded to a multiple of 16 rows
}  // namespace speculant_int4

namespace {

using namespace speculant_int4;

enum Isa : int64_t { kAuto = 0, kAvx512Vnni = 1, kAvx2Vnni = 2, kAvx2 = 3, kPortable = 4, kAmx = 5 };

// kAmx: passes of fewer rows take the AVX-512 VNNI code (faster while the weights' reading
// dominates; the same bits). Measured: docs/design-notes.md#int4-on-amx. Groups of 16 or 32 inputs
// (a GGUF file's blocks) fold twice or four times as often per input, which the tiles do not speed
// up: there AMX pays from more rows (docs/design-notes.md#a-gguf-files-blocks-on-amx).
constexpr int64_t kAmxMinRows = 10, kAmxMinRowsSmallGroups = 32;

constexpr int64_t kRowTile = 64;  // rows per pass over the weights (their int8 activations stay in L2)
// Codes are prefetched this many bytes ahead: docs/design-notes.md#int4-prefetch-distance
constexpr int64_t kPrefetch = 4096;

// ------------------------------------------------------------------ portable C++ (any CPU)

// One row's activations -> int8 codes, per-group scale and code sum. The vector versions below
// reproduce these operations exactly: amax, scale = amax / 127, xq = round-to-even(x * (127 / amax)).
void quantize_row_portable(const uint16_t* x, int64_t K, int64_t gsize, int8_t* xq, float* a, float* ax) {
  for (int64_t g = 0; g * gsize < K; ++g) {
    const uint16_t* p = x + g * gsize;
    float mx = 0.f;
    for (int64_t k = 0; k < gsize; ++k) mx = std::fmax(mx, std::fabs(bf16_to_float(p[k])));
    const float inv = mx > 0 ? 127.f / mx : 0.f;
    int32_t sum = 0;
    for (int64_t k = 0; k < gsize; ++k) {
      const int32_t v = (int32_t)std::nearbyint(bf16_to_float(p[k]) * inv);
      xq[g * gsize + k] = (int8_t)v;
      sum += v;
    }
    a[g] = mx > 0 ? mx / 127.f : 1.f;
    ax[g] = a[g] * (float)sum;
  }
}

// acc += a * (s * d) + o * ax, the fold every path performs, operation by operation (two fused
// multiply-adds: std::fma rounds exactly as the vector FMA instructions do).
inline float fold(float acc, int32_t d, float s, float o, float ax, float a) {
  const float t = (float)d * s;
  return std::fma(o, ax, std::fma(t, a, acc));
}

void chunk_portable(const Problem& P, int64_t nb, int64_t m0, int rows) {
  const uint8_t* qb = P.q + nb * (P.K / 8) * 64;
  for (int r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    const int8_t* x = P.xq + m * P.K;
    float acc[16] = {0.f};
    for (int64_t g = 0; g < P.G; ++g) {
      for (int c = 0; c < 16; ++c) {
        int32_t d = 0;
        for (int64_t k = g * P.gsize; k < (g + 1) * P.gsize; ++k) {
          const uint8_t byte = qb[(k / 8) * 64 + 4 * c + (k % 4)];
          int32_t code = (k % 8) < 4 ? (byte & 15) : (byte >> 4);
          if (P.hbits == 2) code |= ((P.qh[(nb * (P.K / 16) + k / 16) * 64 + 4 * c + (k % 4)] >> (2 * ((k % 16) / 4))) & 3) << 4;
          if (P.hbits == 1) code |= ((P.qh[(nb * (P.K / 32) + k / 32) * 64 + 4 * c + (k % 4)] >> ((k % 32) / 4)) & 1) << 4;
          d += code * (int32_t)x[k];
        }
        float sc, off;
        scale_pair(P, nb, g, c, sc, off);
        acc[c] = fold(acc[c], d, sc, off, P.ax[m * P.G + g], P.a[m * P.G + g]);
      }
    }
    store_row(P, m, nb * 16, acc, 16);
  }
}

// ------------------------------------------------------------------ AVX2 (+ AVX-VNNI)

#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline __m256 load8_bf16_avx2(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

void quantize_row_avx2(const uint16_t* x, int64_t K, int64_t gsize, int8_t* xq, float* a, float* ax) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g * gsize < K; ++g) {
    const uint16_t* p = x + g * gsize;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t k = 0; k < gsize; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8_bf16_avx2(p + k)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax);
    float mx = 0.f;
    for (float v : lanes) mx = std::fmax(mx, v);
    const __m256 inv = _mm256_set1_ps(mx > 0 ? 127.f / mx : 0.f);
    __m256i sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < gsize; k += 8) {
      const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(load8_bf16_avx2(p + k), inv));  // round to even
      sum = _mm256_add_epi32(sum, qi);
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      _mm_storel_epi64((__m128i*)(xq + g * gsize + k), _mm_packs_epi16(w16, w16));
    }
    alignas(32) int32_t s[8];
    _mm256_store_si256((__m256i*)s, sum);
    int32_t total = 0;
    for (int32_t v : s) total += v;
    a[g] = mx > 0 ? mx / 127.f : 1.f;
    ax[g] = a[g] * (float)total;
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Group g's (scale, offset) of channels 8 half .. 8 half + 7 of block nb (scale_pair, 8 lanes).
inline void scales8(const Problem& P, int64_t nb, int64_t g, int64_t half, __m256& s, __m256& o) {
  if (P.hbits == 2) {
    const float* d = P.kd + (nb * (P.G / 16) + g / 16) * 16 + 8 * half;
    const int8_t* m = (const int8_t*)P.km + (nb * P.G + g) * 16 + 8 * half;
    s = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)m))));
    o = _mm256_mul_ps(_mm256_set1_ps(-32.f), s);
  } else if (P.kd) {
    const float* d = P.kd + (nb * (P.G / 8) + g / 8) * 32 + 8 * half;
    const uint8_t* m = P.km + (nb * P.G + g) * 32 + 8 * half;
    s = _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)m))));
    o = _mm256_mul_ps(_mm256_loadu_ps(d + 16),
                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(m + 16)))));
  } else if (P.sf) {
    const float* sg = P.sf + (nb * P.G + g) * 32 + 8 * half;
    s = _mm256_loadu_ps(sg);
    o = _mm256_loadu_ps(sg + 16);
  } else {
    const uint16_t* sg = P.sz + (nb * P.G + g) * 32 + 8 * half;
    s = load8_bf16_avx2(sg);
    o = load8_bf16_avx2(sg + 16);
  }
}

// acc[r] += a (scale * dot[r]) + offset * ax for rows m0 .. m0+R-1, group g, the 8 channels of
// half ``half`` of block nb (the fold of every path, in 8 lanes).
template <int R>
inline void fold8(const Problem& P, int64_t nb, int64_t m0, int64_t g, int64_t half, const __m256i* dot, __m256* acc) {
  __m256 s, o;
  scales8(P, nb, g, half, s, o);
  for (int r = 0; r < R; ++r) {
    const int64_t mg = (m0 + r) * P.G + g;
    const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), s);
    acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(P.a[mg]), acc[r]);
    acc[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(P.ax[mg]), acc[r]);
  }
}

template <int R>
inline void store8(const Problem& P, int64_t m0, int64_t n0, const __m256* acc) {
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[r]);
    store_row(P, m0 + r, n0, out, 8);
  }
}

// h's bits at ``from`` (HB of them per byte) moved to bit 4, the rest cleared.
template <int HB>
inline __m256i high_bits256(__m256i h, int from) {
  const __m256i t = from < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - from)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(from - 4));
  return _mm256_and_si256(t, _mm256_set1_epi8(HB == 2 ? 0x30 : 0x10));
}

#define INT4_AVX2_CHUNK chunk_avx2
#define INT4_AVX2_VNNI 0
#include "int4_avx2_chunk.h"

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")

#define INT4_AVX2_CHUNK chunk_avx2_vnni
#define INT4_AVX2_VNNI 1
#include "int4_avx2_chunk.h"

#pragma GCC pop_options

// ------------------------------------------------------------------ AVX-512 VNNI

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,fma")

void quantize_row_avx512(const uint16_t* x, int64_t K, int64_t gsize, int8_t* xq, float* a, float* ax) {
  for (int64_t g = 0; g * gsize < K; ++g) {
    const uint16_t* p = x + g * gsize;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < gsize; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16_bf16_avx512(p + k)));
    const float mx = _mm512_reduce_max_ps(amax);  // max is exact in any order
    const __m512 inv = _mm512_set1_ps(mx > 0 ? 127.f / mx : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < gsize; k += 16) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(load16_bf16_avx512(p + k), inv));  // round to even
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128((__m128i*)(xq + g * gsize + k), _mm512_cvtsepi32_epi8(qi));
    }
    a[g] = mx > 0 ? mx / 127.f : 1.f;
    ax[g] = a[g] * (float)_mm512_reduce_add_epi32(sum);  // integer sum: exact in any order
  }
}

// Rows m0 .. m0+R-1 of channel block nb; O octets (8 inputs) per group, known at compile time so
// that the accumulators stay in registers. One integer chain per row (two for R <= 2, where a
// single chain would wait on VPDPBUSD's latency): integer sums, exact in any order.
// HB: high bits per code above the low nibble (0; 1 for Q5_K, O = 4; 2 for Q6_K, O = 2), OR-ed in
// from qh as bit 4 (bits 4-5).
template <int R, int O, int HB>
void chunk_avx512(const Problem& P, int64_t nb, int64_t m0) {
  constexpr int C = R <= 2 ? 2 : 1;
  const uint8_t* qb = P.q + nb * (P.K / 8) * 64;
  const uint8_t* hb = HB ? P.qh + nb * (P.K / (HB == 2 ? 16 : 32)) * 64 : nullptr;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* x0 = P.xq + m0 * P.K;
  for (int64_t g = 0; g < P.G; ++g) {
    const uint8_t* qg = qb + g * O * 64;
    const int8_t* xg = x0 + g * (8 * O);
    __m512i d[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) d[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int p = 0; p < O; ++p) {
      _mm_prefetch((const char*)(qg + 64 * p + kPrefetch), _MM_HINT_T0);
      __m512i lo, hi;
      octet_codes512<HB>(qb, hb, g * O + p, lo, hi);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xg + r * P.K + 8 * p;
        d[r][0] = _mm512_dpbusd_epi32(d[r][0], lo, _mm512_set1_epi32(load4(x)));
        d[r][C - 1] = _mm512_dpbusd_epi32(d[r][C - 1], hi, _mm512_set1_epi32(load4(x + 4)));
      }
    }
    __m512 s, o;
    scales16(P, nb, g, s, o);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int64_t mg = (m0 + r) * P.G + g;
      const __m512i dot = C == 2 ? _mm512_add_epi32(d[r][0], d[r][C - 1]) : d[r][0];
      acc[r] = fold16(acc[r], dot, s, o, P.a[mg], P.ax[mg]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[16];
    _mm512_store_ps(out, acc[r]);
    store_row(P, m0 + r, nb * 16, out, 16);
  }
}

#pragma GCC pop_options

// ------------------------------------------------------------------ dispatch

using ChunkFn = void (*)(const Problem&, int64_t, int64_t);

// Chunk functions by octets per group (O) and rows (1 .. most): fns[r - 1] handles r rows.
template <int O, int HB, int... Rs>
constexpr std::array<ChunkFn, sizeof...(Rs)> avx512_table(std::integer_sequence<int, Rs...>) {
  return {&chunk_avx512<Rs + 1, O, HB>...};
}
template <int O, int HB, int... Rs>
constexpr std::array<ChunkFn, sizeof...(Rs)> avx2_table(std::integer_sequence<int, Rs...>) {
  return {&chunk_avx2<Rs + 1, O, HB>...};
}
template <int O, int HB, int... Rs>
constexpr std::array<ChunkFn, sizeof...(Rs)> avx2_vnni_table(std::integer_sequence<int, Rs...>) {
  return {&chunk_avx2_vnni<Rs + 1, O, HB>...};
}

constexpr int kAvx512Rows = 8, kAvx2Rows = 4;

template <int O, int HB = 0>
const ChunkFn* chunk_table(Isa isa) {
  static const auto a = avx512_table<O, HB>(std::make_integer_sequence<int, kAvx512Rows>{});
  static const auto b = avx2_vnni_table<O, HB>(std::make_integer_sequence<int, kAvx2Rows>{});
  static const auto c = avx2_table<O, HB>(std::make_integer_sequence<int, kAvx2Rows>{});
  return isa == kAvx512Vnni ? a.data() : isa == kAvx2Vnni ? b.data() : c.data();
}

bool cpu_supports(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case kAvx2Vnni: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
    case kAvx2: return __builtin_cpu_supports("avx2");
    case kPortable: return true;
    case kAmx: return cpu_supports(kAvx512Vnni) && amx_int8_ready();
    default: return false;
  }
}

Isa best_isa() {
  for (Isa isa : {kAmx, kAvx512Vnni, kAvx2Vnni, kAvx2})
    if (cpu_supports(isa)) return isa;
  return kPortable;
}

}  // namespace

namespace {

// The matmul of every entry point once its arguments are checked: scales given as bf16 pairs (sz,
// int4_gemm) or as a GGUF file's block scales (b; its G is the number of groups either way).
torch::Tensor run_int4(torch::Tensor x, torch::Tensor qpack, const uint16_t* sz, const BlockScales& b, torch::Tensor bias,
                       bool out_fp32, int64_t isa) {
  const int64_t G = b.G;
  const int hbits = b.hbits;
  const int64_t M = x.size(0), K = x.size(1), N = qpack.size(0) * 16, NB = N / 16;
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(hbits == 2 ? K / G == 16 : hbits == 1 ? K / G == 32 : (K / G == 32 || K / G == 64 || K / G == 128),
              "groups of ", K / G, " inputs: need 32, 64 or 128 (32 for Q5_K, 16 for Q6_K)");
  Isa use = isa == kAuto ? best_isa() : (Isa)isa;
  TORCH_CHECK(use >= kAvx512Vnni && use <= kAmx, "unknown isa ", isa);
  TORCH_CHECK(cpu_supports(use), "this CPU lacks the instructions of code path ", isa);
  const int64_t gsize = K / G;
  const bool amx = use == kAmx && gemm_amx_takes(gsize, hbits) && M >= (gsize == 64 ? kAmxMinRows : kAmxMinRowsSmallGroups);
  if (use == kAmx && !amx) use = kAvx512Vnni;
  const int64_t rows = amx ? (M + 15) / 16 * 16 : M;  // AMX reads whole tiles of 16 rows: zero padding

  auto y = torch::empty({M, N}, x.options().dtype(out_fp32 ? at::kFloat : at::kBFloat16));
  auto scratch = [&](int64_t cols, at::ScalarType t) {
    return amx ? torch::zeros({rows, cols}, x.options().dtype(t)) : torch::empty({rows, cols}, x.options().dtype(t));
  };
  auto xq = scratch(K, at::kChar);
  auto a = scratch(G, at::kFloat);
  auto ax = scratch(G, at::kFloat);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* ap = a.data_ptr<float>();
  float* axp = ax.data_ptr<float>();
  auto quantize = use == kAvx512Vnni || use == kAmx ? quantize_row_avx512 : use == kPortable ? quantize_row_portable : quantize_row_avx2;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize(xp + m * K, K, gsize, xqp + m * K, ap + m * G, axp + m * G);
  });

  Problem P{xqp, ap, axp, qpack.data_ptr<uint8_t>(), sz, has_bias ? bias.data_ptr<float>() : nullptr, M, K, N, G, gsize,
            out_fp32 ? y.data_ptr<float>() : nullptr,
            out_fp32 ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), b.kd, b.km, b.qh, hbits, b.sf};
  if (amx) {
    gemm_amx(P);
    return y;
  }
  const ChunkFn* fns = use == kPortable ? nullptr : hbits == 2 ? chunk_table<2, 2>(use) : hbits == 1 ? chunk_table<4, 1>(use)
                      : gsize == 32 ? chunk_table<4>(use) : gsize == 64 ? chunk_table<8>(use) : chunk_table<16>(use);
  const int most = use == kAvx512Vnni ? kAvx512Rows : kAvx2Rows;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t t0 = 0; t0 < M; t0 += kRowTile) {
      const int64_t t1 = std::min(M, t0 + kRowTile);
      for (int64_t nb = b0; nb < b1; ++nb)
        for (int64_t m = t0; m < t1; m += most) {
          const int rows = (int)std::min<int64_t>(most, t1 - m);
          if (use == kPortable) chunk_portable(P, nb, m, rows);
          else fns[rows - 1](P, nb, m);
        }
    }
  });
  return y;
}

}  // namespace

// x (M, K) bf16 contiguous; qpack (N/16, K/8, 64) uint8; scales (N/16, G, 2, 16) bf16; bias (N,) fp32
// or empty; out_fp32: return fp32 (else bf16); isa: 0 = the best this CPU has, else force
// 1 avx512-vnni, 2 avx2-vnni, 3 avx2, 4 portable, 5 amx (AVX-512 VNNI below kAmxMinRows rows, or
// for groups of 128 inputs). Returns (M, N).
torch::Tensor int4_gemm(torch::Tensor x, torch::Tensor qpack, torch::Tensor scales, torch::Tensor bias, bool out_fp32,
                        int64_t isa) {
  const Int4Shape shape = check_int4_args(x, qpack, scales, bias);
  BlockScales b;
  b.G = shape.G;
  return run_int4(x, qpack, reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>()), b, bias, out_fp32, isa);
}

// int4_gemm with each group's (scale, offset) in fp32 instead of bf16: sf (N/16, G, 2, 16) float32
// (pack_f32scales_x86), groups of 32, 64 or 128 inputs; qh empty, or (N/16, K/32, 64) uint8 the fifth
// bits of 5-bit codes (as int4_gemm_q5k's; groups of 32). A GGUF file's Q4_0, Q4_1, Q5_0 and Q5_1
// blocks as they are (their fp16 scales and mins, and -8 d or -16 d, are exact in fp32), and each
// 4-bit plane of its Q8_0 blocks (runtime.block_quant). amx: groups of 32 on AMX, of 64 or 128 on
// AVX-512 VNNI.
torch::Tensor int4_gemm_f32(torch::Tensor x, torch::Tensor qpack, torch::Tensor sf, torch::Tensor qh, torch::Tensor bias,
                            bool out_fp32, int64_t isa) {
  const BlockScales b = check_f32_scales(x, qpack, sf, qh, bias);
  return run_int4(x, qpack, nullptr, b, bias, out_fp32, isa);
}

// The same matmul with a GGUF file's Q4_K scales as they are (groups of 32 inputs, 8 per block of
// 256): kd (N/16, K/256, 2, 16) fp32, each block's d and -dmin for the 16 channels; km (N/16, K/32,
// 2, 16) uint8, each group's 6-bit scale and min (pack_kquant_x86). A group's scale is d * scale and
// its offset -dmin * min, in fp32.
torch::Tensor int4_gemm_kquant(torch::Tensor x, torch::Tensor qpack, torch::Tensor kd, torch::Tensor km,
                               torch::Tensor bias, bool out_fp32, int64_t isa) {
  const BlockScales b = check_q4k_scales(x, qpack, kd, km, bias, nullptr);
  return run_int4(x, qpack, nullptr, b, bias, out_fp32, isa);
}

// The same matmul with a GGUF file's Q5_K blocks as they are: int4_gemm_kquant's scales (kd, km) with
// 5-bit codes, qpack their low 4 bits and qh (N/16, K/32, 64) their fifth (Problem::qh, hbits 1).
torch::Tensor int4_gemm_q5k(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                            torch::Tensor bias, bool out_fp32, int64_t isa) {
  const BlockScales b = check_q4k_scales(x, qpack, kd, km, bias, &qh);
  return run_int4(x, qpack, nullptr, b, bias, out_fp32, isa);
}

// The same matmul with a GGUF file's Q6_K blocks as they are (groups of 16 inputs, 16 per block of
// 256): qpack (N/16, K/8, 64) the low 4 bits of each code u = q + 32 in 0..63, qh (N/16, K/16, 64)
// its high 2 bits (Problem::qh), kd (N/16, K/256, 16) fp32 each block's d, km (N/16, K/16, 16) int8
// each group's scale (pack_q6k_x86). A group's scale is d * sc and its offset -32 * d * sc, in fp32.
torch::Tensor int4_gemm_q6k(torch::Tensor x, torch::Tensor qpack, torch::Tensor qh, torch::Tensor kd, torch::Tensor km,
                            torch::Tensor bias, bool out_fp32, int64_t isa) {
  const BlockScales b = check_q6k_scales(x, qpack, qh, kd, km, bias);
  return run_int4(x, qpack, nullptr, b, bias, out_fp32, isa);
}

// Which code path int4_gemm takes here with isa = 0: 1 avx512-vnni, 2 avx2-vnni, 3 avx2, 4 portable, 5 amx.
int64_t int4_best_isa() { return best_isa(); }

// Whether this CPU runs code path isa (1-4, as above).
bool int4_isa_supported(int64_t isa) { return isa >= kAvx512Vnni && isa <= kAmx && cpu_supports((Isa)isa); }
