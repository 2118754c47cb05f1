// Weight-only int4 matmul for a few rows (decoding, tree verification) on AMX-INT8.
//
// y (M, N) bf16 = x (M, K) bf16 @ W.T, W (N, K) stored as 4-bit codes q in [0, 15] with one
// (scale, offset) per group of 64 input channels: w = q * scale + offset.
//
// Why: PyTorch's CPU int4 kernel costs ~linearly in M, so verifying a tree of 8-16 tokens costs
// several times one token (docs/design-notes.md#int4-kernels). Here the 4-bit codes are only unpacked to bytes (no arithmetic) into one AMX
// tile per 16 channels x 64 inputs, and one tdpbsud multiplies them with up to 16 rows of
// activations at once (two tiles for up to 32 rows), so the cost stays about that of reading the
// weights from 1 to 16 rows and grows slowly to 32.
//
// Activations are quantized per row and per group of 64 inputs to int8 (absmax; what llama.cpp
// does for its Q4 x Q8 dot products): x[m, k] ~ a[m, g] * xq[m, k]. Then, per group,
//   sum_k x w = a[m, g] * (scale[n, g] * sum_k xq q + offset[n, g] * sum_k xq),
// the integer dot product coming from the tile and the fold done in fp32.
// Every row is quantized, multiplied and accumulated on its own, in the same order whatever M
// is: a row's result does not depend on the other rows (tree verification = one-token passes).
//
// Packed layout (pack_int4 in kernels/__init__.py): qpack (N/16, K/4, 32) uint8. For the block of
// channels 16 nb .. 16 nb + 15 and inputs 4 r .. 4 r + 3, the AMX B-tile row (VNNI: 16 channels x
// 4 bytes) has byte t = 4 c + i = q[16 nb + c, 4 r + i]; packed byte j holds row byte j in its low
// nibble and row byte j + 32 in its high nibble. scales (N/16, K/64, 2, 16) bf16: (scale, offset)
// of each group for the block's 16 channels.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_tiles.h"

namespace {

constexpr int64_t kGroup = 64;  // inputs per quantization group = one tile step

using speculant_amx::TileConfig;

inline __m512 bf16x16_to_fp32(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit left shift
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// x (M, K) bf16 -> xq (M, K) int8, a (M, K/64) scales, xsum (M, K/64) = sum of each group's xq.
void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int8_t* xq, float* a, int32_t* xsum) {
  const int64_t groups = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const at::BFloat16* p = x + m * K + g * kGroup;
      __m512 v[4];
      __m512 amax = _mm512_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = bf16x16_to_fp32(p + 16 * i);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
      }
      const float mx = _mm512_reduce_max_ps(amax);
      const float scale = mx > 0 ? mx / 127.f : 1.f;
      const __m512 inv = _mm512_set1_ps(mx > 0 ? 127.f / mx : 0.f);
      __m512i sum = _mm512_setzero_si512();
      int8_t* out = xq + m * K + g * kGroup;
      for (int i = 0; i < 4; ++i) {
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));  // round to nearest even
        sum = _mm512_add_epi32(sum, qi);
        _mm_storeu_si128((__m128i*)(out + 16 * i), _mm512_cvtsepi32_epi8(qi));
      }
      a[m * groups + g] = scale;
      xsum[m * groups + g] = _mm512_reduce_add_epi32(sum);
    }
  }
}

// One B tile (16 quads of inputs x 16 channels x 4 codes) from its 512 packed bytes.
inline void unpack_tile(const uint8_t* gq, uint8_t* b) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int r = 0; r < 16; ++r) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(gq + r * 32));
    const __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    _mm512_store_si512((__m512i*)(b + r * 64), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }
}

// acc[m] += a[m, g] * (scale * C[m] + offset * xsum[m, g]) for one group's int32 tile C (rows x 16).
inline void fold(const int32_t* c, const at::BFloat16* gs, const float* a, const int32_t* xsum, int64_t groups,
                 int64_t g, int rows, __m512* acc) {
  const __m512 s = bf16x16_to_fp32(gs), o = bf16x16_to_fp32(gs + 16);
  for (int m = 0; m < rows; ++m) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const __m512i*)(c + m * 16)));
    const __m512 t = _mm512_fmadd_ps(dot, s, _mm512_mul_ps(o, _mm512_set1_ps((float)xsum[m * groups + g])));
    acc[m] = _mm512_fmadd_ps(t, _mm512_set1_ps(a[m * groups + g]), acc[m]);
  }
}

// One block of 16 output channels for up to 32 rows: tiles 0/3 = A (rows 0-15 / 16-31), 1 = B,
// 2/4 = C. The codes are unpacked once for both halves.
void block(const uint8_t* q, const at::BFloat16* sz, const int8_t* xq, const float* a, const int32_t* xsum,
           int rows, int64_t K, at::BFloat16* y, int64_t ldy) {
  alignas(64) uint8_t b[16 * 64];
  alignas(64) int32_t c[32 * 16];
  __m512 acc[32];
  for (int m = 0; m < rows; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t groups = K / kGroup;
  const bool two = rows > 16;
  for (int64_t g = 0; g < groups; ++g) {
    unpack_tile(q + g * 16 * 32, b);
    asm volatile("" ::: "memory");  // GCC's tile intrinsics are asm without memory operands
    _tile_loadd(1, b, 64);
    _tile_loadd(0, xq + g * kGroup, K);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, c, 64);
    if (two) {
      _tile_loadd(3, xq + 16 * K + g * kGroup, K);
      _tile_zero(4);
      _tile_dpbsud(4, 3, 1);
      _tile_stored(4, c + 16 * 16, 64);
    }
    asm volatile("" ::: "memory");
    fold(c, sz + g * 32, a, xsum, groups, g, rows, acc);
  }
  for (int m = 0; m < rows; ++m)
    _mm256_storeu_si256((__m256i*)(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

// Three consecutive blocks of 16 output channels for up to 16 rows: their unpacking and tile
// operations interleave (one A tile shared; B tiles 1, 5, 7; C tiles 2, 6, 3), so the AMX unit and
// the unpacking overlap instead of waiting on each other group after group.
void block3(const uint8_t* q, int64_t qstride, const at::BFloat16* sz, int64_t sstride, const int8_t* xq,
            const float* a, const int32_t* xsum, int rows, int64_t K, at::BFloat16* y, int64_t ldy) {
  alignas(64) uint8_t b[3][16 * 64];
  alignas(64) int32_t c[3][16 * 16];
  __m512 acc[3][16];
  for (int j = 0; j < 3; ++j)
    for (int m = 0; m < rows; ++m) acc[j][m] = _mm512_setzero_ps();
  const int64_t groups = K / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    for (int j = 0; j < 3; ++j) unpack_tile(q + j * qstride + g * 16 * 32, b[j]);
    asm volatile("" ::: "memory");  // GCC's tile intrinsics are asm without memory operands
    _tile_loadd(0, xq + g * kGroup, K);
    _tile_loadd(1, b[0], 64);
    _tile_loadd(5, b[1], 64);
    _tile_loadd(7, b[2], 64);
    _tile_zero(2);
    _tile_zero(6);
    _tile_zero(3);
    _tile_dpbsud(2, 0, 1);
    _tile_dpbsud(6, 0, 5);
    _tile_dpbsud(3, 0, 7);
    _tile_stored(2, c[0], 64);
    _tile_stored(6, c[1], 64);
    _tile_stored(3, c[2], 64);
    asm volatile("" ::: "memory");
    for (int j = 0; j < 3; ++j) fold(c[j], sz + j * sstride + g * 32, a, xsum, groups, g, rows, acc[j]);
  }
  for (int j = 0; j < 3; ++j)
    for (int m = 0; m < rows; ++m)
      _mm256_storeu_si256((__m256i*)(y + j * 16 + m * ldy), (__m256i)_mm512_cvtneps_pbh(acc[j][m]));
}

}  // namespace

// x (M, K) bf16 contiguous; qpack (N/16, K/4, 32) uint8; scales (N/16, K/64, 2, 16) bf16 -> (M, N) bf16.
torch::Tensor int4_mm(torch::Tensor x, torch::Tensor qpack, torch::Tensor scales) {
  TORCH_CHECK(speculant_amx::permitted(), "int4_mm needs AMX (the kernel refused the tile-data permission)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x must be (M, K) bf16 contiguous");
  TORCH_CHECK(qpack.dim() == 3 && qpack.scalar_type() == at::kByte && qpack.size(2) == 32 && qpack.is_contiguous(),
              "qpack must be (N/16, K/4, 32) uint8");
  const int64_t M = x.size(0), K = x.size(1), NB = qpack.size(0), N = NB * 16, groups = K / kGroup;
  TORCH_CHECK(K % kGroup == 0 && qpack.size(1) * 4 == K, "x has ", K, " columns, the weight ", qpack.size(1) * 4);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() && scales.numel() == NB * groups * 32,
              "scales must be (N/16, K/64, 2, 16) bf16");
  auto y = torch::empty({M, N}, x.options());
  auto xq = torch::empty({M, K}, x.options().dtype(at::kChar));
  auto a = torch::empty({M, groups}, x.options().dtype(at::kFloat));
  auto xsum = torch::empty({M, groups}, x.options().dtype(at::kInt));
  quantize_rows(x.data_ptr<at::BFloat16>(), M, K, xq.data_ptr<int8_t>(), a.data_ptr<float>(), xsum.data_ptr<int32_t>());
  const uint8_t* q = qpack.data_ptr<uint8_t>();
  const at::BFloat16* sz = scales.data_ptr<at::BFloat16>();
  const int8_t* xqp = xq.data_ptr<int8_t>();
  const float* ap = a.data_ptr<float>();
  const int32_t* sp = xsum.data_ptr<int32_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t qstride = (K / 4) * 32, sstride = groups * 32;
  at::parallel_for(0, NB, 12, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
      const int rows = (int)std::min<int64_t>(32, M - m0), r0 = std::min(rows, 16), r1 = rows - r0;
      TileConfig cfg;  // tile state is per thread: configure it here
      cfg.rows[0] = r0, cfg.colsb[0] = 64;  // A: rows 0-15 x 64 int8 activations
      cfg.rows[1] = 16, cfg.colsb[1] = 64;  // B: 16 quads of inputs x 16 channels x 4 bytes
      cfg.rows[2] = r0, cfg.colsb[2] = 64;  // C: rows 0-15 x 16 int32
      if (r1 > 0) {
        cfg.rows[3] = r1, cfg.colsb[3] = 64;  // A, rows 16-31
        cfg.rows[4] = r1, cfg.colsb[4] = 64;  // C, rows 16-31
      } else {  // block3's extra tiles
        cfg.rows[3] = r0, cfg.colsb[3] = 64;  // C
        cfg.rows[5] = 16, cfg.colsb[5] = 64;  // B
        cfg.rows[6] = r0, cfg.colsb[6] = 64;  // C
        cfg.rows[7] = 16, cfg.colsb[7] = 64;  // B
      }
      _tile_loadconfig(&cfg);
      int64_t nb = b0;
      if (r1 == 0)
        for (; nb + 3 <= b1; nb += 3)
          block3(q + nb * qstride, qstride, sz + nb * sstride, sstride, xqp + m0 * K, ap + m0 * groups,
                 sp + m0 * groups, rows, K, yp + m0 * N + nb * 16, N);
      for (; nb < b1; ++nb)
        block(q + nb * qstride, sz + nb * sstride, xqp + m0 * K, ap + m0 * groups, sp + m0 * groups, rows, K,
              yp + m0 * N + nb * 16, N);
      _tile_release();
    }
  });
  return y;
}

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed);  // attention.cpp
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor wp, torch::Tensor bias);  // bf16_amx.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "row-invariant attention of a few tokens over a bf16 KV cache (AVX-512)");
  m.def("bf16_mm", &bf16_mm, "bf16 matmul on AMX, up to 32 rows per pass over the weights");
  m.def("int4_mm", &int4_mm, "int4 weight x int8 activation matmul for few rows on AMX");
  m.def("amx_available", &speculant_amx::permitted, "can this process use AMX tiles (kernel permission granted)");
}
