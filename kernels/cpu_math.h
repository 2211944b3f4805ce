/* Math shared by the CPU kernels (kernels/<family>/cpu_kernel.c include it; kernels/compiled.py keys each
 * build on it too). */
#ifndef DMC_TRAIN_CPU_MATH_H
#define DMC_TRAIN_CPU_MATH_H
#include <stdint.h>

/* exp(x) for x <= 0 in plain arithmetic that the compiler vectorises: x = n ln2 + r with n an integer and
 * |r| <= ln2 / 2, exp(r) by its Taylor polynomial to r^7 (relative error below 1e-7), times 2^n made in the
 * exponent bits. n = x log2(e) rounded: adding 1.5 * 2^23 rounds it to an integer and leaves it in the low
 * bits. Below -87.3 (exp < 2^-126) it returns 0; NaN stays NaN. */
static inline __attribute__((always_inline)) float exp_nonpos(float x) {
  const float y = x < -87.3f ? -87.3f : x;
  const union { float f; uint32_t u; } rounded = {.f = y * 1.44269504f + 12582912.f};
  const float n = rounded.f - 12582912.f;
  const float r = (y - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 in two parts: n * the first is exact */
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const union { uint32_t u; float f; } two_n = {.u = (rounded.u - 0x4B400000u + 127u) << 23};
  return x < -87.3f ? 0.f : p * two_n.f;
}

#endif
