/* The eviction policies' victim choice on CPU: one pass per row for the lowest priority outside the protected
 * entries, one for the oldest entry holding it (kernels/eviction/reference.py is the same in tensor ops; on CPU
 * their boolean-mask ops cost some 5 ns an element, this a fraction of that). */
#include <math.h>
#include <stdint.h>

/* priority [lead, n, len] fp32, positions [lead, n, len] (-1: an empty slot; int64 for victims_f32, int32 for
 * victims_f32_i32), newest [n] int64; out [lead, n] int64: per row the slot of the lowest priority among entries not
 * protected (position < sink, or with recent > 0 position > newest - recent: those rank +inf), ties to the smallest
 * position, then the first slot; a NaN priority among the ranked makes the row's choice slot 0 (as the tensor ops:
 * no value equals NaN). */
#define VICTIMS(NAME, POSITION)                                                                                      \
  void NAME(const float *priority, const POSITION *positions, const int64_t *newest, int64_t lead, int64_t n,        \
            int64_t len, int64_t sink, int64_t recent, int64_t *out) {                                              \
    for (int64_t row = 0; row < lead * n; ++row) {                                                                  \
      const float *p = priority + row * len;                                                                        \
      const POSITION *pos = positions + row * len;                                                                  \
      const int64_t floor = newest[row % n] - recent;                                                               \
      float low = INFINITY;                                                                                         \
      int nan = 0;                                                                                                  \
      _Pragma("omp simd reduction(min : low) reduction(| : nan)") for (int64_t j = 0; j < len; ++j) {               \
        const float v = (pos[j] < sink) | ((recent != 0) & (pos[j] > floor)) ? INFINITY : p[j];                    \
        nan |= v != v;                                                                                              \
        low = v < low ? v : low;                                                                                    \
      }                                                                                                             \
      int64_t oldest = INT64_MAX, slot = 0;                                                                         \
      _Pragma("omp simd reduction(min : oldest)") for (int64_t j = 0; j < len; ++j) {                               \
        const float v = (pos[j] < sink) | ((recent != 0) & (pos[j] > floor)) ? INFINITY : p[j];                    \
        const int64_t at = v == low ? (int64_t)pos[j] : INT64_MAX;                                                  \
        oldest = at < oldest ? at : oldest;                                                                         \
      }                                                                                                             \
      for (int64_t j = 0; j < len && !nan; ++j) /* the first slot holding it */                                     \
        if (pos[j] == oldest && ((pos[j] < sink) | ((recent != 0) & (pos[j] > floor)) ? INFINITY : p[j]) == low) { \
          slot = j;                                                                                                 \
          break;                                                                                                    \
        }                                                                                                           \
      out[row] = slot;                                                                                              \
    }                                                                                                               \
  }

VICTIMS(victims_f32, int64_t)
VICTIMS(victims_f32_i32, int32_t)

/* LSH-E's distances: out[row, j] = sum over the g query codes of row `row % n` of popcount(query ^ code j of the row),
 * codes packed in nbytes bytes. queries [n, g, nbytes], codes [lead, n, len, nbytes] uint8; out [lead, n, len] int32. */
void hamming_sums_u8(const uint8_t *queries, const uint8_t *codes, int64_t lead, int64_t n, int64_t g, int64_t len,
                     int64_t nbytes, int32_t *out) {
  for (int64_t row = 0; row < lead * n; ++row) {
    const uint8_t *q = queries + (row % n) * g * nbytes, *c = codes + row * len * nbytes;
    for (int64_t j = 0; j < len; ++j) {
      int32_t sum = 0;
      for (int64_t h = 0; h < g; ++h)
        for (int64_t b = 0; b < nbytes; ++b) sum += __builtin_popcount((unsigned)(q[h * nbytes + b] ^ c[j * nbytes + b]));
      out[row * len + j] = sum;
    }
  }
}
