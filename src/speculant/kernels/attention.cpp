// Attention of a few new tokens over the KV cache, row-invariant by construction (AVX-512).
//
// out[i, h, j] = sum_t softmax_t(q[i, h, j] . k[h, t] / sqrt(D)) v[h, t] over the keys t that
// token i may see (allowed[i, t]), visited in increasing t. Each (token, query head) is computed
// on its own, in an order that depends only on the keys it sees, so a tree node gets bit for bit
// what a one-token pass over its own path gets (its ancestors' keys are the same values in the
// same order as the plain sequence's). Scores, softmax and the weighted sum are fp32.
//
// q (n, Hkv, g, D) bf16; keys / values (Hkv, C, D) bf16 (the cache slab, C >= T); allowed (n, T)
// bool -> out (n, Hkv, g, D) bf16. D must be a multiple of 16 (64 or 128 in practice).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

namespace {

inline __m512 load_bf16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// exp(x) for x <= 0 (scores minus their max): 2^(x log2 e) = 2^i * 2^f, f in [-0.5, 0.5],
// 2^f by a degree-6 polynomial (relative error ~1e-7), 2^i by scalef. Deterministic.
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.5403530393381609954e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443423e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284771619e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821579953e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071233e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994530942e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, i);
}

}  // namespace

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kBFloat16 && q.is_contiguous(), "q must be (n, Hkv, g, D) bf16");
  TORCH_CHECK(keys.scalar_type() == at::kBFloat16 && values.scalar_type() == at::kBFloat16, "bf16 cache expected");
  TORCH_CHECK(keys.dim() == 3 && keys.stride(2) == 1 && values.stride(2) == 1 && keys.stride(1) == keys.size(2) &&
              values.stride(1) == values.size(2), "keys / values must be (Hkv, C, D) with contiguous rows");
  TORCH_CHECK(allowed.scalar_type() == at::kBool && allowed.dim() == 2 && allowed.is_contiguous(), "bad mask");
  const int64_t n = q.size(0), H = q.size(1), g = q.size(2), D = q.size(3), T = allowed.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && keys.size(0) == H && keys.size(2) == D && keys.size(1) >= T,
              "shapes do not match");
  auto out = torch::empty_like(q);
  const at::BFloat16* qp = q.data_ptr<at::BFloat16>();
  const at::BFloat16* kp = keys.data_ptr<at::BFloat16>();
  const at::BFloat16* vp = values.data_ptr<at::BFloat16>();
  const int64_t ks = keys.stride(0), vs = values.stride(0);
  const bool* ap = allowed.data_ptr<bool>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const float scale = 1.f / std::sqrt((float)D);
  const int64_t DV = D / 16;
  at::parallel_for(0, n * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int32_t> idx(T);
    std::vector<float> s(T + 16);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / H, h = w % H;
      int64_t m = 0;
      for (int64_t t = 0; t < T; ++t)
        if (ap[i * T + t]) idx[m++] = (int32_t)t;
      for (int64_t j = 0; j < g; ++j) {
        const at::BFloat16* qrow = qp + ((i * H + h) * g + j) * D;
        __m512 qv[16];
        for (int64_t d = 0; d < DV; ++d) qv[d] = load_bf16(qrow + 16 * d);
        float mx = -INFINITY;
        for (int64_t u = 0; u < m; ++u) {
          const at::BFloat16* krow = kp + h * ks + (int64_t)idx[u] * D;
          __m512 acc = _mm512_mul_ps(qv[0], load_bf16(krow));
          for (int64_t d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(qv[d], load_bf16(krow + 16 * d), acc);
          s[u] = _mm512_reduce_add_ps(acc) * scale;
          mx = std::max(mx, s[u]);
        }
        for (int64_t u = m; u < ((m + 15) / 16) * 16; ++u) s[u] = -INFINITY;  // padding lanes: exp -> 0
        const __m512 vmx = _mm512_set1_ps(mx);
        __m512 vsum = _mm512_setzero_ps();
        for (int64_t u = 0; u < m; u += 16) {
          const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(&s[u]), vmx));
          const __m512 e0 = _mm512_maskz_mov_ps(m - u >= 16 ? 0xFFFF : (__mmask16)((1u << (m - u)) - 1), e);
          _mm512_storeu_ps(&s[u], e0);
          vsum = _mm512_add_ps(vsum, e0);
        }
        const float inv = 1.f / _mm512_reduce_add_ps(vsum);
        __m512 o[16];
        for (int64_t d = 0; d < DV; ++d) o[d] = _mm512_setzero_ps();
        for (int64_t u = 0; u < m; ++u) {
          const __m512 p = _mm512_set1_ps(s[u]);
          const at::BFloat16* vrow = vp + h * vs + (int64_t)idx[u] * D;
          for (int64_t d = 0; d < DV; ++d) o[d] = _mm512_fmadd_ps(p, load_bf16(vrow + 16 * d), o[d]);
        }
        at::BFloat16* orow = op + ((i * H + h) * g + j) * D;
        const __m512 vinv = _mm512_set1_ps(inv);
        for (int64_t d = 0; d < DV; ++d)
          _mm256_storeu_si256((__m256i*)(orow + 16 * d), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[d], vinv)));
      }
    }
  });
  return out;
}
