// A 16-lane fp32 vector type `V` for each of three code paths: `portable` (plain C++), `avx2`
// (two 8-lane AVX2 halves, FMA) and `avx512` (AVX-512F), each in its own namespace and compiled for
// its instruction set. Kernels written once against V (attention_impl.h, layer_impl.h) and included
// in each namespace perform the same IEEE operations in the same order on every path, so they give
// the same bits. V has: zero, set1, load, store (16 floats), load_bf16, store_bf16 (round to nearest
// even), add, sub, mul, div, max, min (x86's: a > b ? a : b, a < b ? a : b), fma, round (to nearest even), exp2i (2^i of integral lanes), sum (the
// lanes added in one fixed pairwise order: lane i + lane i+8, then i + i+4, i + i+2, i + i+1) and
// sum16 (16 such sums at once, in the same order); vec16_math.h adds exp_neg.
// Include inside an anonymous namespace, after <immintrin.h>, <cmath> and <cstring>.
#pragma once

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

inline float pow2i(float i) {  // 2^i for integral i in [-126, 127]
  const uint32_t u = (uint32_t)((int32_t)i + 127) << 23;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace portable {
struct V {
  static constexpr int kWide = 4;  // V accumulators per output row a pass keeps (no vector registers: blocking as for AVX-512)
  float v[16];
  static V zero() { V r; for (int i = 0; i < 16; ++i) r.v[i] = 0.f; return r; }
  static V set1(float x) { V r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
  static V load(const float* p) { V r; std::memcpy(r.v, p, 64); return r; }
  static void store(float* p, V a) { std::memcpy(p, a.v, 64); }
  static V load_bf16(const uint16_t* p) { V r; for (int i = 0; i < 16; ++i) r.v[i] = bf16_bits_to_float(p[i]); return r; }
  static void store_bf16(uint16_t* p, V a) { for (int i = 0; i < 16; ++i) p[i] = float_to_bf16_bits(a.v[i]); }
  static V add(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] + b.v[i]; return a; }
  static V sub(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] - b.v[i]; return a; }
  static V mul(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] * b.v[i]; return a; }
  static V max(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return a; }
  static V min(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return a; }
  static V div(V a, V b) { for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] / b.v[i]; return a; }
  static V fma(V a, V b, V c) { for (int i = 0; i < 16; ++i) a.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return a; }
  static V round(V a) { for (int i = 0; i < 16; ++i) a.v[i] = std::nearbyint(a.v[i]); return a; }
  static V exp2i(V a) { for (int i = 0; i < 16; ++i) a.v[i] = pow2i(a.v[i]); return a; }
  static float sum(V a) {
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) a.v[i] = a.v[i] + a.v[i + w];
    return a.v[0];
  }
  static V sum16(const float* p) {  // lane k = sum(p[16 k .. 16 k + 15])
    V r;
    for (int k = 0; k < 16; ++k) r.v[k] = sum(load(p + 16 * k));
    return r;
  }
};
#include "vec16_math.h"
}  // namespace portable

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
inline __m256 bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m128i to_bf16x8(__m256 a) {  // round to nearest even (finite inputs)
  const __m256i u = _mm256_castps_si256(a);
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
  const __m256i h = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
struct V {
  static constexpr int kWide = 1;  // V accumulators per output row a pass keeps (two ymm registers per V)
  __m256 lo, hi;  // lanes 0-7, 8-15
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
  static V load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
  static void store_bf16(uint16_t* p, V a) {
    _mm_storeu_si128((__m128i*)p, to_bf16x8(a.lo));
    _mm_storeu_si128((__m128i*)(p + 8), to_bf16x8(a.hi));
  }
  static V add(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static V sub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
  static V mul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static V max(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
  static V min(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
  static V div(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
  static V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static V round(V a) {
    constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
  }
  static __m256 pow2(__m256 i) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23));
  }
  static V exp2i(V a) { return {pow2(a.lo), pow2(a.hi)}; }
  static float sum(V a) {
    const __m256 s8 = _mm256_add_ps(a.lo, a.hi);  // i + i+8
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));  // i + i+4
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));  // i + i+2
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));  // i + i+1
    return _mm_cvtss_f32(s1);
  }
  static V sum16(const float* p) {  // lane k = sum(p[16 k .. 16 k + 15])
    alignas(32) float r[16];
    for (int k = 0; k < 16; ++k) r[k] = sum(load(p + 16 * k));
    return load(r);
  }
};
#include "vec16_math.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
struct V {
  static constexpr int kWide = 4;  // V accumulators per output row a pass keeps (one zmm register per V)
  __m512 v;
  static V zero() { return {_mm512_setzero_ps()}; }
  static V set1(float x) { return {_mm512_set1_ps(x)}; }
  static V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
  static V load_bf16(const uint16_t* p) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
  }
  static void store_bf16(uint16_t* p, V a) {  // round to nearest even (finite inputs), as VCVTNEPS2BF16
    const __m512i u = _mm512_castps_si512(a.v);
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  }
  static V add(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
  static V sub(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static V mul(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static V max(V a, V b) { return {_mm512_max_ps(a.v, b.v)}; }
  static V min(V a, V b) { return {_mm512_min_ps(a.v, b.v)}; }
  static V div(V a, V b) { return {_mm512_div_ps(a.v, b.v)}; }
  static V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static V round(V a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
  static V exp2i(V a) {
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(a.v), _mm512_set1_epi32(127)), 23))};
  }
  static float sum(V a) {
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    const __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
  }
  // lane k = sum(p[16 k .. 16 k + 15]) by a transposing reduction that adds, for every k, the
  // same pairs as sum() does: lanes i + i+8, then i + i+4, i + i+2, i + i+1.
  static V sum16(const float* p) {
    __m512 a[16], b[8], c[4], d[2];
    for (int k = 0; k < 16; ++k) a[k] = _mm512_loadu_ps(p + 16 * k);
    for (int t = 0; t < 8; ++t)  // [k=2t: i + i+8 (8 lanes) | k=2t+1: same]
      b[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int t = 0; t < 4; ++t)  // quarter q: key 4t+q, i + i+4 (4 lanes)
      c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(b[2 * t], b[2 * t + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int t = 0; t < 2; ++t)  // quarter q: [key 8t+q: i + i+2 (2 lanes) | key 8t+4+q: same]
      d[t] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * t], c[2 * t + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm512_shuffle_ps(c[2 * t], c[2 * t + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // quarter q, lane l: key 4 l + q, i + i+1
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return {_mm512_permutexvar_ps(order, e)};
  }
};
#include "vec16_math.h"
}  // namespace avx512
#pragma GCC pop_options
