// The body of layer_x86.cpp's element-wise kernels, included once per code path inside the
// namespace of one of vec16.h's vector types V (so every path gives the same bits).

// out (H) = x * (1 / sqrt(mean(x^2) + eps)) * w, rounded once to bf16. H a multiple of 16.
inline void rms_norm_row(const uint16_t* x, const uint16_t* w, int64_t H, float eps, uint16_t* out) {
  V acc = V::zero();
  for (int64_t h = 0; h < H; h += 16) {
    const V v = V::load_bf16(x + h);
    acc = V::fma(v, v, acc);
  }
  const V r = V::set1(1.f / std::sqrt(V::sum(acc) / (float)H + eps));
  for (int64_t h = 0; h < H; h += 16)
    V::store_bf16(out + h, V::mul(V::mul(V::load_bf16(x + h), r), V::load_bf16(w + h)));
}

// out (F) = silu(gate) * up for gu = [gate (F), up (F)], silu(g) = g * e^min(g,0) / (e^min(g,0) + e^-max(g,0)).
inline void silu_mul_row(const uint16_t* gu, int64_t F, uint16_t* out) {
  const V zero = V::zero();
  for (int64_t f = 0; f < F; f += 16) {
    const V g = V::load_bf16(gu + f);
    const V a = exp_neg(V::min(g, zero)), b = exp_neg(V::min(V::sub(zero, g), zero));
    const V sig = V::div(a, V::add(a, b));
    V::store_bf16(out + f, V::mul(V::mul(g, sig), V::load_bf16(gu + F + f)));
  }
}

// Rotate-half RoPE of one head (D values), in fp32, rounded once to bf16:
// out[d] = x[d] cos[d] - x[d + D/2] sin[d], out[d + D/2] = x[d + D/2] cos[d] + x[d] sin[d]. D even;
// lanes past the last multiple of 16 are done one by one (the same IEEE operations).
inline void rope_head(const uint16_t* x, const float* cos, const float* sin, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  int64_t d = 0;
  for (; d + 16 <= half; d += 16) {
    const V a = V::load_bf16(x + d), b = V::load_bf16(x + half + d);
    const V c = V::load(cos + d), s = V::load(sin + d);
    V::store_bf16(out + d, V::sub(V::mul(a, c), V::mul(b, s)));
    V::store_bf16(out + half + d, V::add(V::mul(b, c), V::mul(a, s)));
  }
  for (; d < half; ++d) {
    const float a = bf16_bits_to_float(x[d]), b = bf16_bits_to_float(x[half + d]);
    out[d] = float_to_bf16_bits(a * cos[d] - b * sin[d]);
    out[half + d] = float_to_bf16_bits(b * cos[d] + a * sin[d]);
  }
}
