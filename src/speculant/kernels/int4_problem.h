// What int4_x86.cpp's code paths and int4_amx_x86.cpp share: one matmul problem (quantized
// activations, packed codes, output) and how every path writes an output row (bias added in fp32,
// then rounded to bf16 to nearest even, or kept in fp32), so that every path gives the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace speculant_int4 {

struct Problem {
  const int8_t* xq;   // (M, K) int8 activations
  const float* a;     // (M, G) activation scales
  const float* ax;    // (M, G) a * (sum of each group's xq), the offsets' factor
  const uint8_t* q;   // (NB, K/8, 64) codes
  const uint16_t* sz; // (NB, G, 2, 16) bf16 bits
  const float* bias;  // (N,) or nullptr
  int64_t M, K, N, G, gsize;
  float* y32;         // (M, N) fp32 output, or
  uint16_t* y16;      // (M, N) bf16 output
};

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as VCVTNEPS2BF16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

inline void store_row(const Problem& P, int64_t m, int64_t n0, const float* acc, int64_t count) {
  for (int64_t c = 0; c < count; ++c) {
    const float v = P.bias ? acc[c] + P.bias[n0 + c] : acc[c];
    if (P.y32) P.y32[m * P.N + n0 + c] = v;
    else P.y16[m * P.N + n0 + c] = float_to_bf16(v);
  }
}

// The AVX-512 paths' pieces (int4_x86.cpp's AVX-512 VNNI path and int4_amx_x86.cpp's AMX path),
// defined once so that the two cannot drift apart: 16 bf16 values to fp32, and the fold of one
// group's exact dot products for 16 channels, acc = fma(o, ax, fma(d * s, a, acc)).
__attribute__((target("avx512f"))) inline __m512 load16_bf16_avx512(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

__attribute__((target("avx512f"))) inline __m512 fold16(__m512 acc, __m512i dot, __m512 s, __m512 o, float a,
                                                        float ax) {
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), s);
  acc = _mm512_fmadd_ps(t, _mm512_set1_ps(a), acc);
  return _mm512_fmadd_ps(o, _mm512_set1_ps(ax), acc);
}

}  // namespace speculant_int4
