/* Paged decode ops on CPU: attention where each row reads its own pages in place (no gather, no padding), and
 * DMC's decode-step update (Algorithm 1) of each row's open slot, written into its page entry.
 *
 * Built and loaded by cpu.py (which states the layouts); fp32 throughout. Row r (one sequence's KV head,
 * its G query heads) is attended page by page with an online softmax: per page, the logits of its entries
 * for every query head, the running max and sum rescaled, the values accumulated into out[r]. Rows are
 * independent: OpenMP threads take them in turn.
 *
 * scores_mode 1 ("probs") also writes, per entry, the sum over the G heads of its softmax weight; that needs
 * the final max and sum, so the logits are kept (a buffer of G x L per row) and normalised after the pass.
 * scores_mode 2 ("logits") writes the sum over G of the scaled logits. Entries past a row's length (up to
 * scores_width) are 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void attend_row(const float *q, const float *k_pages, const float *v_pages, const int32_t *pages,
                       int64_t len, int64_t groups, int64_t d, int64_t dv, int64_t page_size, float scale,
                       float *out, float *lse, float *scores, int64_t scores_width, int scores_mode,
                       float *kept) {
  float max_[groups], sum_[groups], logits[groups * page_size];
  for (int64_t g = 0; g < groups; ++g) {
    max_[g] = -INFINITY;
    sum_[g] = 0.f;
  }
  memset(out, 0, sizeof(float) * groups * dv);
  for (int64_t start = 0; start < len; start += page_size) {
    const int64_t n = len - start < page_size ? len - start : page_size;
    const float *k_page = k_pages + (int64_t)pages[start / page_size] * page_size * d;
    const float *v_page = v_pages + (int64_t)pages[start / page_size] * page_size * dv;
    for (int64_t g = 0; g < groups; ++g) {
      const float *qg = q + g * d;
      float *lg = logits + g * page_size, page_max = -INFINITY;
      for (int64_t i = 0; i < n; ++i) {
        const float *k = k_page + i * d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < d; ++c) dot += qg[c] * k[c];
        lg[i] = dot * scale;
        page_max = lg[i] > page_max ? lg[i] : page_max;
      }
      if (scores_mode == 1) memcpy(kept + g * len + start, lg, sizeof(float) * n);
      if (scores_mode == 2) {
        float *s = scores + start;
        for (int64_t i = 0; i < n; ++i) s[i] = (g == 0 ? 0.f : s[i]) + lg[i];
      }
      const float new_max = page_max > max_[g] ? page_max : max_[g];
      float *acc = out + g * dv;
      if (max_[g] != new_max) {  /* rescale what was accumulated under the old max */
        const float c = expf(max_[g] - new_max);
        sum_[g] *= c;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) acc[j] *= c;
        max_[g] = new_max;
      }
      for (int64_t i = 0; i < n; ++i) {
        const float p = expf(lg[i] - new_max);
        const float *v = v_page + i * dv;
        sum_[g] += p;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) acc[j] += p * v[j];
      }
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    const float inv = 1.f / sum_[g];
    for (int64_t j = 0; j < dv; ++j) out[g * dv + j] *= inv;
    if (lse) lse[g] = max_[g] + logf(sum_[g]);
  }
  if (scores_mode == 1) {
    for (int64_t i = 0; i < len; ++i) scores[i] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float inv = 1.f / sum_[g];
      for (int64_t i = 0; i < len; ++i) scores[i] += expf(kept[g * len + i] - max_[g]) * inv;
    }
  }
  if (scores_mode) memset(scores + len, 0, sizeof(float) * (scores_width - len));
}

/* q [rows, groups, d], k_pages [P, page_size, d], v_pages [P, page_size, dv] (contiguous fp32);
 * block_table [rows, table_stride] int32 (row r's pages in order); seq_lens [rows] int64, or int32 when
 * lens_int32 (>= 1);
 * out [rows, groups, dv]; lse [rows, groups] or NULL; scores [rows, scores_width] or NULL. */
int paged_decode_f32(const float *q, const float *k_pages, const float *v_pages, const int32_t *block_table,
                     int64_t table_stride, const void *seq_lens, int lens_int32, int64_t rows, int64_t groups, int64_t d,
                     int64_t dv, int64_t page_size, float scale, float *out, float *lse, float *scores,
                     int64_t scores_width, int scores_mode, int num_threads) {
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens_int32 ? ((const int32_t *)seq_lens)[r] : ((const int64_t *)seq_lens)[r];
    float *kept = scores_mode == 1 ? malloc(sizeof(float) * groups * len) : NULL;
    if (scores_mode == 1 && !kept) {
#pragma omp atomic write
      failed = 1;
      continue;
    }
    attend_row(q + r * groups * d, k_pages, v_pages, block_table + r * table_stride, len, groups, d, dv,
               page_size, scale, out + r * groups * dv, lse ? lse + r * groups : NULL,
               scores ? scores + r * scores_width : NULL, scores_width, scores_mode, kept);
    free(kept);
  }
  return failed;
}

/* One DMC decode step per row (kernels/paged/writes.py, dmc_cache_update_torch, is the same in tensor ops):
 * rows [n] int64; alpha [n] fp32, the hard decision (0 appends, anything else merges); omega [n] fp32; row r's new
 * key at k + (r / inner) * sk_outer + (r % inner) * sk_inner (d values: k [n, d] with inner 1, or [b, inner, d]),
 * its value likewise (dv values); ring slot j of pool row `row`'s open-slot state at state + row * s_row +
 * j * s_ring: the omega-weighted key (d values), value (dv values), then their omega; open_tokens [rows] int64;
 * seq_lens [rows] int32, the lengths before the step. An append adds one to seq_lens[row] (the caller assigned the
 * page of that entry), zeroes the state and the token count; the weighted [k | v | 1] then adds to the sums (ring
 * 1: exact) or replaces the ring slot tokens % ring (window); the normalised state, sum u / sum z over the ring,
 * goes into entry seq_lens[row] - 1 of the row's pages, and lens[r] (int32) is the row's new length. */
void dmc_update_f32(const int64_t *rows, const float *alpha, const float *omega, const float *k, int64_t sk_outer,
                    int64_t sk_inner, const float *v, int64_t sv_outer, int64_t sv_inner, int64_t inner,
                    float *state, int64_t s_row, int64_t s_ring, int64_t *open_tokens, int32_t *seq_lens,
                    int32_t *lens, const int32_t *block_table, int64_t table_stride, float *k_pages, float *v_pages,
                    int64_t n, int64_t ring, int64_t d, int64_t dv, int64_t page_size) {
  const int64_t width = d + dv + 1;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t row = rows[r];
    const float *k_new = k + (r / inner) * sk_outer + (r % inner) * sk_inner;
    const float *v_new = v + (r / inner) * sv_outer + (r % inner) * sv_inner;
    float *u = state + row * s_row;
    if (alpha[r] == 0.f) {
      for (int64_t j = 0; j < ring; ++j) memset(u + j * s_ring, 0, sizeof(float) * width);
      open_tokens[row] = 0;
      seq_lens[row] += 1;
    }
    const float w = omega[r];
    float *s = u + (ring == 1 ? 0 : open_tokens[row] % ring) * s_ring;
    for (int64_t c = 0; c < d; ++c) s[c] = (ring == 1 ? s[c] : 0.f) + k_new[c] * w;
    for (int64_t c = 0; c < dv; ++c) s[d + c] = (ring == 1 ? s[d + c] : 0.f) + v_new[c] * w;
    s[d + dv] = (ring == 1 ? s[d + dv] : 0.f) + w;
    open_tokens[row] += 1;
    lens[r] = seq_lens[row];
    const int64_t entry = seq_lens[row] - 1;
    const int64_t at = (int64_t)block_table[row * table_stride + entry / page_size] * page_size + entry % page_size;
    float *k_out = k_pages + at * d, *v_out = v_pages + at * dv, total = 0.f;
    for (int64_t j = 0; j < ring; ++j) total += u[j * s_ring + d + dv];
    for (int64_t c = 0; c < d + dv; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < ring; ++j) sum += u[j * s_ring + c];
      *(c < d ? k_out + c : v_out + (c - d)) = sum / total;  /* [k | v] side by side in the state */
    }
  }
}
