// The body of attention_x86.cpp's kernel, included once per code path inside a namespace that
// defines `V`: 16 fp32 lanes with load_bf16, zero, set1, add, sub, mul, fma, max, sum (the fixed
// pairwise order lanes i + i+8, then i + i+4, i + i+2, i + i+1), exp2i (2^i of integral lanes),
// round (to nearest even), store, store_bf16. Written once, so every code path performs the same
// operations in the same order and gives the same bits.

// exp(x) for x <= 0: 2^(x log2 e) = 2^i * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error ~1e-7), 2^i exactly.
inline V exp_neg(V x) {
  x = V::max(x, V::set1(-87.f));
  const V t = V::mul(x, V::set1(1.44269504088896341f));
  const V i = V::round(t);
  const V f = V::sub(t, i);
  V p = V::set1(1.5403530393381609954e-4f);
  p = V::fma(p, f, V::set1(1.3333558146428443423e-3f));
  p = V::fma(p, f, V::set1(9.6181291076284771619e-3f));
  p = V::fma(p, f, V::set1(5.5504108664821579953e-2f));
  p = V::fma(p, f, V::set1(2.4022650695910071233e-1f));
  p = V::fma(p, f, V::set1(6.9314718055994530942e-1f));
  p = V::fma(p, f, V::set1(1.f));
  return V::mul(p, V::exp2i(i));
}

// One query row (D values) over the m keys idx[0..m) of one kv head: out (D) bf16.
// s: scratch of at least m + 16 floats.
inline void attend_row(const uint16_t* qrow, const uint16_t* keys, const uint16_t* values, const int32_t* idx,
                       int64_t m, int64_t D, float scale, float* s, uint16_t* out) {
  const int64_t DV = D / 16;
  V qv[16];
  for (int64_t d = 0; d < DV; ++d) qv[d] = V::load_bf16(qrow + 16 * d);
  float mx = -INFINITY;
  for (int64_t u = 0; u < m; ++u) {
    const uint16_t* krow = keys + (int64_t)idx[u] * D;
    V acc = V::mul(qv[0], V::load_bf16(krow));
    for (int64_t d = 1; d < DV; ++d) acc = V::fma(qv[d], V::load_bf16(krow + 16 * d), acc);
    s[u] = V::sum(acc) * scale;
    mx = s[u] > mx ? s[u] : mx;
  }
  const int64_t padded = ((m + 15) / 16) * 16;
  for (int64_t u = m; u < padded; ++u) s[u] = -INFINITY;
  const V vmx = V::set1(mx);
  V vsum = V::zero();
  for (int64_t u = 0; u < padded; u += 16) {
    V::store(s + u, exp_neg(V::sub(V::load(s + u), vmx)));
    for (int64_t k = m > u ? m : u; k < u + 16; ++k) s[k] = 0.f;  // padding lanes weigh nothing
    vsum = V::add(vsum, V::load(s + u));
  }
  const float inv = 1.f / V::sum(vsum);
  V o[16];
  for (int64_t d = 0; d < DV; ++d) o[d] = V::zero();
  for (int64_t u = 0; u < m; ++u) {
    const V p = V::set1(s[u]);
    const uint16_t* vrow = values + (int64_t)idx[u] * D;
    for (int64_t d = 0; d < DV; ++d) o[d] = V::fma(p, V::load_bf16(vrow + 16 * d), o[d]);
  }
  const V vinv = V::set1(inv);
  for (int64_t d = 0; d < DV; ++d) V::store_bf16(out + 16 * d, V::mul(o[d], vinv));
}
