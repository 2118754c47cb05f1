// The inner loop of the AMX bf16 matmuls (bf16_amx.cpp on packed bf16 weights, int4_prefill_amx.cpp
// on int4 weights widened to bf16): two channel blocks of B tiles in VNNI order times up to 32 rows
// of activations, accumulated in fp32 over all of K in the tiles.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include "amx_tiles.h"

namespace speculant_amx {

// Tiles 0-1: A (rows 0-15, 16-31), 2-3: B of the two blocks, 4-7: C. Tile state is per thread.
inline void configure_bf16_pair(int r0, int r1) {
  TileConfig cfg;
  cfg.rows[0] = r0, cfg.colsb[0] = 64;  // A: rows 0-15 x 32 bf16
  cfg.rows[2] = 16, cfg.colsb[2] = 64;  // B, block 0: 16 input pairs x 16 channels x 2
  cfg.rows[3] = 16, cfg.colsb[3] = 64;  // B, block 1
  cfg.rows[4] = r0, cfg.colsb[4] = 64;  // C: rows 0-15 x 16 fp32, block 0
  cfg.rows[5] = r0, cfg.colsb[5] = 64;  // C: rows 0-15, block 1
  if (r1 > 0) {
    cfg.rows[1] = r1, cfg.colsb[1] = 64;  // A: rows 16-31
    cfg.rows[6] = r1, cfg.colsb[6] = 64;  // C: rows 16-31, block 0
    cfg.rows[7] = r1, cfg.colsb[7] = 64;  // C: rows 16-31, block 1
  }
  _tile_loadconfig(&cfg);
}

// Two channel blocks (w0, w1: K/32 tiles of 1 KB each) times rows r0 + r1 <= 32 of x.
inline void bf16_pair(const at::BFloat16* x, int64_t K, int r0, int r1, const at::BFloat16* w0, const at::BFloat16* w1,
          float* c /* (32, 32) */) {
  const int64_t steps = K / 32, lda = K * 2;
  _tile_zero(4);
  _tile_zero(5);
  if (r1 > 0) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const char* b0 = (const char*)(w0 + s * 512);
    const char* b1 = (const char*)(w1 + s * 512);
    for (int l = 0; l < 1024; l += 64) {  // the tiles 4 steps ahead, both streams
      _mm_prefetch(b0 + 4096 + l, _MM_HINT_T0);
      _mm_prefetch(b1 + 4096 + l, _MM_HINT_T0);
    }
    asm volatile("" ::: "memory");  // GCC's tile intrinsics are asm without memory operands
    _tile_loadd(2, b0, 64);
    _tile_loadd(3, b1, 64);
    _tile_loadd(0, x + s * 32, lda);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if (r1 > 0) {
      _tile_loadd(1, x + 16 * K + s * 32, lda);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c, 128);
  _tile_stored(5, c + 16, 128);
  if (r1 > 0) {
    _tile_stored(6, c + 16 * 32, 128);
    _tile_stored(7, c + 16 * 32 + 16, 128);
  }
  asm volatile("" ::: "memory");
}

}  // namespace speculant_amx
