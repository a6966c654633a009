/* Causal attention over a packed row of sequences, forward and backward, on the CPU for training
 * (backends/packing.py's varlen attention; the autograd wrapper is backends/cpu_fused.py).
 *
 * A packed micro-batch holds T tokens. Sequence i (of n) is the list of its len[i] tokens
 * gather[i, 0..len[i]) (rows of the packed q, k, v; with shared prompts a group's prompt tokens are
 * stored once and appear in every sequence of the group). Token t's output comes from exactly one
 * slot (i, j) of one sequence, slot_token[i, j] = t (-1 for a slot whose token is owned elsewhere):
 *
 *     out[t, hh, :] = softmax_s(scale * <q[t, hh, :], k[gather[i, s], g, :]>, s = 0..j) @ v[gather[i, s], g, :]
 *
 * for every query head hh, g = hh / (h / kv) its key/value head (grouped-query attention). The
 * forward also writes lse[t, hh], the log of the softmax's normaliser (in scaled-score units), and the
 * backward recomputes the probabilities from it (as flash-attention does):
 *
 *     p_s = exp(scale * <q, k_s> - lse),  dp_s = <dout, v_s>,  D = <dout, out>,  ds_s = p_s (dp_s - D)
 *     dq = scale * sum_s ds_s k_s,  dk_s += scale * ds_s q,  dv_s += p_s dout
 *
 * dk and dv sum over every sequence that reads a token (a shared prompt's gradient is the sum over
 * its group). Layouts: q, out, dout, dq (T, h, d); k, v, dk, dv (T, kv, d); lse (T, h); gather and
 * slot_token (n, L); len (n); all contiguous, float32 and int64. The caller validates the indices.
 *
 * Per (sequence, kv head) the keys (and, in the backward, the values) are copied transposed into a
 * (d, Lp) tile, so that one vector FMA per feature scores 16 slots (no horizontal sums); the weighted
 * sums over slots read the rows in place. The work is a few vector operations per (query, slot),
 * which at RL's short sequences is far below the per-item overhead of PyTorch's batched matmuls, and
 * nothing of size n x h x L x L is ever stored: the backward reads q, k, v, out and lse only.
 * Built with AVX-512F (d a multiple of 16); anything else returns -1 and the caller uses PyTorch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"

/* tile[t * lp + s] = rows[s][t] for s < len, 0 for len <= s < lp: the (d, lp) transpose of len rows. */
static void transpose_rows(float *tile, const float *const *rows, int64_t len, int64_t lp, int64_t d) {
  for (int64_t s = 0; s < len; s++)
    for (int64_t t = 0; t < d; t++) tile[t * lp + s] = rows[s][t];
  for (int64_t t = 0; t < d; t++) memset(tile + t * lp + len, 0, (size_t)(lp - len) * sizeof(float));
}

/* Up to MAXR query heads of one token are processed together: they share every load of the key and
 * value rows and tiles, and each keeps its own accumulators (short dependency chains). */
#define MAXR 4

/* dst[r * lp + s] = scale * <xs[r], column s of tile> for r < R, s < vis; lanes from vis to the next
 * multiple of 16 get `fill`. Four partial sums per query over the features. */
static inline __attribute__((always_inline)) void dot_columns(float *dst, const float *const *xs, int R, const float *tile, int64_t lp, int64_t d,
                        int64_t vis, float scale, float fill) {
  const __m512 vscale = _mm512_set1_ps(scale), vfill = _mm512_set1_ps(fill);
  for (int64_t s0 = 0; s0 < vis; s0 += 16) {
    __m512 a[MAXR][4];
    for (int r = 0; r < MAXR; r++)
      for (int u = 0; u < 4; u++) a[r][u] = _mm512_setzero_ps();
    for (int64_t t = 0; t < d; t += 4) /* d is a multiple of 16 */
      for (int u = 0; u < 4; u++) {
        const __m512 col = _mm512_loadu_ps(tile + (t + u) * lp + s0);
        for (int r = 0; r < MAXR; r++)
          if (r < R) a[r][u] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r][t + u]), col, a[r][u]);
      }
    const __mmask16 m = tail_mask(vis - s0);
    for (int r = 0; r < R; r++) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
      _mm512_storeu_ps(dst + r * lp + s0, _mm512_mask_mov_ps(vfill, m, _mm512_mul_ps(sum, vscale)));
    }
  }
}

/* dst[r][:] = scale[r] * sum_{s < vis} w[r * lp + s] * rows[s][:] for r < R, 64 features per pass. */
static inline __attribute__((always_inline)) void weighted_rows(float *const *dst, const float *w, int R, int64_t lp, const float *const *rows, int64_t vis,
                          int64_t d, const float *scale) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int count = (int)((d - c0 < 64 ? d - c0 : 64) / 16);
    __m512 acc[MAXR][4];
    for (int r = 0; r < MAXR; r++)
      for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < vis; s++) {
      __m512 row[4];
      for (int c = 0; c < 4; c++) row[c] = c < count ? _mm512_loadu_ps(rows[s] + c0 + 16 * c) : _mm512_setzero_ps();
      for (int r = 0; r < MAXR; r++)
        if (r < R) {
          const __m512 ws = _mm512_set1_ps(w[r * lp + s]);
          for (int c = 0; c < 4; c++)
            if (c < count) acc[r][c] = _mm512_fmadd_ps(ws, row[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < count; c++)
        _mm512_storeu_ps(dst[r] + c0 + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(scale[r])));
  }
}

/* acc[s, :] += scale * sum_r w[r * lp + s] * xs[r][:] for s < vis (acc rows of d floats). */
static inline __attribute__((always_inline)) void add_outer(float *acc, const float *w, int R, int64_t lp, const float *const *xs, int64_t vis, int64_t d,
                      float scale) {
  for (int64_t s = 0; s < vis; s++) {
    __m512 ws[MAXR];
    for (int r = 0; r < R; r++) ws[r] = _mm512_set1_ps(w[r * lp + s] * scale);
    float *row = acc + s * d;
    for (int64_t c = 0; c < d; c += 16) {
      __m512 x = _mm512_loadu_ps(row + c);
      for (int r = 0; r < R; r++) x = _mm512_fmadd_ps(ws[r], _mm512_loadu_ps(xs[r] + c), x);
      _mm512_storeu_ps(row + c, x);
    }
  }
}

static float dot(const float *a, const float *b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
  return _mm512_reduce_add_ps(acc);
}

/* sc[0, vis) (scaled scores, -inf past vis up to the block end) -> probabilities exp(sc - shift); returns their sum. */
static float exp_shifted(float *sc, int64_t vis, float shift) {
  const __m512 vshift = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < vis; s0 += 16) {
    const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sc + s0), vshift));
    _mm512_storeu_ps(sc + s0, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

static float max_of(const float *sc, int64_t vis) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t s0 = 0; s0 < vis; s0 += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + s0));
  return _mm512_reduce_max_ps(mx);
}

/* Scratch of one (sequence, kv head): two (d, lp) tiles, two (L, d) accumulators, row pointers, and
 * three score rows for each of MAXR query heads. */
typedef struct {
  float *kt, *vt, *dk, *dv, *sc, *p, *dp;
  const float **krow, **vrow;
  void *block;
} scratch;

static int scratch_alloc(scratch *w, int64_t L, int64_t d) {
  const int64_t lp = (L + 15) / 16 * 16;
  const size_t floats = (size_t)(2 * d * lp + 2 * L * d + 3 * MAXR * lp), ptrs = (size_t)(2 * L);
  const size_t bytes = (floats * sizeof(float) + ptrs * sizeof(float *) + 63) / 64 * 64;
  w->block = aligned_alloc(64, bytes);
  if (!w->block) return -1;
  float *f = (float *)w->block;
  w->kt = f; f += d * lp;
  w->vt = f; f += d * lp;
  w->dk = f; f += L * d;
  w->dv = f; f += L * d;
  w->sc = f; f += MAXR * lp;
  w->p = f; f += MAXR * lp;
  w->dp = f; f += MAXR * lp;
  w->krow = (const float **)f;
  w->vrow = w->krow + L;
  return 0;
}

static int unsupported(int64_t h, int64_t kv, int64_t d, int64_t L) {
  return d < 16 || d % 16 != 0 || kv < 1 || h % kv != 0 || L < 1;
}

/* Point w at the rows of kv head g of the sequence's li tokens (gi: their packed positions) and
 * transpose its keys (and, for the backward, its values) into the (d, lp) tiles. */
static void load_head(scratch *w, const float *k, const float *v, const int64_t *gi, int64_t li, int64_t g, int64_t sk,
                      int64_t sv, int64_t lp, int64_t d, int with_values) {
  for (int64_t s = 0; s < li; s++) {
    w->krow[s] = k + gi[s] * sk + g * d;
    w->vrow[s] = v + gi[s] * sv + g * d;
  }
  transpose_rows(w->kt, w->krow, li, lp, d);
  if (with_values) transpose_rows(w->vt, w->vrow, li, lp, d);
}

/* Forward of R consecutive query heads of one token (q, out: R rows of d; lse: R values) over the
 * slots [0, vis) of the current (sequence, kv head) in w. */
static inline __attribute__((always_inline)) void forward_heads(scratch *w, const float *q, float *out, float *lse,
                                                                const int R, int64_t lp, int64_t d, int64_t vis,
                                                                float scale) {
  const float *qs[MAXR];
  float *outs[MAXR], inv[MAXR];
  for (int r = 0; r < R; r++) {
    qs[r] = q + r * d;
    outs[r] = out + r * d;
  }
  dot_columns(w->sc, qs, R, w->kt, lp, d, vis, scale, -INFINITY);
  for (int r = 0; r < R; r++) {
    const float mx = max_of(w->sc + r * lp, vis);
    const float sum = exp_shifted(w->sc + r * lp, vis, mx);
    lse[r] = mx + logf(sum);
    inv[r] = 1.0f / sum;
  }
  weighted_rows(outs, w->sc, R, lp, w->vrow, vis, d, inv);
}

/* Backward of R consecutive query heads of one token: dq written, the (sequence, kv head)'s dk and dv
 * accumulators in w added to. */
static inline __attribute__((always_inline)) void backward_heads(scratch *w, const float *q, const float *out,
                                                                 const float *dout, const float *lse, float *dq,
                                                                 const int R, int64_t lp, int64_t d, int64_t vis,
                                                                 float scale) {
  const float *qs[MAXR], *dos[MAXR];
  float *dqs[MAXR], scales[MAXR];
  for (int r = 0; r < R; r++) {
    qs[r] = q + r * d;
    dos[r] = dout + r * d;
    dqs[r] = dq + r * d;
    scales[r] = scale;
  }
  dot_columns(w->p, qs, R, w->kt, lp, d, vis, scale, -INFINITY);
  dot_columns(w->dp, dos, R, w->vt, lp, d, vis, 1.0f, 0.0f);
  for (int r = 0; r < R; r++) {
    float *p = w->p + r * lp, *dp = w->dp + r * lp, *ds = w->sc + r * lp;
    exp_shifted(p, vis, lse[r]); /* probabilities, 0 past vis */
    const __m512 D = _mm512_set1_ps(dot(dos[r], out + r * d, d));
    for (int64_t s0 = 0; s0 < vis; s0 += 16)
      _mm512_storeu_ps(ds + s0, _mm512_mul_ps(_mm512_loadu_ps(p + s0), _mm512_sub_ps(_mm512_loadu_ps(dp + s0), D)));
  }
  weighted_rows(dqs, w->sc, R, lp, w->krow, vis, d, scales);
  add_outer(w->dk, w->sc, R, lp, qs, vis, d, scale);
  add_outer(w->dv, w->p, R, lp, dos, vis, d, 1.0f);
}
#endif

int rlfunc_packed_attention_forward(const float *q, const float *k, const float *v, const int64_t *gather,
                                    const int64_t *len, const int64_t *slot_token, float *out, float *lse,
                                    int64_t n, int64_t L, int64_t h, int64_t kv, int64_t d, int64_t sq, int64_t sk,
                                    int64_t sv, float scale) {
#if defined(__AVX512F__)
  if (unsupported(h, kv, d, L)) return -1;
  scratch w;
  if (scratch_alloc(&w, L, d)) return -2;
  const int64_t lp = (L + 15) / 16 * 16, rep = h / kv;
  for (int64_t i = 0; i < n; i++) {
    const int64_t *gi = gather + i * L, *owner = slot_token + i * L;
    const int64_t li = len[i];
    for (int64_t g = 0; g < kv; g++) {
      load_head(&w, k, v, gi, li, g, sk, sv, lp, d, 0);
      for (int64_t j = 0; j < li; j++) {
        const int64_t t = owner[j], vis = j + 1;
        if (t < 0) continue;
        for (int64_t r0 = 0; r0 < rep; r0 += MAXR) {
          const int64_t head = g * rep + r0, R = rep - r0 < MAXR ? rep - r0 : MAXR;
          switch (R) { /* a constant R for the compiler: the accumulators stay in registers */
            case 1: forward_heads(&w, q + t * sq + head * d, out + (t * h + head) * d, lse + t * h + head, 1, lp, d, vis, scale); break;
            case 2: forward_heads(&w, q + t * sq + head * d, out + (t * h + head) * d, lse + t * h + head, 2, lp, d, vis, scale); break;
            case 3: forward_heads(&w, q + t * sq + head * d, out + (t * h + head) * d, lse + t * h + head, 3, lp, d, vis, scale); break;
            default: forward_heads(&w, q + t * sq + head * d, out + (t * h + head) * d, lse + t * h + head, 4, lp, d, vis, scale);
          }
        }
      }
    }
  }
  free(w.block);
  return 0;
#else
  (void)q; (void)k; (void)v; (void)gather; (void)len; (void)slot_token; (void)out; (void)lse;
  (void)n; (void)L; (void)h; (void)kv; (void)d; (void)sq; (void)sk; (void)sv; (void)scale;
  return -1;
#endif
}

int rlfunc_packed_attention_backward(const float *q, const float *k, const float *v, const float *out,
                                     const float *lse, const float *dout, const int64_t *gather, const int64_t *len,
                                     const int64_t *slot_token, float *dq, float *dk, float *dv, int64_t T,
                                     int64_t n, int64_t L, int64_t h, int64_t kv, int64_t d, int64_t sq, int64_t sk,
                                     int64_t sv, int64_t sdq, int64_t sdk, int64_t sdv, float scale) {
#if defined(__AVX512F__)
  if (unsupported(h, kv, d, L)) return -1;
  scratch w;
  if (scratch_alloc(&w, L, d)) return -2;
  const int64_t lp = (L + 15) / 16 * 16, rep = h / kv;
  for (int64_t t = 0; t < T; t++) {
    memset(dq + t * sdq, 0, (size_t)(h * d) * sizeof(float));
    memset(dk + t * sdk, 0, (size_t)(kv * d) * sizeof(float));
    memset(dv + t * sdv, 0, (size_t)(kv * d) * sizeof(float));
  }
  for (int64_t i = 0; i < n; i++) {
    const int64_t *gi = gather + i * L, *owner = slot_token + i * L;
    const int64_t li = len[i];
    for (int64_t g = 0; g < kv; g++) {
      load_head(&w, k, v, gi, li, g, sk, sv, lp, d, 1);
      memset(w.dk, 0, (size_t)(li * d) * sizeof(float));
      memset(w.dv, 0, (size_t)(li * d) * sizeof(float));
      for (int64_t j = 0; j < li; j++) {
        const int64_t t = owner[j], vis = j + 1;
        if (t < 0) continue;
        for (int64_t r0 = 0; r0 < rep; r0 += MAXR) {
          const int64_t head = g * rep + r0, R = rep - r0 < MAXR ? rep - r0 : MAXR;
          const float *qh = q + t * sq + head * d, *oh = out + (t * h + head) * d, *doh = dout + (t * h + head) * d;
          const float *lh = lse + t * h + head;
          float *dqh = dq + t * sdq + head * d;
          switch (R) { /* a constant R for the compiler: the accumulators stay in registers */
            case 1: backward_heads(&w, qh, oh, doh, lh, dqh, 1, lp, d, vis, scale); break;
            case 2: backward_heads(&w, qh, oh, doh, lh, dqh, 2, lp, d, vis, scale); break;
            case 3: backward_heads(&w, qh, oh, doh, lh, dqh, 3, lp, d, vis, scale); break;
            default: backward_heads(&w, qh, oh, doh, lh, dqh, 4, lp, d, vis, scale);
          }
        }
      }
      for (int64_t s = 0; s < li; s++) {
        float *dkr = dk + gi[s] * sdk + g * d, *dvr = dv + gi[s] * sdv + g * d;
        for (int64_t c = 0; c < d; c += 16) {
          _mm512_storeu_ps(dkr + c, _mm512_add_ps(_mm512_loadu_ps(dkr + c), _mm512_loadu_ps(w.dk + s * d + c)));
          _mm512_storeu_ps(dvr + c, _mm512_add_ps(_mm512_loadu_ps(dvr + c), _mm512_loadu_ps(w.dv + s * d + c)));
        }
      }
    }
  }
  free(w.block);
  return 0;
#else
  (void)q; (void)k; (void)v; (void)out; (void)lse; (void)dout; (void)gather; (void)len; (void)slot_token;
  (void)dq; (void)dk; (void)dv; (void)T; (void)n; (void)L; (void)h; (void)kv; (void)d; (void)sq; (void)sk; (void)sv;
  (void)sdq; (void)sdk; (void)sdv; (void)scale;
  return -1;
#endif
}

/* RoPE on the first `heads` heads of each row of x (T rows, row stride sx; Hugging Face's
 * x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half])), written to out (row stride
 * so); cos and sin (T, d). Two products and a sum, each rounded, as PyTorch computes it (the C11 build
 * does not contract them into FMAs). */
int rlfunc_rope_forward(const float *x, const float *cos, const float *sin, float *out, int64_t T, int64_t heads,
                        int64_t d, int64_t sx, int64_t so) {
  if (d % 2) return -1;
  const int64_t half = d / 2;
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos + t * d, *sn = sin + t * d;
    for (int64_t j = 0; j < heads; j++) {
      const float *xi = x + t * sx + j * d;
      float *o = out + t * so + j * d;
      for (int64_t e = 0; e < half; e++) o[e] = xi[e] * c[e] + -xi[e + half] * sn[e];
      for (int64_t e = half; e < d; e++) o[e] = xi[e] * c[e] + xi[e - half] * sn[e];
    }
  }
  return 0;
}

/* The gradient through rlfunc_rope_forward: dx[e] = g[e] cos[e] + g[e + half] sin[e + half] for e < half,
 * g[e] cos[e] - g[e - half] sin[e - half] above (the transpose of the rotation). */
int rlfunc_rope_backward(const float *g, const float *cos, const float *sin, float *dx, int64_t T, int64_t heads,
                         int64_t d, int64_t sg, int64_t sdx) {
  if (d % 2) return -1;
  const int64_t half = d / 2;
  for (int64_t t = 0; t < T; t++) {
    const float *c = cos + t * d, *sn = sin + t * d;
    for (int64_t j = 0; j < heads; j++) {
      const float *gi = g + t * sg + j * d;
      float *o = dx + t * sdx + j * d;
      for (int64_t e = 0; e < half; e++) o[e] = gi[e] * c[e] + gi[e + half] * sn[e + half];
      for (int64_t e = half; e < d; e++) o[e] = gi[e] * c[e] - gi[e - half] * sn[e - half];
    }
  }
  return 0;
}

/* 1: this build has the kernels (AVX-512F). */
int rlfunc_packed_attention_support(void) {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
