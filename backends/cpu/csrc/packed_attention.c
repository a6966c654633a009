/* Causal attention over a packed row of sequences, forward and backward, on the CPU for training
 * (the "cpu-kernel" backend of backends/training/packed_attention.py; the autograd wrapper is
 * backends/cpu/fused_modules.py).
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
 * Per (sequence, kv head) the work is five small matrix products over that head's "query rows" (an
 * owned query token and one of the h / kv query heads that share the kv head), in slot order, so a
 * row's visible slots (vis = its slot + 1) never decrease from one row to the next:
 *
 *     forward:   S = scale Q K^T (causal), P = softmax(S), out = P V
 *     backward:  P = exp(S - lse), dP = dout V^T, dS = P (dP - D), dq = scale dS K,
 *                dk = scale dS^T Q, dv = P^T dout
 *
 * The keys (and, in the backward, the values) are copied transposed into a (d, Lp) tile (16 x 16
 * register transposes), so that the score products run 8 rows against 16 slots per vector, one tile
 * load and 8 broadcast FMAs per feature; the row products (out, dq) run 4 rows x 64 features, one
 * key / value row load per slot for 16 FMAs; the slot products (dk, dv) 4 slots x 64 features, one
 * query / dout row load per query row for 16 FMAs. Score matrices are (rows, Lp), zero past each row's
 * visible slots, and nothing of size n x h x L x L is stored: the backward reads q, k, v, out and lse
 * only. At RL's short sequences PyTorch's batched matmuls would spend most of their time on
 * per-item overhead.
 * Built with AVX-512F (d a multiple of 16); anything else returns -1 and the caller uses PyTorch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"

/* The 16 x 16 transpose of r[0..16) in place: r[c][i] = old r[i][c]. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) { /* per 128-bit lane k: r[i + c] holds column 4k + c of rows i..i+3 */
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; c++) {
    t[c] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_f32x4(r[c], r[c + 4], 0xDD);
    t[c + 8] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_f32x4(r[c + 8], r[c + 12], 0xDD);
  }
  for (int c = 0; c < 8; c++) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xDD);
  }
}

/* tile[t * lp + s] = rows[s][t] for s < len, 0 for len <= s < lp: the (d, lp) transpose of len rows,
 * 16 x 16 blocks at a time. */
static void transpose_rows(float *tile, const float *const *rows, int64_t len, int64_t lp, int64_t d) {
  for (int64_t s0 = 0; s0 < lp; s0 += 16) {
    const int64_t n = len - s0 < 16 ? len - s0 : 16;
    for (int64_t t0 = 0; t0 < d; t0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; i++) r[i] = i < n ? _mm512_loadu_ps(rows[s0 + i] + t0) : _mm512_setzero_ps();
      transpose16(r);
      for (int c = 0; c < 16; c++) _mm512_storeu_ps(tile + (t0 + c) * lp + s0, r[c]);
    }
  }
}

/* Scratch of one sequence: the (d, lp) key and value tiles, the (L) key / value row pointers, and
 * per query row (at most L * rep): its input / output row pointers, visible slots, the forward's
 * 1 / normaliser, and two (rows, lp) score matrices. first[s] (L + 1 entries) is the first row whose
 * slot is at least s. */
typedef struct {
  float *kt, *vt, *pm, *dsm, *inv;
  const float **krow, **vrow, **qr, **dor, **orow;
  float **dqr, **outr;
  int64_t *vis, *first;
  void *block;
} scratch;

static int scratch_alloc(scratch *w, int64_t L, int64_t rep, int64_t d) {
  const int64_t lp = (L + 15) / 16 * 16, rows = L * rep;
  const int64_t inv_floats = (rows + 1) / 2 * 2; /* an even float count keeps the pointers after it aligned */
  const size_t floats = (size_t)(2 * d * lp + 2 * rows * lp + inv_floats);
  const size_t ptrs = (size_t)(2 * L + 5 * rows), ints = (size_t)(rows + L + 1);
  w->block = aligned_alloc(64, ((floats * sizeof(float) + ptrs * sizeof(void *) + ints * sizeof(int64_t)) + 63) / 64 * 64);
  if (!w->block) return -1;
  float *f = (float *)w->block;
  w->kt = f; f += d * lp;
  w->vt = f; f += d * lp;
  w->pm = f; f += rows * lp;
  w->dsm = f; f += rows * lp;
  w->inv = f; f += inv_floats;
  void **p = (void **)f;
  w->krow = (const float **)p; p += L;
  w->vrow = (const float **)p; p += L;
  w->qr = (const float **)p; p += rows;
  w->dor = (const float **)p; p += rows;
  w->orow = (const float **)p; p += rows;
  w->dqr = (float **)p; p += rows;
  w->outr = (float **)p; p += rows;
  w->vis = (int64_t *)p;
  w->first = w->vis + rows;
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

/* m[r, s] = scale * <xs[r], column s of tile> for the R rows (R <= 8) and the slots of every 16-slot
 * chunk below the last row's vis; lanes at or past a row's own vis get `fill`. */
static inline __attribute__((always_inline)) void score_rows(float *m, const float *const *xs, const int64_t *vis,
                                                             const int R, const float *tile, int64_t lp, int64_t d,
                                                             float scale, float fill) {
  const __m512 vscale = _mm512_set1_ps(scale), vfill = _mm512_set1_ps(fill);
  for (int64_t c0 = 0; c0 < vis[R - 1]; c0 += 16) {
    __m512 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < d; t++) {
      const __m512 col = _mm512_loadu_ps(tile + t * lp + c0);
      for (int r = 0; r < 8; r++)
        if (r < R) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r][t]), col, a[r]);
    }
    for (int r = 0; r < R; r++)
      _mm512_storeu_ps(m + r * lp + c0, _mm512_mask_mov_ps(vfill, tail_mask(vis[r] - c0), _mm512_mul_ps(a[r], vscale)));
  }
}

static void score_block(float *m, const float *const *xs, const int64_t *vis, int R, const float *tile, int64_t lp,
                        int64_t d, float scale, float fill) {
  switch (R) { /* a constant R for the compiler: the accumulators stay in registers */
    case 1: score_rows(m, xs, vis, 1, tile, lp, d, scale, fill); break;
    case 2: score_rows(m, xs, vis, 2, tile, lp, d, scale, fill); break;
    case 3: score_rows(m, xs, vis, 3, tile, lp, d, scale, fill); break;
    case 4: score_rows(m, xs, vis, 4, tile, lp, d, scale, fill); break;
    case 5: score_rows(m, xs, vis, 5, tile, lp, d, scale, fill); break;
    case 6: score_rows(m, xs, vis, 6, tile, lp, d, scale, fill); break;
    case 7: score_rows(m, xs, vis, 7, tile, lp, d, scale, fill); break;
    default: score_rows(m, xs, vis, 8, tile, lp, d, scale, fill);
  }
}

/* dst[r][:] = mult[r] * sum_{s < vis of the last row} w[r, s] * rows[s][:] for the R rows (R <= 4;
 * w is zero past each row's own vis), 64 features per pass. */
static inline __attribute__((always_inline)) void mix_rows(float *const *dst, const float *w, const int64_t *vis, const int R,
                                                           int64_t lp, const float *const *rows, int64_t d, const float *mult) {
  const int64_t vmax = vis[R - 1];
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int count = (int)((d - c0 < 64 ? d - c0 : 64) / 16);
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
      for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < vmax; s++) {
      __m512 row[4];
      for (int c = 0; c < 4; c++) row[c] = c < count ? _mm512_loadu_ps(rows[s] + c0 + 16 * c) : _mm512_setzero_ps();
      for (int r = 0; r < 4; r++)
        if (r < R) {
          const __m512 ws = _mm512_set1_ps(w[r * lp + s]);
          for (int c = 0; c < 4; c++)
            if (c < count) acc[r][c] = _mm512_fmadd_ps(ws, row[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
      for (int c = 0; c < count; c++)
        _mm512_storeu_ps(dst[r] + c0 + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(mult[r])));
  }
}

static void mix_block(float *const *dst, const float *w, const int64_t *vis, int R, int64_t lp, const float *const *rows,
                      int64_t d, const float *mult) {
  switch (R) {
    case 1: mix_rows(dst, w, vis, 1, lp, rows, d, mult); break;
    case 2: mix_rows(dst, w, vis, 2, lp, rows, d, mult); break;
    case 3: mix_rows(dst, w, vis, 3, lp, rows, d, mult); break;
    default: mix_rows(dst, w, vis, 4, lp, rows, d, mult);
  }
}

/* dst[u][:] += mult * sum_{r in [r0, r1)} w[r, s0 + u] * xs[r][:] for the S slots s0.. (S <= 4),
 * 64 features per pass: the gradient of S slots' keys or values (w is zero past each row's vis). */
static inline __attribute__((always_inline)) void gather_slots(float *const *dst, const float *w, int64_t r0, int64_t r1,
                                                               const int S, int64_t s0, int64_t lp,
                                                               const float *const *xs, int64_t d, float mult) {
  const __m512 vmult = _mm512_set1_ps(mult);
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    const int count = (int)((d - c0 < 64 ? d - c0 : 64) / 16);
    __m512 acc[4][4];
    for (int u = 0; u < 4; u++)
      for (int c = 0; c < 4; c++) acc[u][c] = _mm512_setzero_ps();
    for (int64_t r = r0; r < r1; r++) {
      __m512 x[4];
      for (int c = 0; c < 4; c++) x[c] = c < count ? _mm512_loadu_ps(xs[r] + c0 + 16 * c) : _mm512_setzero_ps();
      for (int u = 0; u < 4; u++)
        if (u < S) {
          const __m512 ws = _mm512_set1_ps(w[r * lp + s0 + u]);
          for (int c = 0; c < 4; c++)
            if (c < count) acc[u][c] = _mm512_fmadd_ps(ws, x[c], acc[u][c]);
        }
    }
    for (int u = 0; u < S; u++)
      for (int c = 0; c < count; c++) {
        float *o = dst[u] + c0 + 16 * c;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(acc[u][c], vmult, _mm512_loadu_ps(o)));
      }
  }
}

static void gather_block(float *const *dst, const float *w, int64_t r0, int64_t r1, int S, int64_t s0, int64_t lp,
                         const float *const *xs, int64_t d, float mult) {
  switch (S) {
    case 1: gather_slots(dst, w, r0, r1, 1, s0, lp, xs, d, mult); break;
    case 2: gather_slots(dst, w, r0, r1, 2, s0, lp, xs, d, mult); break;
    case 3: gather_slots(dst, w, r0, r1, 3, s0, lp, xs, d, mult); break;
    default: gather_slots(dst, w, r0, r1, 4, s0, lp, xs, d, mult);
  }
}

static float dot(const float *a, const float *b, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), acc);
  return _mm512_reduce_add_ps(acc);
}

/* Zero row[from, lp) (from a multiple of 16). */
static void zero_tail(float *row, int64_t from, int64_t lp) {
  for (int64_t c = from; c < lp; c += 16) _mm512_storeu_ps(row + c, _mm512_setzero_ps());
}

/* The query rows of sequence i for kv head g (slot order, then head), and first[]; returns their count. */
static int64_t query_rows(scratch *w, const int64_t *owner, int64_t li, int64_t g, int64_t rep, int64_t h, int64_t d,
                          const float *q, int64_t sq, const float *out, const float *dout, float *dq, int64_t sdq,
                          float *outp) {
  int64_t nr = 0;
  for (int64_t j = 0; j < li; j++) {
    w->first[j] = nr;
    const int64_t t = owner[j];
    if (t < 0) continue;
    for (int64_t hh = 0; hh < rep; hh++, nr++) {
      const int64_t head = g * rep + hh;
      w->vis[nr] = j + 1;
      w->qr[nr] = q + t * sq + head * d;
      if (out) w->orow[nr] = out + (t * h + head) * d;
      if (dout) w->dor[nr] = dout + (t * h + head) * d;
      if (dq) w->dqr[nr] = dq + t * sdq + head * d;
      if (outp) w->outr[nr] = outp + (t * h + head) * d;
    }
  }
  w->first[li] = nr;
  return nr;
}

/* sc[0, vis) (scaled scores, -inf past vis up to the chunk end) -> probabilities exp(sc - shift); returns their sum. */
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
#endif

int rlfunc_packed_attention_forward(const float *q, const float *k, const float *v, const int64_t *gather,
                                    const int64_t *len, const int64_t *slot_token, float *out, float *lse,
                                    int64_t n, int64_t L, int64_t h, int64_t kv, int64_t d, int64_t sq, int64_t sk,
                                    int64_t sv, float scale) {
#if defined(__AVX512F__)
  if (unsupported(h, kv, d, L)) return -1;
  const int64_t lp = (L + 15) / 16 * 16, rep = h / kv;
  scratch w;
  if (scratch_alloc(&w, L, rep, d)) return -2;
  for (int64_t i = 0; i < n; i++) {
    const int64_t *gi = gather + i * L, li = len[i];
    for (int64_t g = 0; g < kv; g++) {
      const int64_t nr = query_rows(&w, slot_token + i * L, li, g, rep, h, d, q, sq, NULL, NULL, NULL, 0, out);
      if (!nr) continue;
      load_head(&w, k, v, gi, li, g, sk, sv, lp, d, 0);
      for (int64_t r0 = 0; r0 < nr; r0 += 8)
        score_block(w.pm + r0 * lp, w.qr + r0, w.vis + r0, (int)(nr - r0 < 8 ? nr - r0 : 8), w.kt, lp, d, scale, -INFINITY);
      for (int64_t r = 0; r < nr; r++) { /* softmax */
        float *p = w.pm + r * lp;
        const int64_t vis = w.vis[r];
        const float mx = max_of(p, vis), sum = exp_shifted(p, vis, mx);
        zero_tail(p, (vis + 15) / 16 * 16, lp);
        lse[(w.outr[r] - out) / d] = mx + logf(sum);
        w.inv[r] = 1.0f / sum;
      }
      for (int64_t r0 = 0; r0 < nr; r0 += 4)
        mix_block(w.outr + r0, w.pm + r0 * lp, w.vis + r0, (int)(nr - r0 < 4 ? nr - r0 : 4), lp, w.vrow, d, w.inv + r0);
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
  const int64_t lp = (L + 15) / 16 * 16, rep = h / kv;
  scratch w;
  if (scratch_alloc(&w, L, rep, d)) return -2;
  const float scales[4] = {scale, scale, scale, scale};
  for (int64_t t = 0; t < T; t++) {
    memset(dq + t * sdq, 0, (size_t)(h * d) * sizeof(float));
    memset(dk + t * sdk, 0, (size_t)(kv * d) * sizeof(float));
    memset(dv + t * sdv, 0, (size_t)(kv * d) * sizeof(float));
  }
  for (int64_t i = 0; i < n; i++) {
    const int64_t *gi = gather + i * L, li = len[i];
    for (int64_t g = 0; g < kv; g++) {
      const int64_t nr = query_rows(&w, slot_token + i * L, li, g, rep, h, d, q, sq, out, dout, dq, sdq, NULL);
      if (!nr) continue;
      load_head(&w, k, v, gi, li, g, sk, sv, lp, d, 1);
      for (int64_t r0 = 0; r0 < nr; r0 += 8) {
        const int R = (int)(nr - r0 < 8 ? nr - r0 : 8);
        score_block(w.pm + r0 * lp, w.qr + r0, w.vis + r0, R, w.kt, lp, d, scale, -INFINITY);
        score_block(w.dsm + r0 * lp, w.dor + r0, w.vis + r0, R, w.vt, lp, d, 1.0f, 0.0f);
      }
      for (int64_t r = 0; r < nr; r++) { /* P = exp(S - lse), dS = P (dP - D); zero past vis */
        float *p = w.pm + r * lp, *ds = w.dsm + r * lp;
        const int64_t end = (w.vis[r] + 15) / 16 * 16;
        const __m512 vlse = _mm512_set1_ps(lse[(w.orow[r] - out) / d]);
        const __m512 D = _mm512_set1_ps(dot(w.dor[r], w.orow[r], d));
        for (int64_t c = 0; c < end; c += 16) {
          const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(p + c), vlse));
          _mm512_storeu_ps(p + c, e);
          _mm512_storeu_ps(ds + c, _mm512_mul_ps(e, _mm512_sub_ps(_mm512_loadu_ps(ds + c), D)));
        }
        zero_tail(p, end, lp);
        zero_tail(ds, end, lp);
      }
      for (int64_t r0 = 0; r0 < nr; r0 += 4)
        mix_block(w.dqr + r0, w.dsm + r0 * lp, w.vis + r0, (int)(nr - r0 < 4 ? nr - r0 : 4), lp, w.krow, d, scales);
      for (int64_t s0 = 0; s0 < li; s0 += 4) {
        const int S = (int)(li - s0 < 4 ? li - s0 : 4);
        float *dks[4], *dvs[4];
        for (int u = 0; u < S; u++) {
          dks[u] = dk + gi[s0 + u] * sdk + g * d;
          dvs[u] = dv + gi[s0 + u] * sdv + g * d;
        }
        gather_block(dks, w.dsm, w.first[s0], nr, S, s0, lp, w.qr, d, scale);
        gather_block(dvs, w.pm, w.first[s0], nr, S, s0, lp, w.dor, d, 1.0f);
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
