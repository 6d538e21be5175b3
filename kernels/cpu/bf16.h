/* bfloat16 <-> float for the CPU kernels: a bf16 is the top half of an fp32; rounding to it is to
 * nearest even, as torch rounds, and a NaN stays a NaN. One at a time, and 8 at a time (exp8.h's
 * vectors): widen8, round8 (still floats), store8 (floats that are bf16 already). */
#ifndef TOKENMILL_BF16_H
#define TOKENMILL_BF16_H

#include <stdint.h>
#include <string.h>

#include "exp8.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float bf16_to_float(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f widen8(const uint16_t *p) {
#ifdef __AVX2__ /* one widening instruction where gcc's generic vectors would take three */
    const __m256i u = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    const v8u u = __builtin_convertvector(*(const v8h_u *)p, v8u) << 16;
#endif
    v8f f;
    memcpy(&f, &u, 32);
    return f;
}

static inline v8f round8(v8f f) {
    v8u u;
    memcpy(&u, &f, 32);
    const v8u nan = (v8u)(f != f);
    u = (((u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u) & ~nan) | (0x7fc00000u & nan);
    memcpy(&f, &u, 32);
    return f;
}

static inline void store8(uint16_t *p, v8f f) {
    v8u u;
    memcpy(&u, &f, 32);
    *(v8h_u *)p = __builtin_convertvector(u >> 16, v8h);
}

#endif
