/* A Llama decoder layer's dense work at inference on CPU, fp32: everything of the layer but its attention, in
 * two calls (kernels/layer/cpu.py states the layouts; reference.py is the same in tensor ops).
 *
 * A decode step's layer is some twenty small tensor ops around four matrix products; each op costs a few
 * microseconds of dispatch, more than its arithmetic on a few rows. Here the products go to the BLAS that
 * PyTorch itself calls (sgemm_, whose address cpu.py hands over: the same routine torch.mm runs for these
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

/* The products of a few rows (a decode step's tokens: up to SKINNY_ROWS) in this file's own loops. MKL's sgemm
 * reads the weights at a fraction of the memory bandwidth for so few rows (on this project's AMD EPYC machines 2-3x
 * slower than these loops while the weights sit in the caches, docs/BENCHMARKS.md). One row runs them too (MKL's
 * matrix-vector product streams weights from memory faster, 1.3x on two threads for a 7B layer's), so that a row's
 * result is the same in any batch of up to SKINNY_ROWS rows.
 * Columns are taken four vectors at a time, the threads splitting them; for up to TILE_ROWS rows at a time every
 * row's sums of those columns stay in registers while the weights' rows stream past, each PREFETCH rows ahead
 * asked for (the rows are n floats apart, often a page or more: the hardware's prefetchers do not follow them).
 * The sums run over k in chunks of KC (each chunk's partial sums added to the output: rounding grows with KC, not
 * with k), with fused multiply-adds (contracted here alone: the rest of the file keeps PyTorch's rounding). A row's
 * result does not depend on the other rows of the call. */
#define SKINNY_ROWS 32
#define KC 256
#define PREFETCH 16
#if defined(__AVX512F__)
#define VEC 16 /* floats per vector register */
#define TILE_ROWS 8 /* rows whose sums stay in registers: TILE_ROWS x 2 accumulators + 2 of w in 32 registers */
#else
#define VEC 8
#define TILE_ROWS 6 /* 16 registers */
#endif
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
typedef float vec __attribute__((vector_size(4 * VEC), aligned(4))); /* loads and stores unaligned */

/* Rows x [R, k] times columns j..j+V*VEC of w [k, n] (V vectors), over k in [k0, k1), into y [R, n] (add: onto it). */
INLINE void product_tile(const float *x, const float *w, float *y, int64_t k, int64_t n, int64_t j, int64_t k0,
                         int64_t k1, int add, const int R, const int V) {
  vec acc[TILE_ROWS][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) acc[r][c] = (vec){0};
  for (int64_t i = k0; i < k1; ++i) {
    vec wi[4];
    for (int c = 0; c < V; ++c) __builtin_prefetch(w + (i + PREFETCH) * n + j + VEC * c);
    for (int c = 0; c < V; ++c) wi[c] = *(const vec *)(w + i * n + j + VEC * c);
    for (int r = 0; r < R; ++r) {
      const float a = x[r * k + i];
      for (int c = 0; c < V; ++c) acc[r][c] += a * wi[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) {
      vec *out = (vec *)(y + r * n + j + VEC * c);
      *out = add ? *out + acc[r][c] : acc[r][c];
    }
}

/* Columns j..j+V*VEC of R <= TILE_ROWS rows, k in chunks of KC: V up to 4 for one or two rows (more sums in flight,
 * longer reads of each weight row), up to 2 for more (their sums fill the registers); R and V constants in each
 * copy. Each column's sum is the same whatever the tile. */
static void product_columns(const float *x, const float *w, float *y, int64_t k, int64_t n, int64_t j, int R, int V) {
  for (int64_t k0 = 0; k0 < k; k0 += KC) {
    const int64_t k1 = k0 + KC < k ? k0 + KC : k;
#define TILE(R_, V_) product_tile(x, w, y, k, n, j, k0, k1, k0 > 0, R_, V_)
#define NARROW(R_) (V == 2 ? TILE(R_, 2) : TILE(R_, 1))
#define WIDE(R_) (V == 4 ? TILE(R_, 4) : V == 3 ? TILE(R_, 3) : NARROW(R_))
    switch (R) {
    case 1: WIDE(1); break;
    case 2: WIDE(2); break;
    case 3: NARROW(3); break;
    case 4: NARROW(4); break;
    case 5: NARROW(5); break;
#if TILE_ROWS == 8
    case 6: NARROW(6); break;
    case 7: NARROW(7); break;
#endif
    default: NARROW(TILE_ROWS);
    }
#undef WIDE
#undef NARROW
#undef TILE
  }
}

/* y [t, n] = x [t, k] @ w [k, n]: the threads split the blocks of 4 VEC columns; per block, TILE_ROWS rows at a time
 * (so each row of w is read once per TILE_ROWS rows), the columns past a multiple of VEC one by one. */
static void skinny_matmul(const float *x, const float *w, float *y, int64_t t, int64_t k, int64_t n) {
  const int64_t blocks = (n + 4 * VEC - 1) / (4 * VEC);
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t r0 = 0; r0 < t; r0 += TILE_ROWS) {
      const int R = t - r0 < TILE_ROWS ? (int)(t - r0) : TILE_ROWS;
      const float *xr = x + r0 * k;
      float *yr = y + r0 * n;
      const int64_t j = b * 4 * VEC, width = n - j < 4 * VEC ? n - j : 4 * VEC, vectors = width / VEC;
      const int64_t step = R <= 2 ? 4 : 2;
      for (int64_t v = 0; v < vectors; v += step)
        product_columns(xr, w, yr, k, n, j + v * VEC, R, (int)(vectors - v < step ? vectors - v : step));
      for (int64_t c = j + vectors * VEC; c < j + width; ++c)
        for (int r = 0; r < R; ++r) {
          float sum = 0.f;
          for (int64_t i = 0; i < k; ++i) sum += xr[r * k + i] * w[i * n + c];
          yr[r * n + c] = sum;
        }
    }
}
#pragma GCC pop_options

/* y [t, n] = x [t, k] @ w [k, n], row-major and contiguous: skinny_matmul up to SKINNY_ROWS rows, else sgemm. In
 * BLAS's column-major terms y^T = w^T x^T, with no transposes: the call torch.mm makes for these layouts. */
static void matmul(const float *x, const float *w, float *y, int64_t t, int64_t k, int64_t n) {
  const int rows = (int)t, inner = (int)k, cols = (int)n;
  const float one = 1.f, zero = 0.f;
  if (t == 0 || n == 0) return; /* BLAS refuses a leading dimension of 0 */
  if (k == 0) {
    memset(y, 0, sizeof(float) * t * n);
    return;
  }
  if (t <= SKINNY_ROWS) {
    skinny_matmul(x, w, y, t, k, n);
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

/* y [t, n] = rms_norm(x [t, h], norm_w) @ w [h, n]; then, if cos is given, RoPE of y's first rope_heads heads of
 * head_dim values (rope above, with channel_out). Returns nonzero when out of memory. */
int rms_norm_matmul_f32(const float *x, const float *norm_w, float eps, const float *w, float *y, int64_t t,
                         int64_t h, int64_t n, const float *cos, const float *sin, int64_t sin_heads,
                         int64_t rope_heads, int64_t head_dim, int64_t channel, float *channel_out) {
  float *normed = scratch(t * h);
  if (!normed) return 1;
  rms_norm(x, norm_w, eps, normed, t, h);
  matmul(normed, w, y, t, h, n);
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
 * x, y [t, h]; attn [t, a]; o_w [a, h]; gate_up_w [h, 2 f]; down_w [f, h]. Returns nonzero when out of memory. */
int layer_output_f32(const float *x, const float *attn, const float *o_w, const float *norm_w, float eps,
                     const float *gate_up_w, const float *down_w, float *y, int64_t t, int64_t h, int64_t a,
                     int64_t f) {
  float *tmp = scratch(t * h), *normed = scratch(t * h), *gate_up = scratch(t * 2 * f), *act = scratch(t * f);
  const int failed = !tmp || !normed || !gate_up || !act;
  if (!failed) {
    matmul(attn, o_w, tmp, t, a, h);
    add(x, tmp, y, t, h);
    rms_norm(y, norm_w, eps, normed, t, h);
    matmul(normed, gate_up_w, gate_up, t, h, 2 * f);
    swiglu(gate_up, act, t, f);
    matmul(act, down_w, tmp, t, f, h);
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
                         int64_t a, const float *o_w, const float *norm_mlp_w, float eps, const float *gate_up_w,
                         const float *down_w, int64_t t, int64_t h, int64_t f, float *y) {
  float *attn = scratch(t * a);
  int code = -1;
  if (attn) {
    code = ((attention_fn)attention)(ctx, heads, channel, attn);
    if (!code && layer_output_f32(x, attn, o_w, norm_mlp_w, eps, gate_up_w, down_w, y, t, h, a, f)) code = -1;
  }
  free(attn);
  return code;
}

int layer_attend_output_f32(const float *x, const float *heads, void *attention, const void *ctx, int64_t a,
                            const float *o_w, const float *norm_mlp_w, float eps, const float *gate_up_w,
                            const float *down_w, int64_t t, int64_t h, int64_t f, float *y) {
  return attend_output(x, heads, NULL, attention, ctx, a, o_w, norm_mlp_w, eps, gate_up_w, down_w, t, h, f, y);
}

/* The whole layer: heads [t, n] = rms_norm_matmul_f32 (RoPE of the first rope_heads heads; channel >= 0: their
 * values at that channel before RoPE handed to the attention too), then the attention and the output as
 * layer_attend_output_f32. */
int layer_decode_f32(const float *x, const float *norm_in_w, float eps, const float *qkv_w, int64_t t, int64_t h,
                     int64_t n, const float *cos, const float *sin, int64_t sin_heads, int64_t rope_heads,
                     int64_t head_dim, int64_t channel, void *attention, const void *ctx, int64_t a,
                     const float *o_w, const float *norm_mlp_w, const float *gate_up_w, const float *down_w,
                     int64_t f, float *y) {
  float *heads = scratch(t * n), *values = channel >= 0 ? scratch(t * rope_heads) : NULL;
  int code = -1;
  if (heads && (channel < 0 || values) &&
      !rms_norm_matmul_f32(x, norm_in_w, eps, qkv_w, heads, t, h, n, cos, sin, sin_heads, rope_heads, head_dim,
                           channel < 0 ? 0 : channel, values))
    code = attend_output(x, heads, values, attention, ctx, a, o_w, norm_mlp_w, eps, gate_up_w, down_w, t, h, f, y);
  free(heads);
  free(values);
  return code;
}
