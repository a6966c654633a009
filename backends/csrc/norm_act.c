/* Fused RMSNorm and SwiGLU, forward and backward, on the CPU for training (backends/cpu_fused.py).
 *
 * Both are memory-bound at the sizes of a training micro-batch: PyTorch runs Hugging Face's RMSNorm
 * as six elementwise kernels and SwiGLU's backward as three, each a full pass over the activations.
 * These do one pass forward and one backward, in float32:
 *
 *   rms_norm:  y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps) per row (Llama / Qwen2 RMSNorm);
 *              dx = rstd * (dy * w - xhat * mean(dy * w * xhat)),  dw = sum_rows dy * xhat,  xhat = x * rstd
 *   swiglu:    h = silu(g) * u;  dg = dh * u * s * (1 + g * (1 - s)),  du = dh * silu(g),  s = sigmoid(g)
 *
 * Layouts: x, y, dy, dx (rows, hdim) contiguous, w and dw (hdim), rstd (rows); g, u, h, dh, dg, du
 * contiguous, any length. Built with AVX-512F; otherwise the entry points return -1 and the caller
 * uses PyTorch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd.h"

static inline __m512 load(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

/* Full-width stores, masked only for a row's tail (masked stores are slow on some x86 cores). */
static inline void store(float *p, __m512 x, __mmask16 m) {
  if (m == 0xFFFF) _mm512_storeu_ps(p, x);
  else _mm512_mask_storeu_ps(p, m, x);
}

/* sigmoid(x) = 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) below, with e = exp(-|x|) <= 1. */
static inline __m512 sigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
  return _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), r, e);
}
#endif

int rlfunc_rms_norm_forward(const float *x, const float *w, float *y, float *rstd, int64_t rows, int64_t hdim,
                            float eps) {
#if defined(__AVX512F__)
  if (hdim < 1) return -1;
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * hdim;
    float *yr = y + r * hdim;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < hdim; c += 16) {
      const __m512 v = load(xr + c, tail_mask(hdim - c));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hdim + eps);
    rstd[r] = inv;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < hdim; c += 16) {
      const __mmask16 m = tail_mask(hdim - c);
      store(yr + c, _mm512_mul_ps(_mm512_mul_ps(load(xr + c, m), vinv), load(w + c, m)), m);
    }
  }
  return 0;
#else
  (void)x; (void)w; (void)y; (void)rstd; (void)rows; (void)hdim; (void)eps;
  return -1;
#endif
}

int rlfunc_rms_norm_backward(const float *x, const float *w, const float *rstd, const float *dy, float *dx,
                             float *dw, int64_t rows, int64_t hdim) {
#if defined(__AVX512F__)
  if (hdim < 1) return -1;
  const int64_t hp = (hdim + 15) / 16 * 16;
  float *acc = (float *)aligned_alloc(64, (size_t)hp * sizeof(float));
  if (!acc) return -2;
  memset(acc, 0, (size_t)hp * sizeof(float));
  const __m512 vh = _mm512_set1_ps(1.0f / (float)hdim);
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * hdim, *dyr = dy + r * hdim;
    float *dxr = dx + r * hdim;
    const __m512 vinv = _mm512_set1_ps(rstd[r]);
    __m512 dotv = _mm512_setzero_ps();
    for (int64_t c = 0; c < hdim; c += 16) {
      const __mmask16 m = tail_mask(hdim - c);
      const __m512 xhat = _mm512_mul_ps(load(xr + c, m), vinv), g = load(dyr + c, m);
      dotv = _mm512_fmadd_ps(_mm512_mul_ps(g, load(w + c, m)), xhat, dotv);
      _mm512_store_ps(acc + c, _mm512_fmadd_ps(g, xhat, _mm512_load_ps(acc + c)));
    }
    const __m512 mean = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_add_ps(dotv)), vh);
    for (int64_t c = 0; c < hdim; c += 16) {
      const __mmask16 m = tail_mask(hdim - c);
      const __m512 xhat = _mm512_mul_ps(load(xr + c, m), vinv);
      const __m512 gw = _mm512_mul_ps(load(dyr + c, m), load(w + c, m));
      store(dxr + c, _mm512_mul_ps(vinv, _mm512_fnmadd_ps(xhat, mean, gw)), m);
    }
  }
  memcpy(dw, acc, (size_t)hdim * sizeof(float));
  free(acc);
  return 0;
#else
  (void)x; (void)w; (void)rstd; (void)dy; (void)dx; (void)dw; (void)rows; (void)hdim;
  return -1;
#endif
}

int rlfunc_swiglu_forward(const float *g, const float *u, float *h, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = load(g + i, m);
    store(h + i, _mm512_mul_ps(_mm512_mul_ps(x, sigmoid(x)), load(u + i, m)), m);
  }
  return 0;
#else
  (void)g; (void)u; (void)h; (void)n;
  return -1;
#endif
}

int rlfunc_swiglu_backward(const float *g, const float *u, const float *dh, float *dg, float *du, int64_t n) {
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = load(g + i, m), s = sigmoid(x), d = load(dh + i, m);
    /* d silu / dx = s * (1 + x * (1 - s)) */
    const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
    store(dg + i, _mm512_mul_ps(_mm512_mul_ps(d, load(u + i, m)), dsilu), m);
    store(du + i, _mm512_mul_ps(d, _mm512_mul_ps(x, s)), m);
  }
  return 0;
#else
  (void)g; (void)u; (void)dh; (void)dg; (void)du; (void)n;
  return -1;
#endif
}

/* 1: this build has the kernels (AVX-512F). */
int rlfunc_norm_act_support(void) {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}
