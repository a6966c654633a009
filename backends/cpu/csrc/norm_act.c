/* Fused RMSNorm and SwiGLU, forward and backward, on the CPU for training (backends/cpu/fused_modules.py).
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
 *
 * bf16 (the last argument, 1): x, w, y, dy, dx and g, u, h, dh, dg, du are bfloat16 (rstd and dw stay
 * float32). The math runs in float32 on the widened values, and the forward rounds where a bfloat16
 * Hugging Face module rounds: y = bf16(w * bf16(x * rstd)), h = bf16(bf16(silu(g)) * u); each gradient
 * is rounded once. Needs AVX-512BW/VL (RLFUNC_BF16), else -1.
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

/* 16 elements from p + i as float32 (p float32, or bfloat16 when bf16); lanes outside m are 0. */
static inline __m512 ld(const void *p, int64_t i, __mmask16 m, int bf16) {
#if RLFUNC_BF16
  if (bf16) return bf16_load((const uint16_t *)p + i, m);
#endif
  (void)bf16;
  return load((const float *)p + i, m);
}

static inline void st(void *p, int64_t i, __m512 x, __mmask16 m, int bf16) {
#if RLFUNC_BF16
  if (bf16) {
    bf16_store((uint16_t *)p + i, x, m);
    return;
  }
#endif
  (void)bf16;
  store((float *)p + i, x, m);
}

/* what a bfloat16 op would have stored: x itself in float32 */
static inline __m512 rounded(__m512 x, int bf16) {
#if RLFUNC_BF16
  if (bf16) return bf16_nearest(x);
#endif
  (void)bf16;
  return x;
}

static int unsupported(int bf16) { return bf16 && !RLFUNC_BF16; }

/* sigmoid(x) = 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) below, with e = exp(-|x|) <= 1. */
static inline __m512 sigmoid(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
  return _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), r, e);
}
#endif

int rlfunc_rms_norm_forward(const void *x, const void *w, void *y, float *rstd, int64_t rows, int64_t hdim,
                            float eps, int bf16) {
#if defined(__AVX512F__)
  if (hdim < 1 || unsupported(bf16)) return -1;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t row = r * hdim;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < hdim; c += 16) {
      const __m512 v = ld(x, row + c, tail_mask(hdim - c), bf16);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)hdim + eps);
    rstd[r] = inv;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t c = 0; c < hdim; c += 16) {
      const __mmask16 m = tail_mask(hdim - c);
      st(y, row + c, _mm512_mul_ps(rounded(_mm512_mul_ps(ld(x, row + c, m, bf16), vinv), bf16), ld(w, c, m, bf16)), m,
         bf16);
    }
  }
  return 0;
#else
  (void)x; (void)w; (void)y; (void)rstd; (void)rows; (void)hdim; (void)eps; (void)bf16;
  return -1;
#endif
}

int rlfunc_rms_norm_backward(const void *x, const void *w, const float *rstd, const void *dy, void *dx,
                             float *dw, int64_t rows, int64_t hdim, int bf16) {
#if defined(__AVX512F__)
  if (hdim < 1 || unsupported(bf16)) return -1;
  const int64_t hp = (hdim + 15) / 16 * 16;
  float *acc = (float *)aligned_alloc(64, (size_t)hp * sizeof(float));
  if (!acc) return -2;
  memset(acc, 0, (size_t)hp * sizeof(float));
  const __m512 vh = _mm512_set1_ps(1.0f / (float)hdim);
  for (int64_t r = 0; r < rows; r++) {
    const int64_t row = r * hdim;
    const __m512 vinv = _mm512_set1_ps(rstd[r]);
    __m512 dotv = _mm512_setzero_ps();
    for (int64_t c = 0; c < hdim; c += 16) {
      const __mmask16 m = tail_mask(hdim - c);
      const __m512 xhat = _mm512_mul_ps(ld(x, row + c, m, bf16), vinv), g = ld(dy, row + c, m, bf16);
      dotv = _mm512_fmadd_ps(_mm512_mul_ps(g, ld(w, c, m, bf16)), xhat, dotv);
      /* dw sees the xhat the forward multiplied by w: rounded to bf16 there */
      _mm512_store_ps(acc + c, _mm512_fmadd_ps(g, rounded(xhat, bf16), _mm512_load_ps(acc + c)));
    }
    const __m512 mean = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_add_ps(dotv)), vh);
    for (int64_t c = 0; c < hdim; c += 16) {
      const __mmask16 m = tail_mask(hdim - c);
      const __m512 xhat = _mm512_mul_ps(ld(x, row + c, m, bf16), vinv);
      const __m512 gw = _mm512_mul_ps(ld(dy, row + c, m, bf16), ld(w, c, m, bf16));
      st(dx, row + c, _mm512_mul_ps(vinv, _mm512_fnmadd_ps(xhat, mean, gw)), m, bf16);
    }
  }
  memcpy(dw, acc, (size_t)hdim * sizeof(float));
  free(acc);
  return 0;
#else
  (void)x; (void)w; (void)rstd; (void)dy; (void)dx; (void)dw; (void)rows; (void)hdim; (void)bf16;
  return -1;
#endif
}

int rlfunc_swiglu_forward(const void *g, const void *u, void *h, int64_t n, int bf16) {
#if defined(__AVX512F__)
  if (unsupported(bf16)) return -1;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = ld(g, i, m, bf16);
    st(h, i, _mm512_mul_ps(rounded(_mm512_mul_ps(x, sigmoid(x)), bf16), ld(u, i, m, bf16)), m, bf16);
  }
  return 0;
#else
  (void)g; (void)u; (void)h; (void)n; (void)bf16;
  return -1;
#endif
}

int rlfunc_swiglu_backward(const void *g, const void *u, const void *dh, void *dg, void *du, int64_t n, int bf16) {
#if defined(__AVX512F__)
  if (unsupported(bf16)) return -1;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 x = ld(g, i, m, bf16), s = sigmoid(x), d = ld(dh, i, m, bf16);
    /* d silu / dx = s * (1 + x * (1 - s)) */
    const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
    st(dg, i, _mm512_mul_ps(_mm512_mul_ps(d, ld(u, i, m, bf16)), dsilu), m, bf16);
    st(du, i, _mm512_mul_ps(d, rounded(_mm512_mul_ps(x, s), bf16)), m, bf16);
  }
  return 0;
#else
  (void)g; (void)u; (void)dh; (void)dg; (void)du; (void)n; (void)bf16;
  return -1;
#endif
}

/* Bit 0: this build has the kernels (AVX-512F); bit 1: also for bfloat16 tensors (AVX-512BW/VL). */
int rlfunc_norm_act_support(void) {
#if defined(__AVX512F__)
  return 1 | (RLFUNC_BF16 << 1);
#else
  return 0;
#endif
}
