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

/* dst[s] = scale * <x, column s of tile> for s < vis; lanes from vis to the next multiple of 16 get `fill`. */
static void dot_columns(float *dst, const float *x, const float *tile, int64_t lp, int64_t d, int64_t vis,
                        float scale, float fill) {
  const __m512 vscale = _mm512_set1_ps(scale), vfill = _mm512_set1_ps(fill);
  for (int64_t s0 = 0; s0 < vis; s0 += 16) {
    const float *col = tile + s0;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    for (int64_t t = 0; t < d; t += 4) { /* d is a multiple of 16 */
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(x[t]), _mm512_loadu_ps(col + t * lp), a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(x[t + 1]), _mm512_loadu_ps(col + (t + 1) * lp), a1);
      a2 = _mm512_fmadd_ps(_mm512_set1_ps(x[t + 2]), _mm512_loadu_ps(col + (t + 2) * lp), a2);
      a3 = _mm512_fmadd_ps(_mm512_set1_ps(x[t + 3]), _mm512_loadu_ps(col + (t + 3) * lp), a3);
    }
    const __m512 sum = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)), vscale);
    _mm512_storeu_ps(dst + s0, _mm512_mask_mov_ps(vfill, tail_mask(vis - s0), sum));
  }
}

/* dst[:] = scale * sum_{s < vis} w[s] * rows[s][:], d features (a multiple of 16). */
static void weighted_rows(float *dst, const float *w, const float *const *rows, int64_t vis, int64_t d, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t c = 0; c < d; c += 16) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + 1 < vis; s += 2) {
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[s]), _mm512_loadu_ps(rows[s] + c), a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(w[s + 1]), _mm512_loadu_ps(rows[s + 1] + c), a1);
    }
    if (s < vis) a0 = _mm512_fmadd_ps(_mm512_set1_ps(w[s]), _mm512_loadu_ps(rows[s] + c), a0);
    _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_add_ps(a0, a1), vscale));
  }
}

/* acc[s, :] += w[s] * x for s < vis (acc rows of d floats). */
static void add_outer(float *acc, const float *w, const float *x, int64_t vis, int64_t d) {
  for (int64_t s = 0; s < vis; s++) {
    const __m512 ws = _mm512_set1_ps(w[s]);
    float *row = acc + s * d;
    for (int64_t c = 0; c < d; c += 16)
      _mm512_storeu_ps(row + c, _mm512_fmadd_ps(ws, _mm512_loadu_ps(x + c), _mm512_loadu_ps(row + c)));
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

/* Scratch of one (sequence, kv head): two (d, lp) tiles, two (L, d) accumulators, row pointers, three score rows. */
typedef struct {
  float *kt, *vt, *dk, *dv, *sc, *p, *dp;
  const float **krow, **vrow;
  void *block;
} scratch;

static int scratch_alloc(scratch *w, int64_t L, int64_t d) {
  const int64_t lp = (L + 15) / 16 * 16;
  const size_t floats = (size_t)(2 * d * lp + 2 * L * d + 3 * lp), ptrs = (size_t)(2 * L);
  const size_t bytes = (floats * sizeof(float) + ptrs * sizeof(float *) + 63) / 64 * 64;
  w->block = aligned_alloc(64, bytes);
  if (!w->block) return -1;
  float *f = (float *)w->block;
  w->kt = f; f += d * lp;
  w->vt = f; f += d * lp;
  w->dk = f; f += L * d;
  w->dv = f; f += L * d;
  w->sc = f; f += lp;
  w->p = f; f += lp;
  w->dp = f; f += lp;
  w->krow = (const float **)f;
  w->vrow = w->krow + L;
  return 0;
}

static int unsupported(int64_t h, int64_t kv, int64_t d, int64_t L) {
  return d < 16 || d % 16 != 0 || kv < 1 || h % kv != 0 || L < 1;
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
      for (int64_t s = 0; s < li; s++) {
        w.krow[s] = k + gi[s] * sk + g * d;
        w.vrow[s] = v + gi[s] * sv + g * d;
      }
      transpose_rows(w.kt, w.krow, li, lp, d);
      for (int64_t j = 0; j < li; j++) {
        const int64_t t = owner[j];
        if (t < 0) continue;
        for (int64_t r = 0; r < rep; r++) {
          const int64_t row = t * h + g * rep + r;
          dot_columns(w.sc, q + t * sq + (g * rep + r) * d, w.kt, lp, d, j + 1, scale, -INFINITY);
          const float mx = max_of(w.sc, j + 1);
          const float sum = exp_shifted(w.sc, j + 1, mx);
          lse[row] = mx + logf(sum);
          weighted_rows(out + row * d, w.sc, w.vrow, j + 1, d, 1.0f / sum);
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
      for (int64_t s = 0; s < li; s++) {
        w.krow[s] = k + gi[s] * sk + g * d;
        w.vrow[s] = v + gi[s] * sv + g * d;
      }
      transpose_rows(w.kt, w.krow, li, lp, d);
      transpose_rows(w.vt, w.vrow, li, lp, d);
      memset(w.dk, 0, (size_t)(li * d) * sizeof(float));
      memset(w.dv, 0, (size_t)(li * d) * sizeof(float));
      for (int64_t j = 0; j < li; j++) {
        const int64_t t = owner[j];
        if (t < 0) continue;
        const int64_t vis = j + 1;
        for (int64_t r = 0; r < rep; r++) {
          const int64_t row = t * h + g * rep + r;
          const float *qr = q + t * sq + (g * rep + r) * d, *dor = dout + row * d;
          dot_columns(w.p, qr, w.kt, lp, d, vis, scale, -INFINITY);
          exp_shifted(w.p, vis, lse[row]); /* probabilities, 0 past vis */
          dot_columns(w.dp, dor, w.vt, lp, d, vis, 1.0f, 0.0f);
          const __m512 D = _mm512_set1_ps(dot(dor, out + row * d, d));
          for (int64_t s0 = 0; s0 < vis; s0 += 16) /* ds, into sc */
            _mm512_storeu_ps(w.sc + s0, _mm512_mul_ps(_mm512_loadu_ps(w.p + s0),
                                                       _mm512_sub_ps(_mm512_loadu_ps(w.dp + s0), D)));
          weighted_rows(dq + t * sdq + (g * rep + r) * d, w.sc, w.krow, vis, d, scale);
          for (int64_t s0 = 0; s0 < vis; s0 += 16)
            _mm512_storeu_ps(w.sc + s0, _mm512_mul_ps(_mm512_loadu_ps(w.sc + s0), _mm512_set1_ps(scale)));
          add_outer(w.dk, w.sc, qr, vis, d);
          add_outer(w.dv, w.p, dor, vis, d);
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
