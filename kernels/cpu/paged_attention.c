/* Paged decode attention on the CPU, reading K/V where it sits in the cache: the twin of
 * kernels.reference.paged_decode_attention, without its gather of every sequence's context
 * into a fresh tensor (which, with the SDPA after it, was a third of a 32-sequence decode step).
 *
 *   q            (B, H, D): one new token per sequence
 *   k/v cache    (num_blocks, BS, HKV, D)
 *   block_tables (B, W) int64; seq_lens (B,) int64
 *   out          (B, H, D)
 * all contiguous. fp32 or bf16 (widened on load, rounded to nearest even on store, as torch
 * rounds); fp32 arithmetic throughout. One sequence per work item, all its heads together, so
 * each K/V block is read once, front to back, while the next one is prefetched; an online
 * softmax over the blocks, so nothing the size of the context is ever written. With fewer
 * sequences than threads, a work item is one KV head of a sequence (and its query heads), so that
 * one stream's attention is not one thread's; a head's result is the same either way.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

typedef struct {
    int64_t H, HKV, D, BS, W;
    float scale;
} Dims;

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));  /* the same, at any float address */

/* Row ``i`` of ``base`` (n values) as floats: the row itself for fp32, else widened into ``buf``. */
static inline const float *row_f32(const void *base, int64_t i, int64_t n, int bf16, float *buf) {
    if (!bf16) return (const float *)base + i;
    const uint16_t *src = (const uint16_t *)base + i;
    for (int64_t d = 0; d < n; d++) buf[d] = bf16_to_float(src[d]);
    return buf;
}

static inline void prefetch(const void *base, int64_t i, int64_t n, int bf16) {
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t o = 0; o < n * size; o += 64) __builtin_prefetch((const char *)base + i * size + o);
}

/* sum(a[d] * b[d]): 8 lanes at a time (one AVX register, or two SSE/NEON ones), in two chains
   so that one FMA need not wait for the last, summed as a tree. */
static inline float dot(const float *a, const float *b, int64_t D) {
    v8f acc = {0}, acc2 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        acc += *(const v8f_u *)(a + d) * *(const v8f_u *)(b + d);
        acc2 += *(const v8f_u *)(a + d + 8) * *(const v8f_u *)(b + d + 8);
    }
    if (d + 8 <= D) {
        acc += *(const v8f_u *)(a + d) * *(const v8f_u *)(b + d);
        d += 8;
    }
    acc += acc2;
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; d < D; d++) sum += a[d] * b[d];
    return sum;
}

/* Query heads [h0, h1) of sequence b (head h reads KV head h / G). */
static inline void attend_one(const void *q, const void *k_cache, const void *v_cache, const int64_t *table,
                              int64_t len, int64_t b, int64_t h0, int64_t h1, const Dims *dm, void *out, int bf16) {
    const int64_t H = dm->H, G = H / dm->HKV, D = dm->D, BS = dm->BS, row = dm->HKV * D, block_size = BS * row;
    float qf[H][D], acc[H][D], m[H], l[H], s[BS][H], buf[row];
    for (int64_t h = h0; h < h1; h++) {
        const float *src = row_f32(q, (b * H + h) * D, D, bf16, buf);
        for (int64_t d = 0; d < D; d++) {
            qf[h][d] = src[d] * dm->scale;
            acc[h][d] = 0.f;
        }
        m[h] = -INFINITY;
        l[h] = 0.f;
    }
    for (int64_t j = 0; j * BS < len; j++) {
        const int64_t n = len - j * BS < BS ? len - j * BS : BS;
        const int64_t block = table[j] * block_size, next = (j + 1) * BS < len ? table[j + 1] * block_size : -1;
        for (int64_t t = 0; t < n; t++) {
            if (next >= 0) {  /* the next block, a row at a time, on its way while this one computes */
                prefetch(k_cache, next + t * row, row, bf16);
                prefetch(v_cache, next + t * row, row, bf16);
            }
            const float *k = row_f32(k_cache, block + t * row, row, bf16, buf);
            for (int64_t h = h0; h < h1; h++) s[t][h] = dot(qf[h], k + h / G * D, D);
        }
        /* m is finite from the first block on (it holds key 0): no exp(-inf + inf) */
        for (int64_t h = h0; h < h1; h++) {
            float mx = m[h];
            for (int64_t t = 0; t < n; t++) mx = s[t][h] > mx ? s[t][h] : mx;
            const float corr = expf(m[h] - mx);
            float sum = l[h] * corr;
            for (int64_t t = 0; t < n; t++) {
                s[t][h] = expf(s[t][h] - mx);
                sum += s[t][h];
            }
            if (corr != 1.f)
                for (int64_t d = 0; d < D; d++) acc[h][d] *= corr;
            m[h] = mx;
            l[h] = sum;
        }
        for (int64_t t = 0; t < n; t++) {
            const float *v = row_f32(v_cache, block + t * row, row, bf16, buf);
            for (int64_t h = h0; h < h1; h++) {
                const float p = s[t][h], *vh = v + h / G * D;
                for (int64_t d = 0; d < D; d++) acc[h][d] += p * vh[d];
            }
        }
    }
    for (int64_t h = h0; h < h1; h++) {
        const int64_t at = (b * H + h) * D;
        const float inv = 1.f / l[h];
        for (int64_t d = 0; d < D; d++) {
            if (bf16)
                ((uint16_t *)out)[at + d] = float_to_bf16(acc[h][d] * inv);
            else
                ((float *)out)[at + d] = acc[h][d] * inv;
        }
    }
}

static void attend(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                   const int64_t *seq_lens, void *out, int64_t B, const Dims *dm, int num_threads, int bf16) {
    const int64_t parts = B < num_threads ? dm->HKV : 1, items = B * parts, G = dm->H / dm->HKV;
    const int threads = items < num_threads ? (int)items : num_threads; /* never wake a thread with nothing to do */
    (void)threads;  /* without OpenMP: one thread */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        const int64_t b = i / parts, h0 = parts == 1 ? 0 : i % parts * G, h1 = parts == 1 ? dm->H : h0 + G;
        attend_one(q, k_cache, v_cache, block_tables + b * dm->W, seq_lens[b], b, h0, h1, dm, out, bf16);
    }
}

void paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                      const int64_t *seq_lens, float *out, int64_t B, const Dims *dm, int num_threads) {
    attend(q, k_cache, v_cache, block_tables, seq_lens, out, B, dm, num_threads, 0);
}

void paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                       const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out, int64_t B,
                       const Dims *dm, int num_threads) {
    attend(q, k_cache, v_cache, block_tables, seq_lens, out, B, dm, num_threads, 1);
}
