// The AVX2 chunk of int4_x86.cpp, one body for two code paths: included once inside the
// "avx2,fma" target region with INT4_AVX2_VNNI 0 (VPMADDUBSW + VPMADDWD) and once inside the
// "avx2,fma,avxvnni" region with INT4_AVX2_VNNI 1 (VPDPBUSD), with INT4_AVX2_CHUNK naming the
// function. Both compute the same exact integer dot products, so both give the same bits.
//
// Rows m0 .. m0+R-1 of channel block nb, 8 channels (half h) at a time; O octets per group.
template <int R, int O>
void INT4_AVX2_CHUNK(const Problem& P, int64_t nb, int64_t m0) {
  const uint8_t* qb = P.q + nb * (P.K / 8) * 64;
  const uint16_t* sb = P.sz + nb * P.G * 32;
  const __m256i nib = _mm256_set1_epi8(0x0F);
#if INT4_AVX2_VNNI
  constexpr int C = R <= 2 ? 2 : 1;  // few rows: two accumulators each, to hide VPDPBUSD's latency
#else
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < P.G; ++g) {
      const uint8_t* qg = qb + g * O * 64 + 32 * h;
      const int8_t* xg = P.xq + m0 * P.K + g * (8 * O);
#if INT4_AVX2_VNNI
      __m256i d[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) d[r][c] = _mm256_setzero_si256();
#else
      __m256i d32[R], d16[R];
      for (int r = 0; r < R; ++r) d32[r] = d16[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 16
      for (int p = 0; p < O; ++p) {
        if (h == 0) _mm_prefetch((const char*)(qg + 64 * p + kPrefetch), _MM_HINT_T0);
        const __m256i w = _mm256_loadu_si256((const __m256i*)(qg + 64 * p));
        const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = xg + r * P.K + 8 * p;
#if INT4_AVX2_VNNI
          d[r][0] = _mm256_dpbusd_avx_epi32(d[r][0], lo, _mm256_set1_epi32(load4(x)));
          d[r][C - 1] = _mm256_dpbusd_avx_epi32(d[r][C - 1], hi, _mm256_set1_epi32(load4(x + 4)));
#else
          // u8 codes x s8 activations: |pair sums| <= 2 * 15 * 127, four octets' sums fit int16
          const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(x))),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(x + 4))));
          d16[r] = _mm256_add_epi16(d16[r], t);
#endif
        }
#if !INT4_AVX2_VNNI
        if ((p & 3) == 3 || p == O - 1)
          for (int r = 0; r < R; ++r) {
            d32[r] = _mm256_add_epi32(d32[r], _mm256_madd_epi16(d16[r], ones));
            d16[r] = _mm256_setzero_si256();
          }
#endif
      }
#if INT4_AVX2_VNNI
      __m256i d32[R];
      for (int r = 0; r < R; ++r) d32[r] = C == 2 ? _mm256_add_epi32(d[r][0], d[r][C - 1]) : d[r][0];
#endif
      fold8<R>(P, m0, g, sb + g * 32 + 8 * h, d32, acc);
    }
    store8<R>(P, m0, nb * 16 + 8 * h, acc);
  }
}

#undef INT4_AVX2_CHUNK
#undef INT4_AVX2_VNNI
