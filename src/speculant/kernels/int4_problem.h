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
  const uint16_t* sz; // (NB, G, 2, 16) bf16 bits: each group's (scale, offset); unused when kd is set
  const float* bias;  // (N,) or nullptr
  int64_t M, K, N, G, gsize;
  float* y32;         // (M, N) fp32 output, or
  uint16_t* y16;      // (M, N) bf16 output
  // k-quant scales (a GGUF file's Q4_K blocks as they are; groups of 32, 8 per block of 256):
  const float* kd = nullptr;    // (NB, G/8, 2, 16) fp32: each block's d and -dmin for the 16 channels
  const uint8_t* km = nullptr;  // (NB, G, 2, 16) uint8: each group's 6-bit scale and min
  // Codes of more than 4 bits: their low 4 bits in q, the rest in qh (hbits of them per code).
  // hbits 1, Q5_K (5-bit codes, scales as Q4_K's): qh (NB, K/32, 64), byte 4c + i of input chunk P
  //   holding bit 4 of inputs 32P + 4j + i of channel c in bit j (j = 0..7).
  // hbits 2, Q6_K (groups of 16, 16 per block of 256; codes u = q + 32 in 0..63): qh (NB, K/16, 64),
  //   byte 4c + i of chunk P holding bits 4-5 of inputs 16P + 4j + i in bits 2j, 2j + 1 (j = 0..3);
  //   kd is then (NB, G/16, 16) fp32, each block's d, and km (NB, G, 16) int8, each group's scale:
  //   w = (d * sc) * u + (-32 * d * sc).
  const uint8_t* qh = nullptr;
  int hbits = 0;
  // fp32 scales (a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks: an fp16 scale, and an fp16 min or
  // a fixed zero point, per group of 32): (NB, G, 2, 16) fp32, each group's (scale, offset) for the
  // block's 16 channels, as sz's bf16 pairs but exact. Unused when kd is set.
  const float* sf = nullptr;
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

// Group g's (scale, offset) of channel c (0-15) of block nb: the bf16 pair, the fp32 pair, or d * sc and
// (-dmin) * m in fp32 (the products are exact: what the file's weights are made of).
inline void scale_pair(const Problem& P, int64_t nb, int64_t g, int c, float& s, float& o) {
  if (P.hbits == 2) {  // Q6_K: d * sc (fp16 x int8: exact in fp32) and -32 times it (exact)
    const float d = P.kd[(nb * (P.G / 16) + g / 16) * 16 + c];
    s = d * (float)(int8_t)P.km[(nb * P.G + g) * 16 + c];
    o = -32.f * s;
  } else if (P.kd) {
    const float* d = P.kd + (nb * (P.G / 8) + g / 8) * 32;
    const uint8_t* m = P.km + (nb * P.G + g) * 32;
    s = d[c] * (float)m[c];
    o = d[16 + c] * (float)m[16 + c];
  } else if (P.sf) {
    const float* sg = P.sf + (nb * P.G + g) * 32;
    s = sg[c];
    o = sg[16 + c];
  } else {
    const uint16_t* sg = P.sz + (nb * P.G + g) * 32;
    s = bf16_to_float(sg[c]);
    o = bf16_to_float(sg[16 + c]);
  }
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

// The 16 channels' (scale, offset) of group g: bf16 pairs, fp32 pairs, or k-quant products (scale_pair).
__attribute__((target("avx512f"))) inline void scales16(const Problem& P, int64_t nb, int64_t g, __m512& s,
                                                        __m512& o) {
  if (P.hbits == 2) {
    const float* d = P.kd + (nb * (P.G / 16) + g / 16) * 16;
    const int8_t* m = (const int8_t*)P.km + (nb * P.G + g) * 16;
    s = _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)m))));
    o = _mm512_mul_ps(_mm512_set1_ps(-32.f), s);
  } else if (P.kd) {
    const float* d = P.kd + (nb * (P.G / 8) + g / 8) * 32;
    const uint8_t* m = P.km + (nb * P.G + g) * 32;
    s = _mm512_mul_ps(_mm512_loadu_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)m))));
    o = _mm512_mul_ps(_mm512_loadu_ps(d + 16),
                      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(m + 16)))));
  } else if (P.sf) {
    const float* sg = P.sf + (nb * P.G + g) * 32;
    s = _mm512_loadu_ps(sg);
    o = _mm512_loadu_ps(sg + 16);
  } else {
    const uint16_t* sg = P.sz + (nb * P.G + g) * 32;
    s = load16_bf16_avx512(sg);
    o = load16_bf16_avx512(sg + 16);
  }
}

// Where octet p's high bits are (HB bits per code, Problem::qh): the bit of its low-nibble lanes
// in its qh byte (the high-nibble lanes' is HB above it), and qh's 64-byte vector for it.
template <int HB>
constexpr int high_from(int64_t octet) { return HB == 2 ? 4 * (int)(octet % 2) : 2 * (int)(octet % 4); }
template <int HB>
inline const uint8_t* high_at(const uint8_t* hb, int64_t octet) { return hb + octet / (HB == 2 ? 2 : 4) * 64; }

// h's bits at ``from`` (HB of them per byte) moved to bit 4 (and 5), the rest cleared (keep: 0x10
// or 0x30 in every byte).
__attribute__((target("avx512f,avx512bw"))) inline __m512i high_bits512(__m512i h, int from, __m512i keep) {
  const __m512i t = from < 4 ? _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - from)) : _mm512_srl_epi16(h, _mm_cvtsi32_si128(from - 4));
  return _mm512_and_si512(t, keep);
}

// Octet ``octet`` of a channel block's codes (qb: the block's K/8 x 64 bytes; hb: its high bits, HB
// per code) unpacked for VPDPBUSD / TDPBSUD: lo the codes of inputs 8 octet .. 8 octet + 3, hi of
// 8 octet + 4 .. 8 octet + 7, 16 channels x 4 bytes each, the high bits OR-ed in as bits 4 (and 5).
template <int HB>
__attribute__((target("avx512f,avx512bw"))) inline void octet_codes512(const uint8_t* qb, const uint8_t* hb, int64_t octet,
                                                                       __m512i& lo, __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i w = _mm512_loadu_si512((const void*)(qb + 64 * octet));
  lo = _mm512_and_si512(w, nib);
  hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
  if constexpr (HB > 0) {
    const __m512i keep = _mm512_set1_epi8(HB == 2 ? 0x30 : 0x10);
    const __m512i h = _mm512_loadu_si512((const void*)high_at<HB>(hb, octet));
    lo = _mm512_or_si512(lo, high_bits512(h, high_from<HB>(octet), keep));
    hi = _mm512_or_si512(hi, high_bits512(h, high_from<HB>(octet) + HB, keep));
  }
}

__attribute__((target("avx512f"))) inline __m512 fold16(__m512 acc, __m512i dot, __m512 s, __m512 o, float a,
                                                        float ax) {
  const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), s);
  acc = _mm512_fmadd_ps(t, _mm512_set1_ps(a), acc);
  return _mm512_fmadd_ps(o, _mm512_set1_ps(ax), acc);
}

}  // namespace speculant_int4
