// Functions of vec16.h's V shared by its code paths (included inside each path's namespace).

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

// tanh(x) = (1 - e) / (1 + e) with e = exp(-2|x|), its sign restored as max(min(t, x), -t)
// (|tanh x| <= |x|); absolute error ~1e-7. Gemma 2's soft cap of attention scores.
inline V tanh_v(V x) {
  const V a = V::max(x, V::sub(V::zero(), x));
  const V e = exp_neg(V::mul(a, V::set1(-2.f)));
  const V one = V::set1(1.f);
  const V t = V::div(V::sub(one, e), V::add(one, e));
  return V::max(V::min(t, x), V::sub(V::zero(), t));
}
