/* Decode-step attention on the CPU for the native rollout engine (backends/rollout_native.py).
 *
 * One new query token per row attends to the first L slots of that row's KV cache, for every
 * (row, kv head) and the g query heads that share the kv head (GQA):
 *
 *     out[i, j, gi, :] = softmax_l(scale * <q[i, j, gi, :], K[i, j, l, :]> + bias[i, l]) @ V[i, j, :, :]
 *
 * Layouts (element strides in the arguments); q, bias, out and the math are float32, the caches float32
 * or, with cache_bf16, bfloat16 (a bf16 model's keys and values are bf16 numbers: storing them so is
 * exact and halves the bytes this step reads):
 *   q     (b, kv, g, d): row stride qsb, then contiguous (kv, g, d)
 *   kt    keys transposed, (b, kv, d, T): kt[i*ksb + j*ksh + t*kst + l], l contiguous
 *   v     values, (b, kv, T, d): v[i*vsb + j*vsh + l*vsl + t], t contiguous
 *   bias  (b, >= L): bias[i*bsb + l], 0 or -inf (prompt padding); slot L-1 (the new token) is never -inf
 *   out   (b, kv, g, d) contiguous
 *   scratch  g * Lp floats, Lp = L rounded up to a multiple of 16
 *
 * The keys are stored transposed so that the scores of 16 slots come from one vector FMA per feature
 * (no horizontal sums), and the softmax and the weighted sum of values run on whole vectors: one pass
 * over K and one over V per (row, kv head), which is what bounds this step (the cache is read once).
 * PyTorch's batched matmuls spend most of their time on per-item overhead at these sizes
 * (2 x 64 by 64 x L per item).
 *
 * Built with AVX-512F only (d a multiple of 16; bf16 caches also need AVX-512BW/VL);
 * rlfunc_decode_attention returns -1 for anything this build cannot run, and the caller falls back
 * to PyTorch.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

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

#if defined(__AVX512BW__) && defined(__AVX512VL__)
#define RLFUNC_BF16_CACHE 1
#else
#define RLFUNC_BF16_CACHE 0
#endif

/* 16 cache entries from element idx as float32 (lanes outside m are 0); bf16 is the top half of a float32. */
static inline __m512 load_cache(const void *base, int64_t idx, __mmask16 m, int bf16) {
#if RLFUNC_BF16_CACHE
  if (bf16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)base + idx);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#else
  (void)bf16;
#endif
  return _mm512_maskz_loadu_ps(m, (const float *)base + idx);
}

static inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? (__mmask16)0xFFFF : remaining <= 0 ? (__mmask16)0 : (__mmask16)((1u << remaining) - 1u);
}

/* Up to 64 values in 4 registers: acc[c] += w * cache[idx + 16c, +16) (lanes outside m[c]: 0) for c < count. */
static inline __attribute__((always_inline)) void fma4(__m512 acc[4], __m512 w, const void *cache, int64_t idx,
                                                       const __mmask16 m[4], int count, int bf16) {
  for (int c = 0; c < 4; c++)
    if (c < count) acc[c] = _mm512_fmadd_ps(w, load_cache(cache, idx + 16 * c, m[c], bf16), acc[c]);
}

static inline __attribute__((always_inline)) void store4(float *dst, const __m512 acc[4], __m512 scale, int count) {
  for (int c = 0; c < 4; c++)
    if (c < count) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc[c], scale));
}

/* One (row, kv head): s is scratch of g * Lp floats, Lp = L rounded up to 16. Masked loads only (masked
 * stores are slow on some x86 cores); slots past L are set to -inf before the softmax. */
static void one_head(const float *q, const void *kt, const void *v, const float *bias, float *out, float *s,
                     int64_t g, int64_t d, int64_t L, int64_t kst, int64_t vsl, float scale, int bf16) {
  const __mmask16 full[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  const int64_t Lp = (L + 15) / 16 * 16;
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  for (int64_t gi = 0; gi < g; gi++) {
    const float *qg = q + gi * d;
    float *sg = s + gi * Lp;
    /* scores of up to 64 slots at a time: acc[c] += q[t] * kt[t, l0 + 16c, +16) */
    for (int64_t l0 = 0; l0 < L; l0 += 64) {
      const int64_t n = L - l0 < 64 ? L - l0 : 64;
      const __mmask16 m[4] = {tail_mask(n), tail_mask(n - 16), tail_mask(n - 32), tail_mask(n - 48)};
      const int count = (int)((n + 15) / 16);
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t t = 0; t < d; t++) fma4(acc, _mm512_set1_ps(qg[t]), kt, t * kst + l0, m, count, bf16);
      store4(sg + l0, acc, _mm512_set1_ps(1.0f), count);
    }
    /* scale, bias (-inf past L), max */
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 mx = neg_inf;
    for (int64_t c = 0; c < Lp; c += 16) {
      const __mmask16 m = tail_mask(L - c);
      const __m512 x = _mm512_mask_mov_ps(neg_inf, m, _mm512_fmadd_ps(_mm512_loadu_ps(sg + c), vscale,
                                                                      _mm512_maskz_loadu_ps(m, bias + c)));
      _mm512_storeu_ps(sg + c, x);
      mx = _mm512_max_ps(mx, x);
    }
    const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    /* exp and sum */
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < Lp; c += 16) {
      const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sg + c), vmax));
      _mm512_storeu_ps(sg + c, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 vinv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    /* out[gi, :] = sum_l p[l] * v[l, :] / sum, 64 features per pass */
    for (int64_t t0 = 0; t0 < d; t0 += 64) {
      const int count = (int)((d - t0 < 64 ? d - t0 : 64) / 16); /* d is a multiple of 16 */
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t l = 0; l < L; l++) fma4(acc, _mm512_set1_ps(sg[l]), v, l * vsl + t0, full, count, bf16);
      store4(out + gi * d + t0, acc, vinv, count);
    }
  }
}
#endif

/* cache_bf16: 0 for float32 caches, 1 for bfloat16. Returns 0, or -1 (nothing written) for what this
 * build cannot run. */
int rlfunc_decode_attention(const float *q, const void *kt, const void *v, const float *bias, float *out,
                            float *scratch, int64_t b, int64_t kv, int64_t g, int64_t d, int64_t L,
                            int64_t qsb, int64_t ksb, int64_t ksh, int64_t kst, int64_t vsb, int64_t vsh,
                            int64_t vsl, int64_t bsb, float scale, int cache_bf16) {
#if defined(__AVX512F__)
  if (d % 16 != 0 || L < 1 || (cache_bf16 && !RLFUNC_BF16_CACHE)) return -1;
  const int64_t esize = cache_bf16 ? 2 : 4;
  for (int64_t i = 0; i < b; i++)
    for (int64_t j = 0; j < kv; j++)
      one_head(q + i * qsb + j * g * d, (const char *)kt + (i * ksb + j * ksh) * esize,
               (const char *)v + (i * vsb + j * vsh) * esize, bias + i * bsb, out + (i * kv + j) * g * d, scratch,
               g, d, L, kst, vsl, scale, cache_bf16);
  return 0;
#else
  (void)q; (void)kt; (void)v; (void)bias; (void)out; (void)scratch; (void)b; (void)kv; (void)g; (void)d; (void)L;
  (void)qsb; (void)ksb; (void)ksh; (void)kst; (void)vsb; (void)vsh; (void)vsl; (void)bsb; (void)scale;
  (void)cache_bf16;
  return -1;
#endif
}

/* Bit 0: this build has the kernel (AVX-512F); bit 1: it also reads bfloat16 caches. */
int rlfunc_decode_attention_support(void) {
#if defined(__AVX512F__)
  return 1 | (RLFUNC_BF16_CACHE << 1);
#else
  return 0;
#endif
}
