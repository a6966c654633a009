/* Decode-step attention on the CPU for the native rollout engine (its kernel strategy, backends/cpu/decode.py).
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
 *   kt    keys transposed in blocks of 16 slots, (b, kv, T / 16, d, 16):
 *         kt[i*ksb + j*ksh + (l / 16)*ksblk + t*16 + l % 16], each block's (d, 16) contiguous
 *   v     values, (b, kv, T, d): v[i*vsb + j*vsh + l*vsl + t], t contiguous
 *   bias  (b, >= L): bias[i*bsb + l], 0 or -inf (prompt padding); slot L-1 (the new token) is never -inf
 *   out   (b, kv, g, d) contiguous
 *   scratch  g * Lp floats, Lp = L rounded up to a multiple of 16
 *   rows  optional (b) int64: working row i reads (and the step writes) cache row rows[i] of the caches
 *         and bias, so the rollout drops finished rows by index without copying caches; NULL means
 *         rows[i] = i. Every entry must lie in [0, cache_rows) (checked: -2 and nothing written if not).
 *
 * The keys are stored transposed so that the scores of 16 slots come from one vector FMA per feature
 * (no horizontal sums), in blocks of 16 slots so that the first L slots of a (row, kv head) are
 * ceil(L / 16) contiguous (d, 16) tiles (a plain (d, T) transpose spreads them over d cache lines at
 * stride T), and the softmax and the weighted sum of values run on whole vectors: one pass
 * over K and one over V per (row, kv head), which is what bounds this step (the cache is read once).
 * PyTorch's batched matmuls spend most of their time on per-item overhead at these sizes
 * (2 x 64 by 64 x L per item).
 *
 * rlfunc_decode_step does a float32 model's whole step from the fused qkv projection on: RoPE on the
 * new queries and keys, the new key and value written to the caches, then the attention above.
 *
 * Built with AVX-512F only (d a multiple of 16; bf16 caches also need AVX-512BW/VL);
 * rlfunc_decode_attention returns -1 for anything this build cannot run, and the caller falls back
 * to PyTorch.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"

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

/* One (row, kv head): s is scratch of g * Lp floats, Lp = L rounded up to 16. Up to 4 query heads of
 * the group at a time share every load of the cache; each query's scores are 4 partial sums over the
 * features and its weighted values 4 x 16 features, so no dependency chain is longer than d / 4 or L
 * FMAs. Masked loads only (masked stores are slow on some x86 cores); slots past L are set to -inf
 * before the softmax. */
static void one_head(const float *q, const void *kt, const void *v, const float *bias, float *out, float *s,
                     int64_t g, int64_t d, int64_t L, int64_t ksblk, int64_t vsl, float scale, int bf16) {
  const int64_t Lp = (L + 15) / 16 * 16;
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff()), vscale = _mm512_set1_ps(scale);
  for (int64_t g0 = 0; g0 < g; g0 += 4) {
    const int ng = (int)(g - g0 < 4 ? g - g0 : 4);
    const float *qg = q + g0 * d;
    float *sg = s + g0 * Lp;
    /* raw scores, one block of 16 slots at a time */
    for (int64_t blk = 0; blk < Lp / 16; blk++) {
      const __mmask16 m = tail_mask(L - blk * 16);
      __m512 a[4][4];
      for (int u = 0; u < 4; u++)
        for (int r = 0; r < 4; r++) a[u][r] = _mm512_setzero_ps();
      for (int64_t t = 0; t < d; t += 4)
        for (int r = 0; r < 4; r++) {
          const __m512 k = load_cache(kt, blk * ksblk + (t + r) * 16, m, bf16);
          for (int u = 0; u < 4; u++)
            if (u < ng) a[u][r] = _mm512_fmadd_ps(_mm512_set1_ps(qg[u * d + t + r]), k, a[u][r]);
        }
      for (int u = 0; u < 4; u++)
        if (u < ng)
          _mm512_storeu_ps(sg + u * Lp + blk * 16,
                           _mm512_add_ps(_mm512_add_ps(a[u][0], a[u][1]), _mm512_add_ps(a[u][2], a[u][3])));
    }
    /* per query: scale, bias (-inf past L), max, exp, sum */
    __m512 vinv[4];
    for (int u = 0; u < ng; u++) {
      float *su = sg + u * Lp;
      __m512 mx = neg_inf;
      for (int64_t c = 0; c < Lp; c += 16) {
        const __mmask16 m = tail_mask(L - c);
        const __m512 x = _mm512_mask_mov_ps(neg_inf, m, _mm512_fmadd_ps(_mm512_loadu_ps(su + c), vscale,
                                                                        _mm512_maskz_loadu_ps(m, bias + c)));
        _mm512_storeu_ps(su + c, x);
        mx = _mm512_max_ps(mx, x);
      }
      const __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < Lp; c += 16) {
        const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(su + c), vmax));
        _mm512_storeu_ps(su + c, e);
        sum = _mm512_add_ps(sum, e);
      }
      vinv[u] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    }
    /* out[u, :] = sum_l p[u, l] * v[l, :] / sum, 64 features per pass, the ng queries together */
    for (int64_t t0 = 0; t0 < d; t0 += 64) {
      const int count = (int)((d - t0 < 64 ? d - t0 : 64) / 16); /* d is a multiple of 16 */
      __m512 acc[4][4];
      for (int u = 0; u < 4; u++)
        for (int c = 0; c < 4; c++) acc[u][c] = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; l++) {
        __m512 vl[4];
        for (int c = 0; c < 4; c++)
          vl[c] = c < count ? load_cache(v, l * vsl + t0 + 16 * c, (__mmask16)0xFFFF, bf16) : _mm512_setzero_ps();
        for (int u = 0; u < 4; u++)
          if (u < ng) {
            const __m512 w = _mm512_set1_ps(sg[u * Lp + l]);
            for (int c = 0; c < 4; c++)
              if (c < count) acc[u][c] = _mm512_fmadd_ps(w, vl[c], acc[u][c]);
          }
      }
      for (int u = 0; u < ng; u++)
        for (int c = 0; c < count; c++)
          _mm512_storeu_ps(out + (g0 + u) * d + t0 + 16 * c, _mm512_mul_ps(acc[u][c], vinv[u]));
    }
  }
}

/* Prefetch into L2 the first L slots of a (row, kv head)'s keys (blocks of 16 slots, each (d, 16)
 * contiguous) and values (L rows of d): issued for the head PREFETCH_AHEAD places ahead of the one being
 * computed, so its cache lines stream in while this head's FMAs run (each head's K and V start new
 * streams that the hardware prefetcher only picks up after a few misses). Prefetching changes no result. */
#define PREFETCH_AHEAD 2
static inline void prefetch_head(const char *k, const char *v, int64_t L, int64_t d, int64_t ksblk, int64_t vsl,
                                 int64_t esize) {
  const int64_t block_bytes = d * 16 * esize, row_bytes = d * esize;
  for (int64_t blk = 0; blk * 16 < L; blk++)
    for (int64_t off = 0; off < block_bytes; off += 64) _mm_prefetch(k + blk * ksblk * esize + off, _MM_HINT_T1);
  for (int64_t l = 0; l < L; l++)
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(v + l * vsl * esize + off, _MM_HINT_T1);
}

/* x * cos + rotate_half(x) * sin for one head: rotate_half(x) = (-x[half:], x[:half]), and sin_signed is
 * (-sin[:half], sin[half:]), so out[t] = x[t] * cos[t] + x[(t + half) % d] * sin_signed[t]. Two products
 * and a sum, each rounded (the C11 build does not contract them into an FMA), as PyTorch computes it. */
static void rope_head(float *out, const float *x, const float *cos, const float *sin_signed, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < half; t++) out[t] = x[t] * cos[t] + x[t + half] * sin_signed[t];
  for (int64_t t = half; t < d; t++) out[t] = x[t] * cos[t] + x[t - half] * sin_signed[t];
}
#endif

/* 1 if every rows[i] lies in [0, cache_rows) (or rows is NULL and b <= cache_rows), else 0. */
static int rows_in_range(const int64_t *rows, int64_t b, int64_t cache_rows) {
  if (!rows) return b <= cache_rows;
  for (int64_t i = 0; i < b; i++)
    if (rows[i] < 0 || rows[i] >= cache_rows) return 0;
  return 1;
}

/* cache_bf16: 0 for float32 caches, 1 for bfloat16. Returns 0, -1 (nothing written) for what this
 * build cannot run, or -2 (nothing written) for a row index outside the caches. */
int rlfunc_decode_attention(const float *q, const void *kt, const void *v, const float *bias, float *out,
                            float *scratch, int64_t b, int64_t kv, int64_t g, int64_t d, int64_t L,
                            int64_t qsb, int64_t ksb, int64_t ksh, int64_t ksblk, int64_t vsb, int64_t vsh,
                            int64_t vsl, int64_t bsb, float scale, int cache_bf16, const int64_t *rows,
                            int64_t cache_rows) {
#if defined(__AVX512F__)
  if (d % 16 != 0 || L < 1 || (cache_bf16 && !RLFUNC_BF16_CACHE)) return -1;
  if (!rows_in_range(rows, b, cache_rows)) return -2;
  const int64_t esize = cache_bf16 ? 2 : 4;
  for (int64_t i = 0; i < b; i++) {
    const int64_t r = rows ? rows[i] : i;
    for (int64_t j = 0; j < kv; j++) {
      const int64_t ahead = i * kv + j + PREFETCH_AHEAD, ai = ahead / kv, aj = ahead % kv;
      if (ai < b) {
        const int64_t ar = rows ? rows[ai] : ai;
        prefetch_head((const char *)kt + (ar * ksb + aj * ksh) * esize, (const char *)v + (ar * vsb + aj * vsh) * esize,
                      L, d, ksblk, vsl, esize);
      }
      one_head(q + i * qsb + j * g * d, (const char *)kt + (r * ksb + j * ksh) * esize,
               (const char *)v + (r * vsb + j * vsh) * esize, bias + r * bsb, out + (i * kv + j) * g * d, scratch,
               g, d, L, ksblk, vsl, scale, cache_bf16);
    }
  }
  return 0;
#else
  (void)q; (void)kt; (void)v; (void)bias; (void)out; (void)scratch; (void)b; (void)kv; (void)g; (void)d; (void)L;
  (void)qsb; (void)ksb; (void)ksh; (void)ksblk; (void)vsb; (void)vsh; (void)vsl; (void)bsb; (void)scale;
  (void)cache_bf16; (void)rows; (void)cache_rows; (void)rows_in_range;
  return -1;
#endif
}


/* One decode step of a float32 model's attention, from the fused qkv projection on: RoPE on the new
 * queries and keys, the new key and value written to cache slot `slot`, and attention over slots
 * [0, slot]. qkv (b, kv * g + 2 kv, d) contiguous (query heads, then key heads, then value heads);
 * cos and sin_signed (P, d) contiguous, rows indexed by positions (b) (the caller checks the range);
 * caches, bias and rows as in rlfunc_decode_attention (float32); out (b, kv, g, d) contiguous, which
 * also holds the rotated queries on the way. Returns 0, -1 for what this build cannot run, or -2 for a
 * row index outside the caches. */
int rlfunc_decode_step(const float *qkv, const float *cos, const float *sin_signed, const int64_t *positions,
                       float *kt, float *v, const float *bias, float *out, float *scratch, int64_t b, int64_t kv,
                       int64_t g, int64_t d, int64_t slot, int64_t ksb, int64_t ksh, int64_t ksblk, int64_t vsb,
                       int64_t vsh, int64_t vsl, int64_t bsb, float scale, const int64_t *rows,
                       int64_t cache_rows) {
#if defined(__AVX512F__)
  if (d % 16 != 0 || d > 1024 || slot < 0) return -1;
  if (!rows_in_range(rows, b, cache_rows)) return -2;
  const int64_t h = kv * g, width = (h + 2 * kv) * d;
  float krot[1024];
  for (int64_t i = 0; i < b; i++) {
    const int64_t r = rows ? rows[i] : i;
    const float *x = qkv + i * width, *c = cos + positions[i] * d, *sn = sin_signed + positions[i] * d;
    for (int64_t j = 0; j < kv; j++) {
      float *kh = kt + r * ksb + j * ksh, *vh = v + r * vsb + j * vsh;
      const int64_t ahead = i * kv + j + PREFETCH_AHEAD, ai = ahead / kv, aj = ahead % kv;
      if (ai < b) {
        const int64_t ar = rows ? rows[ai] : ai;
        prefetch_head((const char *)(kt + ar * ksb + aj * ksh), (const char *)(v + ar * vsb + aj * vsh), slot + 1, d,
                      ksblk, vsl, 4);
      }
      float *kcol = kh + slot / 16 * ksblk + slot % 16;
      rope_head(krot, x + (h + j) * d, c, sn, d);
      for (int64_t t = 0; t < d; t++) kcol[t * 16] = krot[t];
      memcpy(vh + slot * vsl, x + (h + kv + j) * d, (size_t)d * sizeof(float));
      float *o = out + (i * kv + j) * g * d;
      for (int64_t gi = 0; gi < g; gi++) rope_head(o + gi * d, x + (j * g + gi) * d, c, sn, d);
      one_head(o, kh, vh, bias + r * bsb, o, scratch, g, d, slot + 1, ksblk, vsl, scale, 0);
    }
  }
  return 0;
#else
  (void)qkv; (void)cos; (void)sin_signed; (void)positions; (void)kt; (void)v; (void)bias; (void)out; (void)scratch;
  (void)b; (void)kv; (void)g; (void)d; (void)slot; (void)ksb; (void)ksh; (void)ksblk; (void)vsb; (void)vsh; (void)vsl;
  (void)bsb; (void)scale; (void)rows; (void)cache_rows;
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
