/* Greedy sampling on CPU: each row's first maximum (torch.argmax's index: ties to the lowest, a NaN counts as the
 * maximum, its first one), in two passes over the row: its maximum (vectorised) and then the first entry equal to it.
 * logits [rows, n] fp32, row r at logits + r * stride; out [rows] int64. */
#include <math.h>
#include <stdint.h>

void argmax_f32(const float *logits, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *x = logits + r * stride;
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t j = 0; j < n; ++j) {
      best = x[j] > best ? x[j] : best;
      nan |= x[j] != x[j];
    }
    int64_t at = 0;
    for (int64_t j = 0; j < n; ++j)
      if (nan ? x[j] != x[j] : x[j] == best) {
        at = j;
        break;
      }
    out[r] = at;
  }
}
