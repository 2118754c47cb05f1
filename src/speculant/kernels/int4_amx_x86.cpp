// The AMX code path of int4_gemm (int4_x86.cpp): the same packed weights, the same int8
// activations and the same fold as the other paths, so the same bits; AMX only computes the
// integer dot products, 16 rows x 16 channels x up to 64 inputs per instruction.
//
// Why a second path on AMX CPUs: one or a few rows are bound by reading the weights, and there the
// AVX-512 VNNI path is the faster (it unpacks each 64-byte vector of codes straight into
// registers). From about 8 rows on, its arithmetic grows with the rows while a tile multiply
// costs the same for 1 to 16 rows, so int4_gemm hands passes of kAmxMinRows rows or more to this
// path (measurements: docs/design-notes.md#int4-on-amx). Since both give the same bits, a row's
// result still does not depend on how many rows share its pass.
//
// Per group g of GS inputs (GS = 64 for int4 groups of 64, 32 for Q4_K, Q5_K and GGUF's 32-input
// blocks, 16 for Q6_K) and block of 16 channels, the codes of pack_int4_x86's layout (GS / 8
// octets of 64 bytes, high bits OR-ed in from qh as int4_x86.cpp does) become one B tile: octet p's
// low nibbles are the tile's quad of inputs 2p, its high nibbles quad 2p + 1 (16 channels x 4
// codes each). The A tile holds 16 rows of the group's int8 activations (GS bytes each);
// TDPBSUD gives the exact int32 dot products d (rows x channels), and
//     acc[m, n] = fma(o, a * sum(xq), fma(d * s, a, acc[m, n]))
// is folded in fp32 in group order, operation for operation as int4_x86.cpp does, with the same
// scales (scales16: bf16 pairs, fp32 pairs or k-quant products). A block's tiles are unpacked
// once per call and reused by every further 16 rows (prompt prefill).

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <memory>

#include "amx_tiles.h"
#include "int4_problem.h"

namespace speculant_int4 {

// Everything up to gemm_amx uses AVX-512 and AMX; only AMX CPUs call it (int4_gemm checks amx_int8_ready).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,amx-tile,amx-int8")

namespace {

constexpr int64_t kTileRows = 16;  // rows of activations per A tile

// One group's GS / 8 octets of codes (octets octet .. octet + GS/8 - 1 of the block whose codes
// are at qb and high bits at hb) -> the B tile (GS / 4 rows of 64 bytes).
template <int GS, int HB>
inline void unpack_group(const uint8_t* qb, const uint8_t* hb, int64_t octet, uint8_t* b) {
#pragma GCC unroll 8
  for (int p = 0; p < GS / 8; ++p) {
    _mm_prefetch((const char*)(qb + 64 * (octet + p) + 4096), _MM_HINT_T0);
    __m512i lo, hi;
    octet_codes512<HB>(qb, hb, octet + p, lo, hi);
    _mm512_store_si512((void*)(b + 128 * p), lo);
    _mm512_store_si512((void*)(b + 128 * p + 64), hi);
  }
}

// acc[r] = fma(o, ax, fma(d * s, a, acc[r])) for R rows m0 .. m0+R-1 of group g of block nb, from
// the int32 tile c (16 rows x 16 channels).
template <int R>
inline void fold(const Problem& P, int64_t nb, int64_t m0, int64_t g, const int32_t* c, __m512* acc) {
  __m512 s, o;
  scales16(P, nb, g, s, o);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const int64_t mg = (m0 + r) * P.G + g;
    acc[r] = fold16(acc[r], _mm512_load_si512((const void*)(c + 16 * r)), s, o, P.a[mg], P.ax[mg]);
  }
}

// Rows m0 .. m0+R-1 (R <= 16; the tile's other rows are padding) of J consecutive channel blocks
// from nb on. Their B tiles are unpacked into tiles (J x G tiles of GS * 16 bytes) when m0 == 0 and
// reused after; the J blocks' tile multiplies are issued together so that the AMX unit, the
// unpacking and the folds overlap. Tiles: 0 = A, 1 .. J = B, 4 .. 3 + J = C.
template <int GS, int HB, int J, int R>
void blocks(const Problem& P, int64_t nb, int64_t m0, uint8_t* tiles) {
  constexpr int64_t kTileBytes = GS * 16;
  const int64_t qstride = (P.K / 8) * 64, hstride = HB ? (P.K / (HB == 2 ? 16 : 32)) * 64 : 0;
  alignas(64) int32_t c[J][16 * 16];
  __m512 acc[J][R];
  for (int j = 0; j < J; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < P.G; ++g) {
    if (m0 == 0)
      for (int j = 0; j < J; ++j)
        unpack_group<GS, HB>(P.q + (nb + j) * qstride, HB ? P.qh + (nb + j) * hstride : nullptr, g * (GS / 8),
                             tiles + (j * P.G + g) * kTileBytes);
    asm volatile("" ::: "memory");  // GCC's tile intrinsics are asm without memory operands
    _tile_loadd(0, P.xq + m0 * P.K + g * GS, P.K);
    _tile_loadd(1, tiles + g * kTileBytes, 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 1);
    if (J > 1) {
      _tile_loadd(2, tiles + (P.G + g) * kTileBytes, 64);
      _tile_zero(5);
      _tile_dpbsud(5, 0, 2);
    }
    if (J > 2) {
      _tile_loadd(3, tiles + (2 * P.G + g) * kTileBytes, 64);
      _tile_zero(6);
      _tile_dpbsud(6, 0, 3);
    }
    _tile_stored(4, c[0], 64);
    if (J > 1) _tile_stored(5, c[J > 1 ? 1 : 0], 64);
    if (J > 2) _tile_stored(6, c[J > 2 ? 2 : 0], 64);
    asm volatile("" ::: "memory");
    for (int j = 0; j < J; ++j) fold<R>(P, nb + j, m0, g, c[j], acc[j]);
  }
  const int64_t rows = std::min<int64_t>(R, P.M - m0);
  for (int j = 0; j < J; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      alignas(64) float out[16];
      _mm512_store_ps(out, acc[j][r]);
      store_row(P, m0 + r, (nb + j) * 16, out, 16);
    }
}

template <int GS, int HB, int J>
void blocks_all_rows(const Problem& P, int64_t nb, uint8_t* tiles) {
  for (int64_t m0 = 0; m0 < P.M; m0 += kTileRows) {
    const int64_t rows = std::min<int64_t>(kTileRows, P.M - m0);
    if (rows > 12) blocks<GS, HB, J, 16>(P, nb, m0, tiles);
    else if (rows > 8) blocks<GS, HB, J, 12>(P, nb, m0, tiles);
    else if (rows > 4) blocks<GS, HB, J, 8>(P, nb, m0, tiles);
    else blocks<GS, HB, J, 4>(P, nb, m0, tiles);
  }
}

template <int GS, int HB>
void gemm_amx_gs(const Problem& P) {
  at::parallel_for(0, P.M > 0 ? P.N / 16 : 0, 1, [&](int64_t b0, int64_t b1) {
    speculant_amx::TileConfig cfg;  // tile state is per thread: configure it here
    cfg.rows[0] = kTileRows, cfg.colsb[0] = GS;  // A: 16 rows x GS int8 activations
    for (int t = 1; t <= 3; ++t) cfg.rows[t] = GS / 4, cfg.colsb[t] = 64;     // B: GS/4 quads of inputs x 16 channels x 4 codes
    for (int t = 4; t <= 6; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;  // C: 16 rows x 16 int32
    _tile_loadconfig(&cfg);
    std::unique_ptr<uint8_t, decltype(&std::free)> tiles(
        static_cast<uint8_t*>(std::aligned_alloc(64, 3 * P.G * GS * 16)), &std::free);
    int64_t nb = b0;
    for (; nb + 3 <= b1; nb += 3) blocks_all_rows<GS, HB, 3>(P, nb, tiles.get());
    for (; nb < b1; ++nb) blocks_all_rows<GS, HB, 1>(P, nb, tiles.get());
    _tile_release();
  });
}

}  // namespace

bool gemm_amx_takes(int64_t gsize, int hbits) {
  return (gsize == 64 && hbits == 0) || (gsize == 32 && hbits <= 1) || (gsize == 16 && hbits == 2);
}

void gemm_amx(const Problem& P) {
  if (P.gsize == 64) gemm_amx_gs<64, 0>(P);
  else if (P.gsize == 32 && P.hbits == 1) gemm_amx_gs<32, 1>(P);
  else if (P.gsize == 32) gemm_amx_gs<32, 0>(P);
  else gemm_amx_gs<16, 2>(P);
}

#pragma GCC pop_options

// Compiled for any x86-64 CPU: it is what decides whether the code above may run.
bool amx_int8_ready() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx = ((d >> 24) & 1) && ((d >> 25) & 1);  // AMX-TILE, AMX-INT8
    __builtin_cpu_init();
    return amx && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && speculant_amx::permitted();
  }();
  return ok;
}

}  // namespace speculant_int4
