/* A Llama decoder layer's dense work at inference on CPU, fp32: everything of the layer but its attention, in
 * two calls (kernels/layer/cpu.py states the layouts; reference.py is the same in tensor ops).
 *
 * A decode step's layer is some twenty small tensor ops around four matrix products; each op costs a few
 * microseconds of dispatch, more than its arithmetic on a few rows. Here the products of a decode step's few rows
 * run this file's own loops over the weights packed in column strips, those of more rows (a prefill's) the BLAS
 * that PyTorch itself calls (sgemm_, whose address cpu.py hands over: the same routine torch.mm runs for these
 * layouts), and the rest (RMSNorm, RoPE of q and k, the residual adds, SwiGLU) are loops over the rows. RoPE is
 * PyTorch's arithmetic, bit for bit (products rounded before they are added: -ffp-contract=off); RMSNorm's sum
 * and SwiGLU's exp round differently from PyTorch's vectorised ones (within a few ulp). The loops spread their rows
 * over the OpenMP threads from PARALLEL_ROWS rows on (a prefill's; a decode step's few rows stay on one thread, where
 * waking the others costs more than they save); a row's arithmetic is the same either way.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cpu_math.h" /* exp_nonpos */

#define INLINE static inline __attribute__((always_inline))

#define PARALLEL_ROWS 64

typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b, const int *ldb,
                         const float *beta, float *c, const int *ldc);
static sgemm_fn sgemm;
static int threads = 1; /* the products' and (from PARALLEL_ROWS rows) the loops' threads: PyTorch's (cpu.py) */

void set_sgemm(void *f) { sgemm = (sgemm_fn)f; }
void set_threads(int n) { threads = n; }

/* n floats aligned to 64 bytes, as PyTorch allocates: MKL's results may depend on its operands' alignment, and
 * a product must not change with where malloc put its input. */
static float *scratch(int64_t n) {
  const size_t bytes = (sizeof(float) * n + 63) / 64 * 64; /* aligned_alloc wants a multiple of the alignment */
  return aligned_alloc(64, bytes ? bytes : 64);
}

/* The products of a few rows (a decode step's tokens: up to SKINNY_ROWS) in this file's own loops, over the weight
 * packed in column strips (below). MKL's sgemm reads the weights at a fraction of the memory bandwidth for so few
 * rows (on this project's AMD EPYC machines 2-3x slower than these loops while the weights sit in the caches, and
 * 0.7x at one row from memory, docs/BENCHMARKS.md). One row runs them too, so that a row's result is the same in
 * any batch of up to SKINNY_ROWS rows.
 * Packed weight: w [k, n] as packed [ceil(n / STRIP), k, STRIP], strip b holding columns b STRIP .. (b + 1) STRIP
 * (zeros past n) row after row, contiguous: a strip streams from memory at the copy bandwidth, where the same
 * columns of w [k, n] are 256 bytes of rows a page or more apart (2x slower from memory). The threads split the
 * strips; for up to TILE_ROWS rows at a time every row's sums of a strip's STRIP columns (four vector registers)
 * stay in registers while its rows stream past. The sums run over k in chunks of KC (each chunk's partial sums
 * added to the output: rounding grows with KC, not with k; a chunk of a strip is read from L2 by the next rows'
 * tile), with fused multiply-adds (contracted here alone: the rest of the file keeps PyTorch's rounding). A row's
 * result does not depend on the other rows of the call. */
#define SKINNY_ROWS 32
#define KC 256
#if defined(__AVX512F__)
#define VEC 16      /* floats per vector register */
#define TILE_ROWS 6 /* rows whose sums stay in registers: TILE_ROWS x 4 accumulators + 4 of w in 32 registers */
#else
#define VEC 8
#define TILE_ROWS 3 /* 16 registers: 12 accumulators, w read from L1 by the multiply-adds */
#endif
#define STRIP (4 * VEC)

int strip_width(void) { return STRIP; }
int skinny_rows(void) { return SKINNY_ROWS; }

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
typedef float vec __attribute__((vector_size(4 * VEC), aligned(4))); /* loads and stores unaligned */

/* Rows x [R, k] times the strip p [k, STRIP] over k in [k0, k1), into out [R, STRIP] (rows ldo apart; add: onto it). */
INLINE void product_tile(const float *x, int64_t k, const float *p, int64_t k0, int64_t k1, float *out, int64_t ldo,
                         int add, const int R) {
  vec acc[TILE_ROWS][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = (vec){0};
  for (int64_t i = k0; i < k1; ++i) {
    const vec *wi = (const vec *)(p + i * STRIP);
    const vec w0 = wi[0], w1 = wi[1], w2 = wi[2], w3 = wi[3];
    for (int r = 0; r < R; ++r) {
      const float a = x[r * k + i];
      acc[r][0] += a * w0;
      acc[r][1] += a * w1;
      acc[r][2] += a * w2;
      acc[r][3] += a * w3;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      vec *o = (vec *)(out + r * ldo + VEC * c);
      *o = add ? *o + acc[r][c] : acc[r][c];
    }
}

/* product_tile with R (1..TILE_ROWS) a constant in each copy. */
static void product_rows(const float *x, int64_t k, const float *p, int64_t k0, int64_t k1, float *out, int64_t ldo,
                         int add, int R) {
  switch (R) {
#define TILE(R_) product_tile(x, k, p, k0, k1, out, ldo, add, R_)
  case 1: TILE(1); break;
  case 2: TILE(2); break;
#if TILE_ROWS == 6
  case 3: TILE(3); break;
  case 4: TILE(4); break;
  case 5: TILE(5); break;
#endif
  default: TILE(TILE_ROWS);
#undef TILE
  }
}

/* y [t, n] = x [t, k] @ w [k, n], t <= SKINNY_ROWS, from w packed: the threads split the strips; per strip, for each
 * chunk of k, TILE_ROWS rows at a time. A strip past n (the last, when STRIP does not divide n) sums into part. */
static void skinny_matmul(const float *x, const float *packed, float *y, int64_t t, int64_t k, int64_t n) {
  const int64_t strips = (n + STRIP - 1) / STRIP;
#pragma omp parallel for schedule(static) num_threads(threads) if (strips > 1)
  for (int64_t b = 0; b < strips; ++b) {
    const float *p = packed + b * k * STRIP;
    const int64_t j = b * STRIP, width = n - j < STRIP ? n - j : STRIP;
    float part[width < STRIP ? SKINNY_ROWS * STRIP : 1];
    float *out = width < STRIP ? part : y + j;
    const int64_t ldo = width < STRIP ? STRIP : n;
    for (int64_t k0 = 0; k0 < k; k0 += KC)
      for (int64_t r0 = 0; r0 < t; r0 += TILE_ROWS)
        product_rows(x + r0 * k, k, p, k0, k0 + KC < k ? k0 + KC : k, out + r0 * ldo, ldo, k0 > 0,
                     t - r0 < TILE_ROWS ? (int)(t - r0) : TILE_ROWS);
    if (width < STRIP)
      for (int64_t r = 0; r < t; ++r) memcpy(y + r * n + j, part + r * STRIP, sizeof(float) * width);
  }
}
#pragma GCC pop_options

/* y [t, n] = x [t, k] @ w [k, n], row-major and contiguous: skinny_matmul from packed (w packed, above) up to
 * SKINNY_ROWS rows when given, else sgemm on w. In BLAS's column-major terms y^T = w^T x^T, with no transposes: the
 * call torch.mm makes for these layouts. */
static void matmul(const float *x, const float *w, const float *packed, float *y, int64_t t, int64_t k, int64_t n) {
  const int rows = (int)t, inner = (int)k, cols = (int)n;
  const float one = 1.f, zero = 0.f;
  if (t == 0 || n == 0) return; /* BLAS refuses a leading dimension of 0 */
  if (k == 0) {
    memset(y, 0, sizeof(float) * t * n);
    return;
  }
  if (packed && t <= SKINNY_ROWS) {
    skinny_matmul(x, packed, y, t, k, n);
    return;
  }
  sgemm("N", "N", &cols, &rows, &inner, &one, w, &cols, x, &inner, &zero, y, &cols);
}

/* y = x * rsqrt(mean(x^2) + eps) * w, row by row (x [t, h]). */
static void rms_norm(const float *x, const float *w, float eps, float *y, int64_t t, int64_t h) {
#pragma omp parallel for num_threads(threads) if (t >= PARALLEL_ROWS)
  for (int64_t r = 0; r < t; ++r) {
    const float *xr = x + r * h;
    float *yr = y + r * h;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < h; ++c) sum += xr[c] * xr[c];
    const float rstd = 1.f / sqrtf(sum / (float)h + eps);
    for (int64_t c = 0; c < h; ++c) yr[c] = xr[c] * rstd * w[c];
  }
}

/* Rotate-half RoPE in place of the first `heads` heads (d values each) of each row of y [t, width]:
 * x * cos + roll(x, d / 2) * sin, cos [t, d], sin [t, sin_heads, d] (sin_heads 1: shared by the heads, else one
 * table per head), the sine signed as models/rope.py's rope_tables makes it. channel_out [t, heads] (or NULL):
 * each head's value at `channel` before its rotation. */
static void rope(float *y, int64_t t, int64_t width, int64_t heads, int64_t d, const float *cos, const float *sin,
                 int64_t sin_heads, int64_t channel, float *channel_out) {
  const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) if (t >= PARALLEL_ROWS)
  for (int64_t r = 0; r < t; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float x[d];
      float *yh = y + r * width + h * d;
      const float *c = cos + r * d, *s = sin + (r * sin_heads + (sin_heads == 1 ? 0 : h)) * d;
      memcpy(x, yh, sizeof(float) * d);
      if (channel_out) channel_out[r * heads + h] = x[channel];
      for (int64_t i = 0; i < half; ++i) yh[i] = x[i] * c[i] + x[i + half] * s[i];
      for (int64_t i = half; i < d; ++i) yh[i] = x[i] * c[i] + x[i - half] * s[i];
    }
}

/* y [t, n] = rms_norm(x [t, h], norm_w) @ w [h, n] (w_packed: w packed, or NULL; matmul); then, if cos is given,
 * RoPE of y's first rope_heads heads of head_dim values (rope above, with channel_out). Returns nonzero when out of
 * memory. */
int rms_norm_matmul_f32(const float *x, const float *norm_w, float eps, const float *w, const float *w_packed,
                        float *y, int64_t t, int64_t h, int64_t n, const float *cos, const float *sin,
                        int64_t sin_heads, int64_t rope_heads, int64_t head_dim, int64_t channel, float *channel_out) {
  float *normed = scratch(t * h);
  if (!normed) return 1;
  rms_norm(x, norm_w, eps, normed, t, h);
  matmul(normed, w, w_packed, y, t, h, n);
  free(normed);
  if (cos) rope(y, t, n, rope_heads, head_dim, cos, sin, sin_heads, channel, channel_out);
  return 0;
}

/* silu(gate) * up for each row of gate_up [t, 2 f] (gate then up) into act [t, f]. silu(g) = g / (1 + exp(-g)),
 * with exp of -|g| only (no overflow): g >= 0: g / (1 + e); g < 0: g e / (1 + e), e = exp(-|g|). */
static void swiglu(const float *gate_up, float *act, int64_t t, int64_t f) {
#pragma omp parallel for num_threads(threads) if (t >= PARALLEL_ROWS)
  for (int64_t r = 0; r < t; ++r) {
    const float *g = gate_up + r * 2 * f, *u = g + f;
    float *a = act + r * f;
#pragma omp simd
    for (int64_t c = 0; c < f; ++c) {
      const float e = exp_nonpos(g[c] < 0.f ? g[c] : -g[c]);
      a[c] = (g[c] < 0.f ? g[c] * e : g[c]) / (1.f + e) * u[c];
    }
  }
}

/* y = a + b over [t, h]. */
static void add(const float *a, const float *b, float *y, int64_t t, int64_t h) {
#pragma omp parallel for num_threads(threads) if (t >= PARALLEL_ROWS)
  for (int64_t r = 0; r < t; ++r)
#pragma omp simd
    for (int64_t c = r * h; c < (r + 1) * h; ++c) y[c] = a[c] + b[c];
}

/* The layer after its attention: y = x + attn @ o_w, then y += swiglu(rms_norm(y) @ gate_up_w) @ down_w.
 * x, y [t, h]; attn [t, a]; o_w [a, h]; gate_up_w [h, 2 f]; down_w [f, h]; each with its packed copy or NULL (o_p,
 * gate_up_p, down_p; matmul). Returns nonzero when out of memory. */
int layer_output_f32(const float *x, const float *attn, const float *o_w, const float *o_p, const float *norm_w,
                     float eps, const float *gate_up_w, const float *gate_up_p, const float *down_w,
                     const float *down_p, float *y, int64_t t, int64_t h, int64_t a, int64_t f) {
  float *tmp = scratch(t * h), *normed = scratch(t * h), *gate_up = scratch(t * 2 * f), *act = scratch(t * f);
  const int failed = !tmp || !normed || !gate_up || !act;
  if (!failed) {
    matmul(attn, o_w, o_p, tmp, t, a, h);
    add(x, tmp, y, t, h);
    rms_norm(y, norm_w, eps, normed, t, h);
    matmul(normed, gate_up_w, gate_up_p, gate_up, t, h, 2 * f);
    swiglu(gate_up, act, t, f);
    matmul(act, down_w, down_p, tmp, t, f, h);
    add(y, tmp, y, t, h);
  }
  free(tmp);
  free(normed);
  free(gate_up);
  free(act);
  return failed;
}

/* A decode step's layer from its projected heads [t, n] on, its attention given as a C function (a cache's,
 * kernels/paged's decode_call_f32, passed by address with its context): attn [t, a] = attention(ctx, heads, channel,
 * attn) (channel: the heads' decision-channel values before RoPE [t, rope_heads], or NULL), then y =
 * layer_output_f32. Returns 0, the attention's nonzero code (the output is not computed then), or -1 when out of
 * memory. */
typedef int (*attention_fn)(const void *ctx, const float *heads, const float *channel, float *attn);

static int attend_output(const float *x, const float *heads, const float *channel, void *attention, const void *ctx,
                         int64_t a, const float *o_w, const float *o_p, const float *norm_mlp_w, float eps,
                         const float *gate_up_w, const float *gate_up_p, const float *down_w, const float *down_p,
                         int64_t t, int64_t h, int64_t f, float *y) {
  float *attn = scratch(t * a);
  int code = -1;
  if (attn) {
    code = ((attention_fn)attention)(ctx, heads, channel, attn);
    if (!code && layer_output_f32(x, attn, o_w, o_p, norm_mlp_w, eps, gate_up_w, gate_up_p, down_w, down_p, y, t, h,
                                  a, f))
      code = -1;
  }
  free(attn);
  return code;
}

int layer_attend_output_f32(const float *x, const float *heads, void *attention, const void *ctx, int64_t a,
                            const float *o_w, const float *o_p, const float *norm_mlp_w, float eps,
                            const float *gate_up_w, const float *gate_up_p, const float *down_w, const float *down_p,
                            int64_t t, int64_t h, int64_t f, float *y) {
  return attend_output(x, heads, NULL, attention, ctx, a, o_w, o_p, norm_mlp_w, eps, gate_up_w, gate_up_p, down_w,
                       down_p, t, h, f, y);
}

/* The whole layer: heads [t, n] = rms_norm_matmul_f32 (RoPE of the first rope_heads heads; channel >= 0: their
 * values at that channel before RoPE handed to the attention too), then the attention and the output as
 * layer_attend_output_f32. */
int layer_decode_f32(const float *x, const float *norm_in_w, float eps, const float *qkv_w, const float *qkv_p,
                     int64_t t, int64_t h, int64_t n, const float *cos, const float *sin, int64_t sin_heads,
                     int64_t rope_heads, int64_t head_dim, int64_t channel, void *attention, const void *ctx,
                     int64_t a, const float *o_w, const float *o_p, const float *norm_mlp_w, const float *gate_up_w,
                     const float *gate_up_p, const float *down_w, const float *down_p, int64_t f, float *y) {
  float *heads = scratch(t * n), *values = channel >= 0 ? scratch(t * rope_heads) : NULL;
  int code = -1;
  if (heads && (channel < 0 || values) &&
      !rms_norm_matmul_f32(x, norm_in_w, eps, qkv_w, qkv_p, heads, t, h, n, cos, sin, sin_heads, rope_heads,
                           head_dim, channel < 0 ? 0 : channel, values))
    code = attend_output(x, heads, values, attention, ctx, a, o_w, o_p, norm_mlp_w, eps, gate_up_w, gate_up_p,
                         down_w, down_p, t, h, f, y);
  free(heads);
  free(values);
  return code;
}
