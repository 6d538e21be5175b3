/* How Python calls the kernels.
 *
 * Their status: 0, or one of the codes below, which build.status_check turns into exceptions (nothing
 * is written unless 0).
 *
 * A kernel's packed twin, `int NAME_packed(const int64_t *a)`: the kernel with its arguments read from
 * one array (pointers and integers as they are, a float as its 32 bits), so that a CPU graph's replay
 * (graph.c) calls every kernel the same way, from C. */
#ifndef TOKENMILL_PACKED_H
#define TOKENMILL_PACKED_H

#include <stdint.h>
#include <string.h>

enum {
    OK,
    OUT_OF_MEMORY,
    BAD_ARGUMENTS, /* arguments a kernel does not take (its Python caller never sends them) */
    OUT_OF_RANGE,  /* an index given in a tensor (a K/V slot) outside what it indexes */
};

#define PTR(i) ((void *)(intptr_t)a[i])

static inline float packed_float(int64_t bits) {
    const int32_t b = (int32_t)bits;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

#endif
