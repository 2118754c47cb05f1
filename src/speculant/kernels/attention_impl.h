// The body of attention_x86.cpp's kernel, included once per code path inside the namespace of one
// of vec16.h's vector types V. Written once, so every code path performs the same operations in
// the same order and gives the same bits.

// One token's G query heads (sharing one kv head) over the m keys idx[0..m): out (G, D) bf16.
// Each key and value row is widened from bf16 once for all G heads. Per head and key the score is
// the same fixed-order dot product whatever G is; the weighted sum runs over keys in index order.
// cap > 0: each score soft-capped, s = cap * tanh(s / cap), before the softmax (Gemma 2).
template <int G>
inline void attend_token(const uint16_t* q, const uint16_t* keys, const uint16_t* values, const int32_t* idx,
                         int64_t m, int64_t D, float scale, float cap, const Scratch& w, uint16_t* out) {
  const int64_t DV = D / 16;
  for (int j = 0; j < G; ++j)
    for (int64_t d = 0; d < DV; ++d) V::store(w.q + j * D + 16 * d, V::load_bf16(q + j * D + 16 * d));
  // scores: s[j][u] = (q_j . k_u) * scale
  float mx[G];
  for (int j = 0; j < G; ++j) mx[j] = -INFINITY;
  for (int64_t u0 = 0; u0 < m; u0 += 16) {
    const int64_t count = m - u0 < 16 ? m - u0 : 16;
    for (int64_t u = 0; u < count; ++u) {
      const uint16_t* krow = keys + (int64_t)idx[u0 + u] * D;
      V acc[G];
      const V k0 = V::load_bf16(krow);
      for (int j = 0; j < G; ++j) acc[j] = V::mul(V::load(w.q + j * D), k0);
      for (int64_t d = 1; d < DV; ++d) {
        const V kd = V::load_bf16(krow + 16 * d);
        for (int j = 0; j < G; ++j) acc[j] = V::fma(V::load(w.q + j * D + 16 * d), kd, acc[j]);
      }
      for (int j = 0; j < G; ++j) V::store(w.part + (j * 16 + u) * 16, acc[j]);
    }
    for (int j = 0; j < G; ++j) {
      for (int64_t u = count; u < 16; ++u) V::store(w.part + (j * 16 + u) * 16, V::zero());
      V sums = V::mul(V::sum16(w.part + j * 256), V::set1(scale));
      if (cap > 0.f) sums = V::mul(tanh_v(V::div(sums, V::set1(cap))), V::set1(cap));
      float* sj = w.s + j * w.stride + u0;
      V::store(sj, sums);
      for (int64_t u = 0; u < count; ++u) mx[j] = sj[u] > mx[j] ? sj[u] : mx[j];
    }
  }
  // softmax weights (unnormalised) and their sums
  const int64_t padded = ((m + 15) / 16) * 16;
  float inv[G];
  for (int j = 0; j < G; ++j) {
    float* sj = w.s + j * w.stride;
    const V vmx = V::set1(mx[j]);
    V vsum = V::zero();
    for (int64_t u = 0; u < padded; u += 16) {
      V::store(sj + u, exp_neg(V::sub(V::load(sj + u), vmx)));
      for (int64_t k = m > u ? m : u; k < u + 16; ++k) sj[k] = 0.f;  // padding lanes weigh nothing
      vsum = V::add(vsum, V::load(sj + u));
    }
    inv[j] = 1.f / V::sum(vsum);
  }
  // out_j = sum_u s[j][u] v_u / sum, 16 V::kWide dimensions at a time, G x V::kWide accumulators
  // (docs/design-notes.md#avx2-attention-blocking). Each output element sums the same terms in key
  // order whatever the blocking: the same bits.
  constexpr int W = V::kWide;
  for (int64_t c = 0; c < D; c += 16 * W) {
    const int64_t nv = D - c < 16 * W ? (D - c) / 16 : W;
    V o[G][W];
    for (int j = 0; j < G; ++j)
      for (int t = 0; t < W; ++t) o[j][t] = V::zero();
    for (int64_t u = 0; u < m; ++u) {
      const uint16_t* vrow = values + (int64_t)idx[u] * D + c;
      V vv[W];
      for (int t = 0; t < nv; ++t) vv[t] = V::load_bf16(vrow + 16 * t);
      for (int j = 0; j < G; ++j) {
        const V p = V::set1(w.s[j * w.stride + u]);
        for (int t = 0; t < nv; ++t) o[j][t] = V::fma(p, vv[t], o[j][t]);
      }
    }
    for (int j = 0; j < G; ++j) {
      const V vinv = V::set1(inv[j]);
      for (int t = 0; t < nv; ++t) V::store_bf16(out + j * D + c + 16 * t, V::mul(o[j][t], vinv));
    }
  }
}

using TokenFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int32_t*, int64_t, int64_t, float,
                         float, const Scratch&, uint16_t*);

// attend_token for G = 1 .. 8 query heads per kv head (fns[G - 1]).
inline const TokenFn* token_fns() {
  static const TokenFn fns[8] = {&attend_token<1>, &attend_token<2>, &attend_token<3>, &attend_token<4>,
                                 &attend_token<5>, &attend_token<6>, &attend_token<7>, &attend_token<8>};
  return fns;
}
