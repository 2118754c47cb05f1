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

// Scratch for one (token, kv head): G query heads' fp32 queries, scores and partial dot products.
struct Scratch {
  float* q;     // (G, D)
  float* s;     // (G, stride) scores, then weights; stride >= m + 16
  float* part;  // (G, 16, 16) per-key lane partials, reduced 16 keys at a time
  int64_t stride;
};

#include "vec16.h"

#define VEC16_BODY "attention_impl.h"
#include "vec16_paths.h"

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

// isa: 0 = the best this CPU has; 1 avx512; 2 or 3 avx2; 4 portable. scale <= 0: 1 / sqrt(D); cap > 0:
// scores soft-capped, cap * tanh(s / cap), before the softmax (Gemma 2).
torch::Tensor attend_capped_x86(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed,
                                int64_t past, double scale_arg, double cap_arg, int64_t isa) {
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
  TORCH_CHECK(g >= 1 && g <= 8, "1 to 8 query heads per kv head, got ", g);
  const auto fn = (use == 1 ? avx512::token_fns() : use == 4 ? portable::token_fns() : avx2::token_fns())[g - 1];
  auto out = torch::empty_like(q);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(keys.data_ptr<at::BFloat16>());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(values.data_ptr<at::BFloat16>());
  const int64_t ks = keys.stride(0), vs = values.stride(0);
  const bool* ap = causal ? nullptr : allowed.data_ptr<bool>();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float scale = scale_arg > 0 ? (float)scale_arg : 1.f / std::sqrt((float)D);
  const float cap = cap_arg > 0 ? (float)cap_arg : 0.f;
  const int64_t stride = T + 16;
  at::parallel_for(0, n * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<int32_t> idx(T);
    std::vector<float> buf(g * D + g * stride + g * 256 + 16);
    float* base = buf.data();
    const Scratch scratch{base, base + g * D, base + g * D + g * stride, stride};
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / H, h = w % H;
      int64_t m = 0;
      if (causal) {
        for (int64_t t = 0; t <= past + i; ++t) idx[m++] = (int32_t)t;
      } else {
        for (int64_t t = 0; t < T; ++t)
          if (ap[i * T + t]) idx[m++] = (int32_t)t;
      }
      const int64_t at = (i * H + h) * g * D;
      if (m == 0) {
        std::memset(op + at, 0, g * D * sizeof(uint16_t));
        continue;
      }
      fn(qp + at, kp + h * ks, vp + h * vs, idx.data(), m, D, scale, cap, scratch, op + at);
    }
  });
  return out;
}

torch::Tensor attend_x86(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed, int64_t past,
                         int64_t isa) {
  return attend_capped_x86(q, keys, values, allowed, past, 0.0, 0.0, isa);
}

bool attend_isa_supported(int64_t isa) { return attention_isa_supported(isa); }
