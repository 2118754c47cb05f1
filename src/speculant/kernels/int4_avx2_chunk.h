// The AVX2 chunk of int4_x86.cpp, one body for two code paths: included once inside the
// "avx2,fma" target region with INT4_AVX2_VNNI 0 (VPMADDUBSW + VPMADDWD) and once inside the
// "avx2,fma,avxvnni" region with INT4_AVX2_VNNI 1 (VPDPBUSD), with INT4_AVX2_CHUNK naming the
// function. Both compute the same exact integer dot products, so both give the same bits.
//
// Rows m0 .. m0+R-1 of channel block nb; O octets per group. One row sweeps the codes once,
// both halves (16 channels) of each 64-byte octet at a time, so that each broadcast activation
// serves 16 channels; more rows sweep them once per half of 8 channels (the accumulators of two
// halves would not fit in the 16 registers). Each channel's integer sums and its fold are the
// same operations in the same order either way: the same bits.
// HB: high bits per code above the low nibble (0; 1 for Q5_K, O = 4; 2 for Q6_K, O = 2), OR-ed in
// from qh as bit 4 (bits 4-5).
template <int R, int O, int HB>
void INT4_AVX2_CHUNK(const Problem& P, int64_t nb, int64_t m0) {
  constexpr int S = R == 1 ? 2 : 1;  // halves per sweep
  const uint8_t* qb = P.q + nb * (P.K / 8) * 64;
  const uint8_t* hb = HB ? P.qh + nb * (P.K / (HB == 2 ? 16 : 32)) * 64 : nullptr;
  const __m256i nib = _mm256_set1_epi8(0x0F);
#if INT4_AVX2_VNNI
  constexpr int C = R <= 2 ? 2 : 1;  // few rows: two accumulators each, to hide VPDPBUSD's latency
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int h0 = 0; h0 < 2; h0 += S) {
    __m256 acc[S][R];
    for (int s = 0; s < S; ++s)
      for (int r = 0; r < R; ++r) acc[s][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < P.G; ++g) {
      const uint8_t* qg = qb + g * O * 64 + 32 * h0;
      const int8_t* xg = P.xq + m0 * P.K + g * (8 * O);
#if INT4_AVX2_VNNI
      __m256i d[S][R][C];
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) d[s][r][c] = _mm256_setzero_si256();
#else
      __m256i d32[S][R], d16[S][R];
      for (int s = 0; s < S; ++s)
        for (int r = 0; r < R; ++r) d32[s][r] = d16[s][r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 16
      for (int p = 0; p < O; ++p) {
        if (h0 == 0) _mm_prefetch((const char*)(qg + 64 * p + kPrefetch), _MM_HINT_T0);
        __m256i lo[S], hi[S];
        for (int s = 0; s < S; ++s) {
          const __m256i w = _mm256_loadu_si256((const __m256i*)(qg + 64 * p + 32 * s));
          lo[s] = _mm256_and_si256(w, nib);
          hi[s] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
          if constexpr (HB > 0) {  // octet p's high bits
            const int64_t octet = g * O + p;
            const __m256i h = _mm256_loadu_si256((const __m256i*)(high_at<HB>(hb, octet) + 32 * (h0 + s)));
            lo[s] = _mm256_or_si256(lo[s], high_bits256<HB>(h, high_from<HB>(octet)));
            hi[s] = _mm256_or_si256(hi[s], high_bits256<HB>(h, high_from<HB>(octet) + HB));
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xg + r * P.K + 8 * p;
          const __m256i xl = _mm256_set1_epi32(load4(x)), xh = _mm256_set1_epi32(load4(x + 4));
          for (int s = 0; s < S; ++s) {
#if INT4_AVX2_VNNI
            d[s][r][0] = _mm256_dpbusd_avx_epi32(d[s][r][0], lo[s], xl);
            d[s][r][C - 1] = _mm256_dpbusd_avx_epi32(d[s][r][C - 1], hi[s], xh);
#else
            // u8 codes x s8 activations: |pair sums| <= 2 * 15 * 127, four octets' sums fit int16
            // (Q5_K codes: <= 2 * 31 * 127, two octets' sums; Q6_K: <= 2 * 63 * 127, one octet's)
            const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo[s], xl), _mm256_maddubs_epi16(hi[s], xh));
            d16[s][r] = _mm256_add_epi16(d16[s][r], t);
#endif
          }
        }
#if !INT4_AVX2_VNNI
        if (HB == 2 || (HB == 1 && (p & 1) == 1) || (p & 3) == 3 || p == O - 1)
          for (int s = 0; s < S; ++s)
            for (int r = 0; r < R; ++r) {
              d32[s][r] = _mm256_add_epi32(d32[s][r], _mm256_madd_epi16(d16[s][r], ones));
              d16[s][r] = _mm256_setzero_si256();
            }
#endif
      }
      for (int s = 0; s < S; ++s) {
#if INT4_AVX2_VNNI
        __m256i d32[R];
        for (int r = 0; r < R; ++r) d32[r] = C == 2 ? _mm256_add_epi32(d[s][r][0], d[s][r][C - 1]) : d[s][r][0];
        fold8<R>(P, nb, m0, g, h0 + s, d32, acc[s]);
#else
        fold8<R>(P, nb, m0, g, h0 + s, d32[s], acc[s]);
#endif
      }
    }
    for (int s = 0; s < S; ++s) store8<R>(P, m0, nb * 16 + 8 * (h0 + s), acc[s]);
  }
}

#undef INT4_AVX2_CHUNK
#undef INT4_AVX2_VNNI
