// The element-wise parts of a Llama / Qwen2 decoder layer for the native backend, on the same three
// code paths as attention_x86.cpp (AVX-512F, AVX2 + FMA, portable C++; the same bits on each):
// RMSNorm, SiLU(gate) * up, and RoPE of q and k with k and v written into the KV cache. One call
// each instead of a dozen PyTorch operations (docs/design-notes.md#fused-layer-operations).
// Every row is computed on its own (row-invariant).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace {

#include "vec16.h"

#define VEC16_BODY "layer_impl.h"
#include "vec16_paths.h"

int64_t pick(int64_t isa) {  // 1 avx512, 3 avx2 (+fma), 4 portable; 0: the best this CPU has
  __builtin_cpu_init();
  const bool a512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool a2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa == 0) return a512 ? 1 : a2 ? 3 : 4;
  TORCH_CHECK((isa == 1 && a512) || ((isa == 2 || isa == 3) && a2) || isa == 4, "this CPU lacks code path ", isa);
  return isa == 2 ? 3 : isa;
}

inline const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
inline uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

void check_bf16_2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), name, " must be 2-D bf16 contiguous");
}

}  // namespace

// x (n, H) bf16, w (H,) bf16 -> (n, H) bf16.
torch::Tensor rms_norm_x86(torch::Tensor x, torch::Tensor w, double eps, int64_t isa) {
  check_bf16_2d(x, "x");
  const int64_t n = x.size(0), H = x.size(1);
  TORCH_CHECK(H % 16 == 0 && w.numel() == H && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w must be (H,) bf16 and H a multiple of 16");
  const int64_t use = pick(isa);
  auto out = torch::empty_like(x);
  const uint16_t *xp = bits(x), *wp = bits(w);
  uint16_t* op = bits_mut(out);
  auto fn = use == 1 ? &avx512::rms_norm_row : use == 3 ? &avx2::rms_norm_row : &portable::rms_norm_row;
  at::parallel_for(0, n, 8, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) fn(xp + i * H, wp, H, (float)eps, op + i * H);
  });
  return out;
}

// gu (n, 2F) bf16 = [gate | up] -> (n, F) bf16 silu(gate) * up.
torch::Tensor silu_mul_x86(torch::Tensor gu, int64_t isa) {
  check_bf16_2d(gu, "gu");
  const int64_t n = gu.size(0), F = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * F && F % 16 == 0, "gu must have 2F columns, F a multiple of 16");
  const int64_t use = pick(isa);
  auto out = torch::empty({n, F}, gu.options());
  const uint16_t* gp = bits(gu);
  uint16_t* op = bits_mut(out);
  auto fn = use == 1 ? &avx512::silu_mul_row : use == 3 ? &avx2::silu_mul_row : &portable::silu_mul_row;
  at::parallel_for(0, n, 4, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) fn(gp + i * 2 * F, F, op + i * F);
  });
  return out;
}

// qkv (n, (Hq + 2 Hkv) D) bf16 = [q | k | v] per row; cos, sin (n, D/2) fp32; slab (2, Hkv, C, D) bf16
// (one layer of the KV cache, rows contiguous). Writes RoPE(k) and v at positions start .. start+n-1
// of the slab and returns RoPE(q) (n, Hq, D) bf16.
torch::Tensor rope_qkv_x86(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t Hq, int64_t Hkv,
                           torch::Tensor slab, int64_t start, int64_t isa) {
  check_bf16_2d(qkv, "qkv");
  const int64_t n = qkv.size(0);
  TORCH_CHECK(Hq > 0 && Hkv > 0 && qkv.size(1) % (Hq + 2 * Hkv) == 0, "qkv columns are not (Hq + 2 Hkv) x D");
  const int64_t D = qkv.size(1) / (Hq + 2 * Hkv);
  TORCH_CHECK(D % 2 == 0, "head dim must be even, got ", D);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.numel() == n * D / 2 && sin.numel() == n * D / 2, "cos, sin must be (n, D/2) fp32");
  TORCH_CHECK(slab.dim() == 4 && slab.size(0) == 2 && slab.size(1) == Hkv && slab.size(3) == D &&
              slab.scalar_type() == at::kBFloat16 && slab.stride(3) == 1 && slab.stride(2) == D &&
              start >= 0 && start + n <= slab.size(2), "slab must be (2, Hkv, C, D) bf16 with room for the rows");
  const int64_t use = pick(isa);
  auto q = torch::empty({n, Hq, D}, qkv.options());
  const uint16_t* xp = bits(qkv);
  uint16_t* qp = bits_mut(q);
  uint16_t* sp = reinterpret_cast<uint16_t*>(slab.data_ptr<at::BFloat16>());
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const int64_t s0 = slab.stride(0), s1 = slab.stride(1), row = (Hq + 2 * Hkv) * D;
  auto fn = use == 1 ? &avx512::rope_head : use == 3 ? &avx2::rope_head : &portable::rope_head;
  at::parallel_for(0, n, 8, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const uint16_t* x = xp + i * row;
      const float *c = cp + i * D / 2, *s = snp + i * D / 2;
      for (int64_t h = 0; h < Hq; ++h) fn(x + h * D, c, s, D, qp + (i * Hq + h) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        fn(x + (Hq + h) * D, c, s, D, sp + h * s1 + (start + i) * D);
        std::memcpy(sp + s0 + h * s1 + (start + i) * D, x + (Hq + Hkv + h) * D, D * sizeof(uint16_t));
      }
    }
  });
  return q;
}
