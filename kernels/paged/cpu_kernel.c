/* Paged decode ops on CPU: attention where each row reads its own pages in place (no gather, no padding), and
 * DMC's decode-step update (Algorithm 1) of each row's open slot, written into its page entry.
 *
 * Built and loaded by cpu.py (which states the layouts); fp32 throughout. Row r (one sequence's KV head, its G
 * query heads) is attended in blocks of up to BLOCK entries of one page with an online softmax. Per block, all
 * G heads share each key and value loaded, and the loops run across entries or components, which the compiler
 * vectorises: the logits (every product of a query head and a key summed into LANES partial sums, then the
 * partial sums of the block's keys added across together), the block's max and the rescale of the running sums
 * and of out[r] when it grows, exp by a polynomial (exp_nonpos), and the weighted values accumulated in
 * registers; the next PREFETCH_BLOCKS blocks' keys and values are asked for meanwhile, into L2 (prefetch_block).
 * Rows are independent: OpenMP threads take them in turn. The usual head sizes (32, 64, 128) and query heads per
 * row (1, 2, 4, 8) run copies compiled with the sizes as constants (loops unrolled: about 20% faster at d = 32,
 * the constant G another 2-17%); others the same code with the sizes as variables. No FMA is used
 * (-ffp-contract=off serves the DMC update; explicit FMA in the attention measured no faster).
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

#include "../cpu_math.h" /* exp_nonpos */

#define BLOCK 16 /* entries attended together (within one page): a block's logits for a head are one vector */
#define LANES 8  /* partial sums of a dot product */
#define CHUNK 16 /* value components whose weighted sum over a block is kept in registers */
#define PREFETCH_BLOCKS 2 /* a row's blocks asked for ahead of the one attended */
#define INLINE static inline __attribute__((always_inline))

/* logits[g * BLOCK + i] = q[g] . k[i] * scale for the block's n keys and every head; -inf for i >= n. */
INLINE void block_logits(const float *q, const float *k, int64_t n, int64_t groups, int64_t d, float scale,
                         float *logits) {
  float part[groups * BLOCK * LANES];
  const int64_t d_lanes = d - d % LANES;
  for (int64_t i = 0; i < BLOCK; ++i)
    for (int64_t g = 0; g < groups; ++g) {
      float *t = part + (g * BLOCK + i) * LANES;
      for (int l = 0; l < LANES; ++l) t[l] = 0.f;
      for (int64_t c = 0; c < (i < n ? d_lanes : 0); c += LANES)
#pragma omp simd /* across the lanes (without it, a variable d gets a slow vectorisation across c) */
        for (int l = 0; l < LANES; ++l) t[l] += q[g * d + c + l] * k[i * d + c + l];
    }
  for (int64_t gi = 0; gi < groups * BLOCK; ++gi) { /* vectorised across entries: no horizontal sum per logit */
    const float *t = part + gi * LANES;
    logits[gi] = ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]));
  }
  if (d_lanes < d)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t c = d_lanes; c < d; ++c) logits[g * BLOCK + i] += q[g * d + c] * k[i * d + c];
  for (int64_t g = 0; g < groups; ++g)
    for (int i = 0; i < BLOCK; ++i) logits[g * BLOCK + i] = i < n ? logits[g * BLOCK + i] * scale : -INFINITY;
}

INLINE float block_max(const float *x) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int i = 0; i < BLOCK; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

/* x[i] = exp(x[i] - max) over a block, added to the running sums kept per position in the block (added across
 * once, at the end of the row). */
INLINE void block_exp(float *x, float max, float *sums) {
  for (int i = 0; i < BLOCK; ++i) {
    x[i] = exp_nonpos(x[i] - max);
    sums[i] += x[i];
  }
}

/* out[g] += sum over the block's n values of p[g * BLOCK + i] v[i], every head: CHUNK components at a time in
 * registers, with two running sums (even and odd entries) so that each add waits on half as many. */
INLINE void block_values(const float *v, const float *p, int64_t n, int64_t groups, int64_t dv, float *out) {
  const int64_t dv_chunks = dv - dv % CHUNK;
  for (int64_t g = 0; g < groups; ++g) {
    const float *pg = p + g * BLOCK;
    float *og = out + g * dv;
    for (int64_t j = 0; j < dv_chunks; j += CHUNK) {
      float even[CHUNK], odd[CHUNK];
      for (int l = 0; l < CHUNK; ++l) {
        even[l] = og[j + l];
        odd[l] = 0.f;
      }
      int64_t i = 0;
      for (; i + 2 <= n; i += 2)
        for (int l = 0; l < CHUNK; ++l) {
          even[l] += pg[i] * v[i * dv + j + l];
          odd[l] += pg[i + 1] * v[(i + 1) * dv + j + l];
        }
      if (i < n)
        for (int l = 0; l < CHUNK; ++l) even[l] += pg[i] * v[i * dv + j + l];
      for (int l = 0; l < CHUNK; ++l) og[j + l] = even[l] + odd[l];
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = dv_chunks; j < dv; ++j) og[j] += pg[i] * v[i * dv + j];
  }
}

/* One block of n entries (keys k, values v) for every head of a row: the logits, the online softmax (the
 * running max, sums and out rescaled when the max grows), the weighted values added to out; scores_mode 1
 * keeps the logits (kept + g * kept_stride), 2 writes their sum over the heads (scores). */
INLINE void attend_block(const float *q, const float *k, const float *v, int64_t n, int64_t groups, int64_t d,
                         int64_t dv, float scale, float *max, float *sums, float *out, int scores_mode,
                         float *scores, float *kept, int64_t kept_stride) {
  float logits[groups * BLOCK];
  block_logits(q, k, n, groups, d, scale, logits);
  if (scores_mode == 2)
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.f;
      for (int64_t g = 0; g < groups; ++g) s += logits[g * BLOCK + i];
      scores[i] = s;
    }
  for (int64_t g = 0; g < groups; ++g) {
    float *lg = logits + g * BLOCK;
    if (scores_mode == 1) memcpy(kept + g * kept_stride, lg, sizeof(float) * n);
    const float m = block_max(lg);
    if (m > max[g]) { /* rescale what was accumulated under the old max */
      const float c = expf(max[g] - m);
      for (int i = 0; i < BLOCK; ++i) sums[g * BLOCK + i] *= c;
      for (int64_t j = 0; j < dv; ++j) out[g * dv + j] *= c;
      max[g] = m;
    }
    block_exp(lg, max[g], sums + g * BLOCK);
  }
  block_values(v, logits, n, groups, dv, out);
}

struct attention { /* paged_decode_f32's arguments */
  const float *q;        /* row r's query heads at q + (r / q_inner) * q_outer + (r % q_inner) * groups * d */
  int64_t q_inner, q_outer;
  const float *k_pages, *v_pages;
  const int32_t *block_table;
  const int64_t *rows; /* row r's block-table row is rows[r] (decode_step_f32), or r when NULL */
  int64_t table_stride, groups, page_size;
  float scale, *out, *lse, *scores;
  int64_t scores_width;
  int scores_mode;
};

/* The block of a row's entries from `start` on (up to BLOCK, within one page and the row's len entries): its
 * first entry's place in the pool, and its size in *n. */
INLINE int64_t block_at(const struct attention *a, const int32_t *pages, int64_t start, int64_t len, int64_t *n) {
  const int64_t page_size = a->page_size, slot = start % page_size;
  const int64_t in_page = page_size - slot < len - start ? page_size - slot : len - start;
  *n = in_page < BLOCK ? in_page : BLOCK;
  return (int64_t)pages[start / page_size] * page_size + slot;
}

/* Asks for the block of a row's entries from `start` on (block_at), its keys and values, into L2 (prefetcht1): the
 * pages are anywhere in the pool, where the hardware's prefetchers do not look, and from a pool larger than the
 * caches blocks asked for into L2 arrive up to twice as fast as into L1 (docs/BENCHMARKS.md). Returns its size. */
INLINE int64_t prefetch_block(const struct attention *a, const int32_t *pages, int64_t start, int64_t len, int64_t d,
                              int64_t dv) {
  int64_t n;
  const int64_t at = block_at(a, pages, start, len, &n);
  const char *k = (const char *)(a->k_pages + at * d), *v = (const char *)(a->v_pages + at * dv);
  for (int64_t b = 0; b < (int64_t)sizeof(float) * n * d; b += 64) __builtin_prefetch(k + b, 0, 2);
  for (int64_t b = 0; b < (int64_t)sizeof(float) * n * dv; b += 64) __builtin_prefetch(v + b, 0, 2);
  return n;
}

/* Row r, of len entries; kept: a buffer of groups x len for scores_mode 1. */
INLINE void attend_row(const struct attention *a, int64_t r, int64_t len, int64_t d, int64_t dv, int64_t groups,
                       float *kept) {
  const int32_t *pages = a->block_table + (a->rows ? a->rows[r] : r) * a->table_stride;
  const float *q = a->q + (r / a->q_inner) * a->q_outer + (r % a->q_inner) * groups * d, scale = a->scale;
  float *out = a->out + r * groups * dv, *scores = a->scores ? a->scores + r * a->scores_width : NULL;
  const int scores_mode = a->scores_mode;
  float max[groups], sums[groups * BLOCK];
  for (int64_t g = 0; g < groups; ++g) max[g] = -INFINITY;
  memset(sums, 0, sizeof sums);
  memset(out, 0, sizeof(float) * groups * dv);
  for (int64_t start = 0, n, fetched = 0; start < len; start += n) { /* fetched: entries asked for */
    const int64_t entry = block_at(a, pages, start, len, &n);
    const float *k = a->k_pages + entry * d, *v = a->v_pages + entry * dv;
    while (fetched < len && fetched < start + (1 + PREFETCH_BLOCKS) * BLOCK)
      fetched += prefetch_block(a, pages, fetched, len, d, dv);
    float *s = scores_mode == 2 ? scores + start : NULL, *kp = kept ? kept + start : NULL;
    if (n == BLOCK) /* a whole block (all but a row's last with pages of 16 or more): its loops' counts known */
      attend_block(q, k, v, BLOCK, groups, d, dv, scale, max, sums, out, scores_mode, s, kp, len);
    else
      attend_block(q, k, v, n, groups, d, dv, scale, max, sums, out, scores_mode, s, kp, len);
  }
  float sum[groups];
  for (int64_t g = 0; g < groups; ++g) {
    sum[g] = 0.f;
    for (int i = 0; i < BLOCK; ++i) sum[g] += sums[g * BLOCK + i];
    const float inv = 1.f / sum[g];
    for (int64_t j = 0; j < dv; ++j) out[g * dv + j] *= inv;
    if (a->lse) a->lse[r * groups + g] = max[g] + logf(sum[g]);
  }
  if (scores_mode == 1) {
    for (int64_t i = 0; i < len; ++i) scores[i] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const float inv = 1.f / sum[g];
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) scores[i] += exp_nonpos(kept[g * len + i] - max[g]) * inv;
    }
  }
  if (scores_mode) memset(scores + len, 0, sizeof(float) * (a->scores_width - len));
}

/* attend_row with the usual head sizes and query heads per KV head (1, 2, 4, 8) as constants (their loops
 * unrolled), others as variables. */
#define ATTEND_ROW_GROUPS(D, DV)                                      \
  switch (a->groups) {                                                \
  case 1: attend_row(a, r, len, D, DV, 1, kept); break;               \
  case 2: attend_row(a, r, len, D, DV, 2, kept); break;               \
  case 4: attend_row(a, r, len, D, DV, 4, kept); break;               \
  case 8: attend_row(a, r, len, D, DV, 8, kept); break;               \
  default: attend_row(a, r, len, D, DV, a->groups, kept);             \
  }
static void attend_row_sized(const struct attention *a, int64_t r, int64_t len, int64_t d, int64_t dv, float *kept) {
  if (d == 32 && dv == 32)
    ATTEND_ROW_GROUPS(32, 32)
  else if (d == 64 && dv == 64)
    ATTEND_ROW_GROUPS(64, 64)
  else if (d == 128 && dv == 128)
    ATTEND_ROW_GROUPS(128, 128)
  else
    attend_row(a, r, len, d, dv, a->groups, kept);
}

/* attend_row_sized with the logits buffer scores_mode 1 needs (groups x len); returns 1, the row not attended, when
 * out of memory. */
static int attend_row_scored(const struct attention *a, int64_t r, int64_t len, int64_t d, int64_t dv) {
  float *kept = a->scores_mode == 1 ? malloc(sizeof(float) * a->groups * len) : NULL;
  if (a->scores_mode == 1 && !kept) return 1;
  attend_row_sized(a, r, len, d, dv, kept);
  free(kept);
  return 0;
}

/* q [rows, groups, d], k_pages [P, page_size, d], v_pages [P, page_size, dv] (contiguous fp32);
 * block_table [rows, table_stride] int32 (row r's pages in order); seq_lens [rows] int64, or int32 when
 * lens_int32 (>= 1);
 * out [rows, groups, dv]; lse [rows, groups] or NULL; scores [rows, scores_width] or NULL.
 * slots [rows] int64 or NULL: row r's new entry, d values at k_new + (r / inner) * sk_outer + (r % inner) *
 * sk_inner (k_new [rows, d] with inner 1, or [b, inner, d]) and dv values of v_new likewise, is first written at
 * flat slot slots[r] (page * page_size + offset, one of the row's seq_lens[r] entries), then attended. */
int paged_decode_f32(const float *q, float *k_pages, float *v_pages, const int32_t *block_table,
                     int64_t table_stride, const void *seq_lens, int lens_int32, int64_t rows, int64_t groups, int64_t d,
                     int64_t dv, int64_t page_size, float scale, float *out, float *lse, float *scores,
                     int64_t scores_width, int scores_mode, int num_threads, const float *k_new,
                     int64_t sk_outer, int64_t sk_inner, const float *v_new, int64_t sv_outer, int64_t sv_inner,
                     int64_t inner, const int64_t *slots) {
  const struct attention a = {.q = q, .q_inner = 1, .q_outer = groups * d, .k_pages = k_pages, .v_pages = v_pages,
                              .block_table = block_table, .table_stride = table_stride, .groups = groups,
                              .page_size = page_size, .scale = scale, .out = out, .lse = lse, .scores = scores,
                              .scores_width = scores_width, .scores_mode = scores_mode};
  int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens_int32 ? ((const int32_t *)seq_lens)[r] : ((const int64_t *)seq_lens)[r];
    if (slots) { /* a row writes only its own entry and reads only its own pages: no race between threads */
      memcpy(k_pages + slots[r] * d, k_new + (r / inner) * sk_outer + (r % inner) * sk_inner, sizeof(float) * d);
      memcpy(v_pages + slots[r] * dv, v_new + (r / inner) * sv_outer + (r % inner) * sv_inner, sizeof(float) * dv);
    }
    if (attend_row_scored(&a, r, len, d, dv)) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed;
}

/* A decode step's update of each row: DMC's (kernels/paged/writes.py, dmc_cache_update_torch, is the same in tensor
 * ops), or, without a state (state, alpha, omega NULL), a plain append of the token (the full cache). The rows'
 * inputs: rows [n] int64; alpha [n] fp32, the hard decision (0 appends, anything else merges); omega [n] fp32; row
 * r's new key at k + (r / inner) * sk_outer + (r % inner) * sk_inner (d values: k [n, d] with inner 1, or [b, inner,
 * d]), its value likewise (dv values). The cache: ring slot j of pool row `row`'s open-slot state at state + row *
 * s_row + j * s_ring, the omega-weighted key (d values), value (dv values), then their omega; open_tokens [rows]
 * int64; seq_lens [rows] int32, the lengths before the step; block_table [rows, table_stride] int32, max_pages
 * columns used at most. */
struct dmc_step {
  const int64_t *rows;
  const float *alpha, *omega, *k;
  int64_t sk_outer, sk_inner;
  const float *v;
  int64_t sv_outer, sv_inner, inner;
  float *state;
  int64_t s_row, s_ring, *open_tokens;
  int32_t *seq_lens, *block_table;
  int64_t table_stride, max_pages;
  float *k_pages, *v_pages;
  int64_t n, ring, d, dv, page_size;
};

/* The pages of the step's appends: a row whose new entry starts a page (it appends, its last page full) takes
 * spare[--*left] as that page, in row order. spare NULL: the caller assigned them. Returns 0; 1 when fewer spare
 * pages are left than needed, 2 when a row would need more than max_pages pages: nothing changed then. */
static int take_pages(const struct dmc_step *s, const int32_t *spare, int64_t *left) {
  if (!spare) return 0;
  int64_t needed = 0;
  for (int64_t r = 0; r < s->n; ++r) {
    const int64_t len = s->seq_lens[s->rows[r]];
    if ((!s->alpha || s->alpha[r] == 0.f) && len % s->page_size == 0) {
      if (len / s->page_size >= s->max_pages) return 2;
      ++needed;
    }
  }
  if (needed > *left) return 1;
  for (int64_t r = 0; r < s->n; ++r) {
    const int64_t row = s->rows[r], len = s->seq_lens[row];
    if ((!s->alpha || s->alpha[r] == 0.f) && len % s->page_size == 0)
      s->block_table[row * s->table_stride + len / s->page_size] = spare[--*left];
  }
  return 0;
}

/* Row r's step (its page assigned). Without a state: the token becomes entry seq_lens[row], which grows by one.
 * DMC: an append adds one to seq_lens[row], zeroes the state and the token count; the weighted [k | v | 1] then adds
 * to the sums (ring 1: exact) or replaces the ring slot tokens % ring (window); the normalised state, sum u / sum z
 * over the ring, goes into entry seq_lens[row] - 1 of the row's pages. Returns the row's new length. */
INLINE int32_t update_row(const struct dmc_step *s, int64_t r) {
  const int64_t row = s->rows[r], ring = s->ring, s_ring = s->s_ring, d = s->d, dv = s->dv, width = d + dv + 1;
  const int64_t page_size = s->page_size;
  const float *k_new = s->k + (r / s->inner) * s->sk_outer + (r % s->inner) * s->sk_inner;
  const float *v_new = s->v + (r / s->inner) * s->sv_outer + (r % s->inner) * s->sv_inner;
  if (!s->state) {
    const int64_t entry = s->seq_lens[row]++;
    const int64_t at = (int64_t)s->block_table[row * s->table_stride + entry / page_size] * page_size + entry % page_size;
    memcpy(s->k_pages + at * d, k_new, sizeof(float) * d);
    memcpy(s->v_pages + at * dv, v_new, sizeof(float) * dv);
    return entry + 1;
  }
  float *u = s->state + row * s->s_row;
  if (s->alpha[r] == 0.f) {
    for (int64_t j = 0; j < ring; ++j) memset(u + j * s_ring, 0, sizeof(float) * width);
    s->open_tokens[row] = 0;
    s->seq_lens[row] += 1;
  }
  const float w = s->omega[r];
  float *slot = u + (ring == 1 ? 0 : s->open_tokens[row] % ring) * s_ring;
  for (int64_t c = 0; c < d; ++c) slot[c] = (ring == 1 ? slot[c] : 0.f) + k_new[c] * w;
  for (int64_t c = 0; c < dv; ++c) slot[d + c] = (ring == 1 ? slot[d + c] : 0.f) + v_new[c] * w;
  slot[d + dv] = (ring == 1 ? slot[d + dv] : 0.f) + w;
  s->open_tokens[row] += 1;
  const int64_t entry = s->seq_lens[row] - 1;
  const int64_t at = (int64_t)s->block_table[row * s->table_stride + entry / page_size] * page_size + entry % page_size;
  float *k_out = s->k_pages + at * d, *v_out = s->v_pages + at * dv, total = 0.f;
  for (int64_t j = 0; j < ring; ++j) total += u[j * s_ring + d + dv];
  for (int64_t c = 0; c < d + dv; ++c) {
    float sum = 0.f;
    for (int64_t j = 0; j < ring; ++j) sum += u[j * s_ring + c];
    *(c < d ? k_out + c : v_out + (c - d)) = sum / total; /* [k | v] side by side in the state */
  }
  return s->seq_lens[row];
}

#define DMC_STEP_ARGS                                                                                                 \
  const int64_t *rows, const float *alpha, const float *omega, const float *k, int64_t sk_outer, int64_t sk_inner,   \
      const float *v, int64_t sv_outer, int64_t sv_inner, int64_t inner, float *state, int64_t s_row, int64_t s_ring, \
      int64_t *open_tokens, int32_t *seq_lens, int32_t *block_table, int64_t table_stride, int64_t max_pages,        \
      float *k_pages, float *v_pages, int64_t n, int64_t ring, int64_t d, int64_t dv, int64_t page_size,             \
      const int32_t *spare, int64_t *left
#define DMC_STEP                                                                                                      \
  {rows, alpha, omega, k, sk_outer, sk_inner, v, sv_outer, sv_inner, inner, state, s_row, s_ring, open_tokens,       \
   seq_lens, block_table, table_stride, max_pages, k_pages, v_pages, n, ring, d, dv, page_size}

/* The step of each row (struct dmc_step), the appends' pages taken first (take_pages: its return value);
 * lens [n] int32: the rows' new lengths. */
int dmc_update_f32(DMC_STEP_ARGS, int32_t *lens) {
  const struct dmc_step s = DMC_STEP;
  const int failed = take_pages(&s, spare, left);
  if (failed) return failed;
  for (int64_t r = 0; r < n; ++r) lens[r] = update_row(&s, r);
  return 0;
}

/* dmc_update_f32 (or, state NULL, every row's plain append), then each row's attention (as paged_decode_f32) of
 * q [n, groups, d] over its entries, the new one included: out [n, groups, dv]. One call per layer of a decode
 * step; rows spread over the threads (a row's step touches only its own state, length and entry). */
int decode_step_f32(DMC_STEP_ARGS, const float *q, int64_t groups, float scale, float *out, int num_threads) {
  const struct dmc_step s = DMC_STEP;
  const int failed = take_pages(&s, spare, left);
  if (failed) return failed;
  const struct attention a = {.q = q, .q_inner = 1, .q_outer = groups * d, .k_pages = k_pages, .v_pages = v_pages,
                              .block_table = block_table, .rows = rows, .table_stride = table_stride,
                              .groups = groups, .page_size = page_size, .scale = scale, .out = out};
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t r = 0; r < n; ++r) attend_row_sized(&a, r, update_row(&s, r), d, dv, NULL);
  return 0;
}

/* A layer's decode step (decode_step_f32) whose inputs are the layer's projected heads, for a caller that computes
 * them (kernels/layer's layer_decode_f32 and layer_attend_output_f32, which call this by address between the
 * projection and the output): heads [B, token_stride] per token, its H = kv_heads * groups query heads of d values,
 * then the kv_heads keys, then the values (dv each), row r = b * kv_heads + j being token b's KV head j; out [B, H *
 * dv]. DMC with the open-slot state: the decisions alpha, omega [n] given, or (shift set) decided here from the
 * decision channel's values before RoPE, channel [B, H + kv_heads] (decide); else a plain append. The rest as
 * decode_step_f32 (rows [n], n = B * kv_heads). With slots (an eviction policy's step: its rows grown and their victims
 * chosen by the caller), each row's entry is written at its entry slots[r] and the attention may also write each
 * entry's score, as paged_decode_f32. */
struct decode_call {
  const int64_t *rows;
  int64_t n;
  int32_t *seq_lens, *block_table;
  int64_t table_stride, max_pages;
  float *k_pages, *v_pages;
  int64_t page_size, d, dv, groups, kv_heads, token_stride;
  const int32_t *spare;
  int64_t *left;
  const float *alpha, *omega;
  float *state;
  int64_t s_row, s_ring, ring;
  int64_t *open_tokens;
  const float *shift; /* [B, kv_heads]: added to the key's channel (DMC's -c0, -inf at a sequence's first token) */
  float threshold, offset, eps;
  float scale;
  int num_threads;
  const int64_t *slots; /* [n] or NULL: row r's new entry written at entry slots[r] of its row (write_at), not appended */
  float *scores;        /* [n, scores_width] or NULL: each entry's score (scores_mode 1 "probs", 2 "logits") */
  int64_t scores_width;
  int scores_mode;
};

/* DMC's decisions of row r (token b, KV head j) from the channel values: alpha = [k_c + shift > threshold] exactly as
 * PyTorch's add and compare; omega = sigmoid(mean of the group's q_c + offset) + eps, the sigmoid and the mean within
 * a few ulp of PyTorch's vectorised ones. */
static void decide(const struct decode_call *c, const float *channel, float *alpha, float *omega) {
  const int64_t kv = c->kv_heads, groups = c->groups, width = kv * groups + kv;
  for (int64_t r = 0; r < c->n; ++r) {
    const float *token = channel + (r / kv) * width;
    const int64_t j = r % kv;
    alpha[r] = token[kv * groups + j] + c->shift[r] > c->threshold ? 1.f : 0.f;
    float q = 0.f;
    for (int64_t g = 0; g < groups; ++g) q += token[j * groups + g];
    q = groups == 1 ? q : q / (float)groups;
    omega[r] = 1.f / (1.f + expf(-(q + c->offset))) + c->eps;
  }
}

/* Row r's new entry written at entry `entry` of its row, one its length already counts (an eviction policy's victim,
 * or the entry a row below its budget grew by); returns the row's length. */
INLINE int64_t write_at(const struct dmc_step *s, int64_t r, int64_t entry) {
  const int64_t row = s->rows[r], page_size = s->page_size;
  const int64_t at = (int64_t)s->block_table[row * s->table_stride + entry / page_size] * page_size + entry % page_size;
  memcpy(s->k_pages + at * s->d, s->k + (r / s->inner) * s->sk_outer + (r % s->inner) * s->sk_inner,
         sizeof(float) * s->d);
  memcpy(s->v_pages + at * s->dv, s->v + (r / s->inner) * s->sv_outer + (r % s->inner) * s->sv_inner,
         sizeof(float) * s->dv);
  return s->seq_lens[row];
}

/* Returns 0, take_pages' code, 3 when a DMC step has no decisions, -1 when out of memory. */
int decode_call_f32(const struct decode_call *c, const float *heads, const float *channel, float *out) {
  const int64_t d = c->d, kv = c->kv_heads, q_width = kv * c->groups * d;
  float *decided = NULL;
  const float *alpha = c->alpha, *omega = c->omega;
  if (c->state && channel && c->shift) {
    decided = malloc(sizeof(float) * 2 * (c->n ? c->n : 1));
    if (!decided) return -1;
    decide(c, channel, decided, decided + c->n);
    alpha = decided;
    omega = decided + c->n;
  } else if (c->state && !alpha) {
    return 3;
  }
  const struct dmc_step s = {.rows = c->rows, .alpha = alpha, .omega = omega, .k = heads + q_width,
                             .sk_outer = c->token_stride, .sk_inner = d, .v = heads + q_width + kv * d,
                             .sv_outer = c->token_stride, .sv_inner = c->dv, .inner = kv, .state = c->state,
                             .s_row = c->s_row, .s_ring = c->s_ring, .open_tokens = c->open_tokens,
                             .seq_lens = c->seq_lens, .block_table = c->block_table, .table_stride = c->table_stride,
                             .max_pages = c->max_pages, .k_pages = c->k_pages, .v_pages = c->v_pages, .n = c->n,
                             .ring = c->ring, .d = d, .dv = c->dv, .page_size = c->page_size};
  int failed = take_pages(&s, c->spare, c->left);
  if (!failed) {
    const struct attention a = {.q = heads, .q_inner = kv, .q_outer = c->token_stride, .k_pages = c->k_pages,
                                .v_pages = c->v_pages, .block_table = c->block_table, .rows = c->rows,
                                .table_stride = c->table_stride, .groups = c->groups, .page_size = c->page_size,
                                .scale = c->scale, .out = out, .scores = c->scores,
                                .scores_width = c->scores_width, .scores_mode = c->scores_mode};
#pragma omp parallel for schedule(dynamic, 1) num_threads(c->num_threads)
    for (int64_t r = 0; r < c->n; ++r) {
      const int64_t len = c->slots ? write_at(&s, r, c->slots[r]) : update_row(&s, r);
      if (attend_row_scored(&a, r, len, d, c->dv)) {
#pragma omp atomic write
        failed = -1;
      }
    }
  }
  free(decided);
  return failed;
}
