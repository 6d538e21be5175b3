/* A kernel's packed twin, `int NAME_packed(const int64_t *a)`: the kernel with its arguments read from
 * one array (pointers and integers as they are, a float as its 32 bits), so that a CPU graph's replay
 * (graph.c) calls every kernel the same way, from C. */
#ifndef TOKENMILL_PACKED_H
#define TOKENMILL_PACKED_H

#include <stdint.h>
#include <string.h>

#define PTR(i) ((void *)(intptr_t)a[i])

static inline float packed_float(int64_t bits) {
    const int32_t b = (int32_t)bits;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#endif
