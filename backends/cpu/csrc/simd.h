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

/* bfloat16 <-> float32 for 16 lanes (a bf16 number is the top half of a float32). Rounding is to
 * nearest, ties to even, as PyTorch rounds; a NaN stays a (quiet) NaN. Masked 16-bit loads and stores
 * need AVX-512BW/VL: RLFUNC_BF16 says whether this build has them. */
#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define RLFUNC_BF16 1
static inline __m512 bf16_load(const uint16_t *p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m256i bf16_round(__m512 x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x); /* one instruction, the same rounding */
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

static inline void bf16_store(uint16_t *p, __m512 x, __mmask16 m) {
  const __m256i h = bf16_round(x);
  if (m == 0xFFFF) _mm256_storeu_si256((__m256i *)p, h);
  else _mm256_mask_storeu_epi16(p, m, h);
}

/* x rounded to the nearest bfloat16, kept as float32 (what a bf16 tensor op's output holds) */
static inline __m512 bf16_nearest(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_round(x)), 16));
}
#else
#define RLFUNC_BF16 0
#endif

#endif /* __AVX512F__ */
#endif /* RLFUNC_SIMD_H */
