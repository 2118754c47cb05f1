// Attention of new tokens over the bf16 KV cache, row-invariant by construction, for any x86 CPU:
// AVX-512F, AVX2 + FMA, or portable C++, all giving the same bits (attention_impl.h is the one body
// of the three; only the 16-lane vector type differs).
//
// out[i, h, j] = sum_t softmax_t(q[i, h, j] . k[h, t] / sqrt(D)) v[h, t] over the keys t that
// token i may see, visited in increasing t. Each (token, query head) is computed on its own, in an
// order that depends only on the keys it sees, so a tree node gets bit for bit what a one-token pass
// over its own path gets, and a prompt scored in one pass gets what it gets token by token.
// Scores, softmax and the weighted sum are fp32; dot products and sums reduce 16 lanes in one
// fixed order (lane i + lane i+8, then +4, +2, +1) on every path.
//
// q (n, Hkv, g, D) bf16; keys / values (Hkv, C, D) bf16 (the cache slab, C >= T); allowed (n, T)
// bool, or empty for the causal mask (token i sees keys 0 .. past + i). D a multiple of 16, <= 256.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

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
  static V fma(V a, V b, V c) { for (int i = 0; i < 16; ++i) a.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return a; }
  static V round(V a) { for (int i = 0; i < 16; ++i) a.v[i] = std::nearbyint(a.v[i]); return a; }
  static V exp2i(V a) { for (int i = 0; i < 16; ++i) a.v[i] = pow2i(a.v[i]); return a; }
  static float sum(V a) {
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) a.v[i] = a.v[i] + a.v[i + w];
    return a.v[0];
  }
};
#include "attention_impl.h"
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
};
#include "attention_impl.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace avx512 {
struct V {
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
};
#include "attention_impl.h"
}  // namespace avx512
#pragma GCC pop_options

using RowFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*, int64_t, int64_t, float,
                       float*, uint16_t*);

bool attention_isa_supported(int64_t isa) {  // 1 avx512, 3 avx2 (+fma), 4 portable (as int4_gemm's numbering)
  __builtin_cpu_init();
  switch (isa) {
    case 1: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    case 2:
    case 3: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case 4: return true;
    default: return false;
  }
}

}  // namespace

// isa: 0 = the best this CPU has; 1 avx512; 2 or 3 avx2; 4 portable.
torch::Tensor attend_x86(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed, int64_t past,
                         int64_t isa) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q must be (n, Hkv, g, D) bf16");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16, "bf16 cache expected");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.stride(2) == 1 && values.stride(2) == 1 &&
              keys.stride(1) == keys.size(2) && values.stride(1) == values.size(2),
              "keys / values must be (Hkv, C, D) with contiguous rows");
  const int64_t n = q.size(0), H = q.size(1), g = q.size(2), D = q.size(3);
  const bool causal = allowed.numel() == 0;
  TORCH_CHECK(causal || (allowed.scalar_type() == at::kBool && allowed.dim() == 2 && allowed.is_contiguous() &&
                         allowed.size(0) == n), "allowed must be (n, T) bool, or empty for the causal mask");
  const int64_t T = causal ? past + n : allowed.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && keys.size(0) == H && values.size(0) == H && keys.size(2) == D &&
              values.size(2) == D && keys.size(1) >= T && values.size(1) >= T, "shapes do not match");
  int64_t use = isa;
  if (use == 0) use = attention_isa_supported(1) ? 1 : attention_isa_supported(3) ? 3 : 4;
  TORCH_CHECK(attention_isa_supported(use), "this CPU lacks the instructions of code path ", isa);
  const RowFn row = use == 1 ? &avx512::attend_row : use == 4 ? &portable::attend_row : &avx2::attend_row;
  auto out = torch::empty_like(q);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  const int64_t ks = keys.stride(0), vs = values.stride(0);
  const bool* ap = causal ? nullptr : allowed.data_ptr<bool>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float scale = 1.f / std::sqrt((float)D);
  at::parallel_for(0, n * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int32_t> idx(T);
    std::vector<float> s(T + 16);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / H, h = w % H;
      int64_t m = 0;
      if (causal) {
        for (int64_t t = 0; t <= past + i; ++t) idx[m++] = (int32_t)t;
      } else {
        for (int64_t t = 0; t < T; ++t)
          if (ap[i * T + t]) idx[m++] = (int32_t)t;
      }
      for (int64_t j = 0; j < g; ++j) {
        const int64_t at = ((i * H + h) * g + j) * D;
        if (m == 0) {
          std::memset(op + at, 0, D * sizeof(uint16_t));
          continue;
        }
        row(qp + at, kp + h * ks, vp + h * vs, idx.data(), m, D, scale, s.data(), op + at);
      }
    }
  });
  return out;
}

bool attend_isa_supported(int64_t isa) { return attention_isa_supported(isa); }
