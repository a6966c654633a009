/* Vector helpers shared by the CPU kernels (AVX-512F). Header-only: each kernel library is one .c file. */
#ifndef RLFUNC_SIMD_H
#define RLFUNC_SIMD_H
#if defined(__AVX512F__)
#include <immintrin.h>
#include <stdint.h>

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), n = round(x / ln 2), |r| <= ln2 / 2,
 * p the degree-6 Taylor polynomial (relative error < 2e-7 on that range); x < -87 (including -inf,
 * a masked slot) gives exactly 0. */
static inline __m512 exp_nonpos(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

static inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? (__mmask16)0xFFFF : remaining <= 0 ? (__mmask16)0 : (__mmask16)((1u << remaining) - 1u);
}

#endif /* __AVX512F__ */
#endif /* RLFUNC_SIMD_H */
