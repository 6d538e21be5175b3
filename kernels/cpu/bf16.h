/* bfloat16 <-> float for the CPU kernels: a bf16 is the top half of an fp32; rounding to it is to
 * nearest even, as torch rounds, and a NaN stays a NaN. */
#ifndef TOKENMILL_BF16_H
#define TOKENMILL_BF16_H

#include <stdint.h>
#include <string.h>

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

#endif
