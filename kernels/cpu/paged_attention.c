/* Paged decode attention on the CPU, reading K/V where it sits in the cache: the twin of
 * kernels.reference.paged_decode_attention, without its gather of every sequence's context
 * into a fresh tensor (which, with the SDPA after it, was a third of a 32-sequence decode step).
 *
 *   q            (B, H, D): one new token per sequence
 *   k/v cache    (num_blocks, BS, HKV, D)
 *   block_tables (B, W) int64; seq_lens (B,) int64
 *   out          (B, H, D)
 * all contiguous; D a multiple of 8 up to MAX_D. With a sliding window (window > 0) a query sees
 * its sequence's latest window keys; with softcap > 0 (Gemma 2) each score s is
 * softcap tanh(s / softcap). fp32 or bf16 (widened on load, rounded to nearest even on store, as
 * torch rounds); fp32 arithmetic throughout. One sequence per work
 * item, or with fewer sequences than threads one KV head of one: so that one stream's attention
 * is not one thread's. Within an item, each query head in turn over its KV head's blocks, its
 * accumulators in registers (head sizes 64 and 128 are compiled as constants), the next block
 * prefetched while one computes, an online softmax across blocks: nothing the size of the
 * context is ever written. A head's result does not depend on how the work was split.
 *
 * store_kv writes a step's new K and V rows into their slots: the twin of
 * kernels.reference.store_kvcache (two index_copy_ at ~20 us each per layer were a tenth of a
 * one-stream decode step).
 *
 * Each function returns OK, or BAD_ARGUMENTS for what attention.py never sends; store_kv returns
 * OUT_OF_RANGE for a slot outside the cache (packed.h's codes; nothing written unless OK).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp8.h"
#include "packed.h"

typedef struct {
    int64_t H, HKV, D, BS, W, window;
    float scale, softcap;
} Dims;

#define MAX_D 256  /* head sizes up to this, multiples of 8 */
#define MAX_BS 256 /* tokens per block up to this */

/* sum(a[d] * b[d]): 8 lanes at a time (one AVX register, or two SSE/NEON ones), in two chains
   so that one FMA need not wait for the last, summed as a tree. D is a multiple of 8. */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b, const int64_t D) {
    v8f acc = {0}, acc2 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        acc += *(const v8f_u *)(a + d) * *(const v8f_u *)(b + d);
        acc2 += *(const v8f_u *)(a + d + 8) * *(const v8f_u *)(b + d + 8);
    }
    if (d + 8 <= D) acc += *(const v8f_u *)(a + d) * *(const v8f_u *)(b + d);
    acc += acc2;
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

/* D values of a K or V row's head as floats: in place for fp32, else widened into buf */
static inline __attribute__((always_inline)) const float *head_row(const void *cache, int64_t at, const int64_t D,
                                                                   const int bf16, float *buf) {
    if (!bf16) return (const float *)cache + at;
    const uint16_t *src = (const uint16_t *)cache + at;
    for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_float(src[d]);
    return buf;
}

/* Query head h of sequence b over KV head kv: its D accumulators in registers when D is a constant
   (64, 128), scores a block at a time, an online softmax across blocks. */
static inline __attribute__((always_inline)) void attend_head(const void *q, const void *k_cache,
                                                              const void *v_cache, const int64_t *table,
                                                              int64_t len, int64_t b, int64_t h, int64_t kv,
                                                              const Dims *dm, void *out, const int64_t D,
                                                              const int bf16, const int first) {
    const int64_t BS = dm->BS, row = dm->HKV * D, block_size = BS * row, size = bf16 ? 2 : 4;
    float qf[MAX_D], buf[MAX_D], s[MAX_BS + 8]; /* s: exponentiated 8 at a time, past a block's end too */
    v8f acc[MAX_D / 8];
    const float *src = head_row(q, (b * dm->H + h) * D, D, bf16, buf);
    for (int64_t d = 0; d < D; d++) qf[d] = src[d] * dm->scale;
    for (int64_t i = 0; i < D / 8; i++) acc[i] = (v8f){0};
    float m = -INFINITY, l = 0.f;
    const int64_t lo = dm->window > 0 && len > dm->window ? len - dm->window : 0; /* the first key seen */
    for (int64_t j = lo / BS; j * BS < len; j++) {
        const int64_t n = len - j * BS < BS ? len - j * BS : BS, block = table[j] * block_size + kv * D;
        const int64_t t0 = j * BS < lo ? lo - j * BS : 0; /* the block's first key seen */
        /* the next block's rows of this KV head, on their way while this one computes (by its first query
           head: the others find them in cache) */
        if (first && (j + 1) * BS < len)
            for (int64_t t = 0; t < BS; t++)
                for (int64_t o = 0; o < D * size; o += 64) {
                    __builtin_prefetch((const char *)k_cache + (table[j + 1] * block_size + t * row + kv * D) * size + o);
                    __builtin_prefetch((const char *)v_cache + (table[j + 1] * block_size + t * row + kv * D) * size + o);
                }
        float mx = m;
        for (int64_t t = t0; t < n; t++) {
            s[t] = dot(qf, head_row(k_cache, block + t * row, D, bf16, buf), D);
            if (dm->softcap > 0.f) s[t] = dm->softcap * tanhf(s[t] / dm->softcap);
            mx = s[t] > mx ? s[t] : mx;
        }
        for (int64_t t = 0; t < t0; t++) s[t] = mx; /* keys before the window: exponentiated, never used */
        /* m is finite from the first block on (it holds the first key seen): no exp(-inf + inf) */
        const float corr = expf(m - mx);
        for (int64_t t = n; t % 8; t++) s[t] = 0.f; /* the last 8's tail, read and never used */
        for (int64_t t = 0; t < n; t += 8) /* exp8 (within 2 ulp of expf): a scalar expf per score was ~40% of this */
            *(v8f_u *)(s + t) = exp8(*(const v8f_u *)(s + t) - mx);
        float sum = l * corr;
        for (int64_t t = t0; t < n; t++) sum += s[t];
        if (corr != 1.f)
            for (int64_t i = 0; i < D / 8; i++) acc[i] *= corr;
        m = mx;
        l = sum;
        for (int64_t t = t0; t < n; t++) {
            const float *v = head_row(v_cache, block + t * row, D, bf16, buf);
            for (int64_t i = 0; i < D / 8; i++) acc[i] += s[t] * *(const v8f_u *)(v + 8 * i);
        }
    }
    const float inv = 1.f / l;
    for (int64_t i = 0; i < D / 8; i++)
        for (int d = 0; d < 8; d++) {
            const int64_t at = (b * dm->H + h) * D + 8 * i + d;
            if (bf16)
                ((uint16_t *)out)[at] = float_to_bf16(acc[i][d] * inv);
            else
                ((float *)out)[at] = acc[i][d] * inv;
        }
}

/* KV heads [kv0, kv1) of sequence b: each one's query heads in turn, while its blocks are in cache. */
static void attend_one(const void *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                       int64_t b, int64_t kv0, int64_t kv1, const Dims *dm, void *out, int bf16) {
    const int64_t G = dm->H / dm->HKV;
    for (int64_t kv = kv0; kv < kv1; kv++)
        for (int64_t h = kv * G; h < (kv + 1) * G; h++) {
            const int first = h == kv * G;
            if (dm->D == 64 && !bf16)
                attend_head(q, k_cache, v_cache, table, len, b, h, kv, dm, out, 64, 0, first);
            else if (dm->D == 64)
                attend_head(q, k_cache, v_cache, table, len, b, h, kv, dm, out, 64, 1, first);
            else if (dm->D == 128 && !bf16)
                attend_head(q, k_cache, v_cache, table, len, b, h, kv, dm, out, 128, 0, first);
            else if (dm->D == 128)
                attend_head(q, k_cache, v_cache, table, len, b, h, kv, dm, out, 128, 1, first);
            else if (!bf16)
                attend_head(q, k_cache, v_cache, table, len, b, h, kv, dm, out, dm->D, 0, first);
            else
                attend_head(q, k_cache, v_cache, table, len, b, h, kv, dm, out, dm->D, 1, first);
        }
}

static int attend(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                  const int64_t *seq_lens, void *out, int64_t B, const Dims *dm, int num_threads, int bf16) {
    if (dm->D % 8 || dm->D > MAX_D || dm->BS > MAX_BS) return BAD_ARGUMENTS;
    const int64_t parts = B < num_threads ? dm->HKV : 1, items = B * parts;
    const int threads = items < num_threads ? (int)items : num_threads; /* never wake a thread with nothing to do */
    (void)threads;  /* without OpenMP: one thread */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        const int64_t b = i / parts, kv0 = parts == 1 ? 0 : i % parts, kv1 = parts == 1 ? dm->HKV : kv0 + 1;
        attend_one(q, k_cache, v_cache, block_tables + b * dm->W, seq_lens[b], b, kv0, kv1, dm, out, bf16);
    }
    return OK;
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                     const int64_t *seq_lens, float *out, int64_t B, const Dims *dm, int num_threads) {
    return attend(q, k_cache, v_cache, block_tables, seq_lens, out, B, dm, num_threads, 0);
}

int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out, int64_t B,
                      const Dims *dm, int num_threads) {
    return attend(q, k_cache, v_cache, block_tables, seq_lens, out, B, dm, num_threads, 1);
}

/* Token t's K row (row_bytes: its HKV heads side by side) from k + t * k_stride into slot slots[t] of
   k_cache (slots of row_bytes each, num_slots of them), V likewise: every slot checked first. */
int store_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride, char *k_cache, char *v_cache,
             const int64_t *slots, int64_t T, int64_t row_bytes, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return OUT_OF_RANGE;
    for (int64_t t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * row_bytes, k + t * k_stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
    return OK;
}

int paged_decode_f32_packed(const int64_t *a) { return paged_decode_f32(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), PTR(5), a[6], PTR(7), (int)a[8]); }
int paged_decode_bf16_packed(const int64_t *a) { return paged_decode_bf16(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), PTR(5), a[6], PTR(7), (int)a[8]); }
int store_kv_packed(const int64_t *a) { return store_kv(PTR(0), a[1], PTR(2), a[3], PTR(4), PTR(5), PTR(6), a[7], a[8], a[9]); }
