/* Copy rows into a large record buffer with streaming (non-temporal) stores: the native rollout's
 * recording of its linear outputs (backends/rollout/native.py, generate_recording).
 *
 *   dst[i, :] = src[rows[i], :]   for i < n   (rows NULL: src[i, :]); src has m rows
 *
 * The source rows were just written by a GEMM and sit in cache; the destination is a buffer of about
 * a hundred MB that no one reads until the trainer's backward. Ordinary stores first read each
 * destination line into the cache (write-allocate) and then evict a line of something useful; the
 * streaming stores write whole lines straight to memory: a 128 x 688 float32 chunk in 21 instead of
 * 49 us on this machine (measured). Rows are row_bytes long (any dtype), src rows contiguous, dst
 * contiguous. Returns 0, or -3 (before copying anything) if a row index is outside [0, m), -2 for
 * a negative size. Built with AVX-512F; otherwise the entry point returns -1 and the caller copies
 * with PyTorch.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int rlfunc_record_rows(const char *src, int64_t m, const int64_t *rows, int64_t n, int64_t row_bytes, char *dst) {
  if (n < 0 || m < 0 || row_bytes < 0) return -2;
  if (rows) {
    for (int64_t i = 0; i < n; i++)
      if (rows[i] < 0 || rows[i] >= m) return -3;
  } else if (n > m) {
    return -3;
  }
  for (int64_t i = 0; i < n; i++) {
    const char *s = src + (rows ? rows[i] : i) * row_bytes;
    char *d = dst + i * row_bytes;
    int64_t head = (int64_t)((64 - ((uintptr_t)d & 63)) & 63);
    if (head > row_bytes) head = row_bytes;
    memcpy(d, s, (size_t)head);
    int64_t j = head;
    for (; j + 64 <= row_bytes; j += 64)
      _mm512_stream_si512((__m512i *)(d + j), _mm512_loadu_si512((const void *)(s + j)));
    memcpy(d + j, s + j, (size_t)(row_bytes - j));
  }
  _mm_sfence();
  return 0;
}

int rlfunc_record_rows_support(void) { return 1; }

#else

int rlfunc_record_rows(const char *src, int64_t m, const int64_t *rows, int64_t n, int64_t row_bytes, char *dst) {
  (void)src, (void)m, (void)rows, (void)n, (void)row_bytes, (void)dst;
  return -1;
}

int rlfunc_record_rows_support(void) { return 0; }

#endif
