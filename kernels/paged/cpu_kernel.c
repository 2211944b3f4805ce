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
 * rows [n] int64, append [n] bool, omega [n], k [n, d], v [n, dv] (contiguous); the open-slot state of pool row
 * `row` at open_k + row * sk_row (ring slot j at + j * sk_ring, d values), open_v likewise (dv values), open_w
 * (one value per slot), open_tokens [rows] int64; seq_lens [rows] int32 already count the step. An append
 * zeroes the state and the token count; the weighted [k | v | 1] then adds to the sums (ring 1: exact) or
 * replaces the ring slot tokens % ring (window); the normalised state, sum u / sum z over the ring, goes
 * into entry seq_lens[row] - 1 of the row's pages. */
void dmc_update_f32(const int64_t *rows, const uint8_t *append, const float *omega, const float *k,
                    const float *v, float *open_k, int64_t sk_row, int64_t sk_ring, float *open_v,
                    int64_t sv_row, int64_t sv_ring, float *open_w, int64_t sw_row, int64_t sw_ring,
                    int64_t *open_tokens, const int32_t *seq_lens, const int32_t *block_table,
                    int64_t table_stride, float *k_pages, float *v_pages, int64_t n, int64_t ring, int64_t d,
                    int64_t dv, int64_t page_size) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t row = rows[r];
    float *uk = open_k + row * sk_row, *uv = open_v + row * sv_row, *z = open_w + row * sw_row;
    if (append[r]) {
      for (int64_t j = 0; j < ring; ++j) {
        memset(uk + j * sk_ring, 0, sizeof(float) * d);
        memset(uv + j * sv_ring, 0, sizeof(float) * dv);
        z[j * sw_ring] = 0.f;
      }
      open_tokens[row] = 0;
    }
    const int64_t slot = ring == 1 ? 0 : open_tokens[row] % ring;
    const float w = omega[r];
    float *sk = uk + slot * sk_ring, *sv = uv + slot * sv_ring;
    for (int64_t c = 0; c < d; ++c) sk[c] = (ring == 1 ? sk[c] : 0.f) + k[r * d + c] * w;
    for (int64_t c = 0; c < dv; ++c) sv[c] = (ring == 1 ? sv[c] : 0.f) + v[r * dv + c] * w;
    z[slot * sw_ring] = (ring == 1 ? z[slot * sw_ring] : 0.f) + w;
    open_tokens[row] += 1;
    const int64_t entry = seq_lens[row] - 1;
    const int64_t at = (int64_t)block_table[row * table_stride + entry / page_size] * page_size + entry % page_size;
    float *k_out = k_pages + at * d, *v_out = v_pages + at * dv, total = 0.f;
    for (int64_t j = 0; j < ring; ++j) total += z[j * sw_ring];
    for (int64_t c = 0; c < d; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < ring; ++j) sum += uk[j * sk_ring + c];
      k_out[c] = sum / total;
    }
    for (int64_t c = 0; c < dv; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < ring; ++j) sum += uv[j * sv_ring + c];
      v_out[c] = sum / total;
    }
  }
}
