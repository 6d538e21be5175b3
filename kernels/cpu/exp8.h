/* 8 floats at a time for the CPU kernels: the vector types (GCC's generic vectors: one AVX register, or
 * two SSE/NEON ones) and exp8. */
#ifndef TOKENMILL_EXP8_H
#define TOKENMILL_EXP8_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* exp of 8 floats, within 2 ulp of expf (Cephes' expf: a Cody-Waite reduction by ln 2, a degree-6
   polynomial, the exponent put back in the bits); arguments clamped to +-88.37, where expf is finite. */
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }

static inline v8f exp8(v8f x) {
    const v8f hi = (v8f){0} + 88.3762626647949f, lo = -hi;
    x = select8(x > hi, hi, x);
    x = select8(x < lo, lo, x);
    v8f n = x * 1.44269504088896341f;
    const v8f half = (v8f)(((v8i)n & (int32_t)0x80000000) | (v8i)((v8f){0} + 0.5f)); /* 0.5 with n's sign */
    n = __builtin_convertvector(__builtin_convertvector(n + half, v8i), v8f); /* n rounded to nearest */
    x = x - n * 0.693359375f;
    x = x + n * 2.12194440e-4f;
    v8f y = (v8f){0} + 1.9875691500E-4f;
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * (x * x) + x + 1.0f;
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23; /* 2^n: n in [-127, 128] after the clamp */
    v8f scale;
    memcpy(&scale, &bits, 32);
    return y * scale;
}

#endif
