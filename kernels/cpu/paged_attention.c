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
 * softcap tanh(s / softcap); with sinks (GPT-OSS's attention sinks, H floats) head h's softmax has one
 * more term, exp(sinks[h]), for a key without a value. fp32 or bf16 (widened on load, rounded to nearest even on store, as
 * torch rounds); fp32 arithmetic throughout. The cache holds q's dtype, or fp8 (kv_fp8: e4m3fn or
 * e5m2, widened exactly as torch widens them: widen_fp8). One sequence per work item (or the rows
 * of one request's decode and drafts: attend_rows), or with fewer of them than threads one KV head
 * of one: so that one stream's attention is not one thread's. Within an item, the query heads of a KV
 * head walk its blocks together (attend_heads: a block widened once for all of them, each step of the
 * softmax taken by every head before the next), with an online softmax across blocks, the blocks
 * ahead prefetched into L2 while one computes (AHEAD): nothing the size of the context is ever written.
 * Scores are taken 8 keys at a time (lanes_sum8). A head's result does not depend on how the work was split, nor on how many
 * heads walk with it.
 *
 * store_kv writes a step's new K and V rows into their slots: the twin of
 * kernels.reference.store_kvcache (two index_copy_ at ~20 us each per layer were a tenth of a
 * one-stream decode step); store_kv_fp8 into an fp8 cache, each value rounded to fp8 on the way.
 *
 * Each function returns OK, or BAD_ARGUMENTS for what attention.py never sends; decode returns
 * OUT_OF_MEMORY where its small buffers cannot be allocated (some rows written then: the caller
 * raises and drops the output); store_kv returns OUT_OF_RANGE for a slot outside the cache (nothing
 * written then; packed.h's codes).
 */
#include <math.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "exp8.h"
#include "packed.h"

typedef struct {
    int64_t H, HKV, D, BS, W, window;
    float scale, softcap;
    int64_t kv_fp8; /* the cache: 0 q's dtype, 1 fp8 e4m3fn, 2 fp8 e5m2 */
    const float *sinks; /* (H,) or NULL: none */
} Dims;

enum { KV_F32, KV_BF16, KV_E4M3, KV_E5M2 }; /* what a cache (or q) row holds */

/* fp8 widened to floats, exactly, e4m3fn's in units of 2^-8 (the caller scales q and the output by 2^8
   instead: an exact power of two, so the scores and the result are those of the values themselves). With
   F16C, 16 at a time: e5m2 is the top byte of a half, widened as it is; e4m3fn's sign, exponent and
   mantissa move into a half's places (whose exponent's bias is 8 more, hence the units), its NaN made a
   half's. Elsewhere a value at a time from a table of the 256 (fp8_values). Decode over SmolLM2's heads,
   32 sequences of 240 tokens, one thread: the table alone took ~3x bf16's time; this, e4m3fn ~1.3x and
   e5m2 ~1.15x (8 of 3000 tokens, two threads: both at or below bf16's, fp32's reading twice the bytes). */
static float fp8_table[2][256]; /* e4m3fn (in 2^-8 units), e5m2: filled by fp8_values */

__attribute__((constructor)) static void fp8_values(void) { /* (when the library loads) */
    for (int e5m2 = 0; e5m2 < 2; e5m2++)
        for (uint32_t x = 0; x < 256; x++) {
            const uint32_t mbits = e5m2 ? 2 : 3, em = x & 0x7f;
            float f;
            if (em >= (e5m2 ? 0x7cu : 0x7fu)) { /* e5m2's infinities and NaNs, e4m3fn's NaN */
                const uint32_t bits = 0x7f800000u | ((em & ((1u << mbits) - 1)) << (23 - mbits));
                memcpy(&f, &bits, 4);
            } else if (em < (1u << mbits)) { /* subnormal */
                f = (float)em * (e5m2 ? 0x1p-16f : 0x1p-17f);
            } else {
                const uint32_t bits = (em << (23 - mbits)) + ((e5m2 ? 127u - 15u : 127u - 7u - 8u) << 23);
                memcpy(&f, &bits, 4);
            }
            fp8_table[e5m2][x] = x & 0x80 ? -f : f;
        }
}

static inline __attribute__((always_inline)) void widen_fp8(const uint8_t *p, int64_t D, const int e5m2, float *out) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
    for (; d + 16 <= D; d += 16) {
        const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + d))); /* 16 x uint16 */
        __m256i h;
        if (e5m2) {
            h = _mm256_slli_epi16(x, 8);
        } else { /* the sign to bit 15 (and 14), the rest below it; bit 14 cleared; NaN (0x7f) a half's NaN */
            h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1), _mm256_set1_epi16((short)0xbfff));
            const __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(h, _mm256_set1_epi16((short)0x8000)),
                                                   _mm256_set1_epi16((short)0xbf80));
            h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), nan);
        }
        _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
        _mm256_storeu_ps(out + d + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
#endif
    for (; d < D; d++) out[d] = fp8_table[e5m2][p[d]];
}

#define MAX_D 256  /* head sizes up to this, multiples of 8 */
#define MAX_BS 256 /* tokens per block up to this */

/* D values of a K or V row's head (of a kind above) as floats: in place for fp32, else widened into buf */
static inline __attribute__((always_inline)) const float *head_row(const void *cache, int64_t at, const int64_t D,
                                                                   const int kind, float *buf) {
    if (kind == KV_F32) return (const float *)cache + at;
    if (kind == KV_BF16) {
        const uint16_t *src = (const uint16_t *)cache + at;
        for (int64_t d = 0; d < D; d++) buf[d] = bf16_to_float(src[d]);
    } else {
        widen_fp8((const uint8_t *)cache + at, D, kind == KV_E5M2, buf); /* (e4m3fn in 2^-8 units) */
    }
    return buf;
}

/* 8 values of a K or V row's head from element at on, as floats: fp32 in place, bf16 widened in registers */
static inline __attribute__((always_inline)) v8f load8(const void *cache, int64_t at, const int kind) {
    return kind == KV_BF16 ? widen8((const uint16_t *)cache + at) : *(const v8f_u *)((const float *)cache + at);
}

/* sum(q[d] * row[d]) before its last sums, the row at element at of cache (fp32 or bf16): 8 lanes at a time
   in two chains so that one FMA need not wait for the last, the chains added. D is a multiple of 8. */
static inline __attribute__((always_inline)) v8f dot_lanes(const float *q, const void *cache, int64_t at,
                                                           const int64_t D, const int kind) {
    v8f acc = {0}, acc2 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        acc += *(const v8f_u *)(q + d) * load8(cache, at + d, kind);
        acc2 += *(const v8f_u *)(q + d + 8) * load8(cache, at + d + 8, kind);
    }
    if (d + 8 <= D) acc += *(const v8f_u *)(q + d) * load8(cache, at + d, kind);
    return acc + acc2;
}

/* a dot_lanes' lanes summed as a tree */
static inline float lanes_sum(v8f a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)

/* lanes_sum of a[0..7] at once, each lane t the same sums in the same order: a transpose as it adds */
static inline __attribute__((always_inline)) v8f lanes_sum8(const v8f a[8]) {
    v8f x[4], y[2];
    for (int i = 0; i < 4; i++) /* lanes j and j + 4 of a[2i] and of a[2i + 1] */
        x[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* pairs of those */
        y[i] = SHUF(x[2 * i], x[2 * i + 1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(x[2 * i], x[2 * i + 1], 1, 3, 5, 7, 9, 11, 13, 15);
    return SHUF(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* the scores of q against the block's keys [0, n), from element at of the cache (fp32 or bf16), row apart: 8
   keys at a time while 8 are left, then one at a time */
static inline __attribute__((always_inline)) void block_scores(const float *q, const void *k_cache, int64_t at,
                                                               int64_t row, int64_t n, const int64_t D,
                                                               const int kind, float *s) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        v8f a[8];
        for (int i = 0; i < 8; i++) a[i] = dot_lanes(q, k_cache, at + (t + i) * row, D, kind);
        *(v8f_u *)(s + t) = lanes_sum8(a);
    }
    for (; t < n; t++) s[t] = lanes_sum(dot_lanes(q, k_cache, at + t * row, D, kind));
}

/* the largest of m and s[t0, n) that is not a NaN (as a comparison a score at a time finds it): 8 lanes at a
   time, then the lanes, then the rest */
static inline __attribute__((always_inline)) float max_score(const float *s, int64_t t0, int64_t n, float m) {
    v8f lanes = (v8f){0} + m;
    int64_t t = t0;
    for (; t + 8 <= n; t += 8) {
        const v8f x = *(const v8f_u *)(s + t);
        lanes = select8(x > lanes, x, lanes);
    }
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    return m;
}

/* A query head's softmax so far (its running max, sum and unnormalized output), between two blocks
   (attend_heads) and two spans of blocks (attend_rows). */
typedef struct {
    float m, l;
    v8f acc[MAX_D / 8];
} Partial;

#define MAX_G 8 /* query heads that walk a KV head's blocks together */
/* Blocks ahead of the one computing that attend_heads asks for, into L2 (prefetcht1). Into L1 (prefetcht0, one
   block ahead) they gained nothing: on the AVX-512 EPYC, SmolLM2's heads in bf16 over 6 layers' caches (none
   in L3, as a step meets them), 32 sequences of 1024 tokens read K and V at 10.0 GB/s with or without it; into
   L2, 13.9 one block ahead, 14.6 two, 14.0 three (fp32, two ahead: 13.3 -> 17.9). */
#define AHEAD 2

/* Query heads [h0, h0 + nh) of sequence b (nh up to MAX_G), all of KV head kv, over its blocks [j0, j1) (0,
   INT64_MAX: all), from their states parts[0, nh), a block at a time. Each block's K and V rows of kv are
   widened once for all nh heads into kb and vb (BS x D floats each: bf16 for more than one head, fp8
   always; bf16 widened in registers by each head instead was 18% slower with Qwen2-0.5B's 7 heads per KV
   head); fp32 and one head's bf16 are read in place. Then each step of the block (scores, max, exp, sum,
   the D accumulators: in registers through the block when D is a constant, 64 or 128) for every head
   before the next step: the heads' chains of dependent steps side by side (a head at a time through its
   16 keys waited on them: 34.5 against 28.6 cycles per head and key, bf16 in L1). Every head's
   arithmetic is the same whatever nh is. Unless last it leaves its states in parts and writes nothing;
   last, it writes each head's output. With prefetch, it asks for the next block's rows while one computes. */
static inline __attribute__((always_inline)) void attend_heads(const void *q, const void *k_cache,
                                                               const void *v_cache, const int64_t *table,
                                                               int64_t len, int64_t b, int64_t h0, int64_t nh,
                                                               int64_t kv, const Dims *dm, void *out, const int64_t D,
                                                               const int bf16, const int kv_kind, const int prefetch,
                                                               int64_t j0, int64_t j1, Partial *parts, float *kb,
                                                               float *vb, const int last) {
    const int64_t BS = dm->BS, row = dm->HKV * D, block_size = BS * row;
    const int64_t size = kv_kind == KV_F32 ? 4 : kv_kind == KV_BF16 ? 2 : 1; /* bytes per cached value */
    const int widen = kv_kind != KV_F32 && (nh > 1 || kv_kind != KV_BF16);
    float qf[MAX_G][MAX_D], s[MAX_G][MAX_BS + 8]; /* s: exponentiated 8 at a time, past a block's end too */
    const float unit = kv_kind == KV_E4M3 ? 256.f : 1.f; /* the cache's values are in 1 / unit */
    for (int64_t g = 0; g < nh; g++) {
        const float *src = head_row(q, (b * dm->H + h0 + g) * D, D, bf16 ? KV_BF16 : KV_F32, s[0]);
        for (int64_t d = 0; d < D; d++) qf[g][d] = src[d] * dm->scale * unit;
    }
    const int64_t lo = dm->window > 0 && len > dm->window ? len - dm->window : 0; /* the first key seen */
    const int64_t end = (len + BS - 1) / BS < j1 ? (len + BS - 1) / BS : j1;
    const int64_t first = lo / BS > j0 ? lo / BS : j0;
    for (int64_t j = first; j < end; j++) {
        const int64_t n = len - j * BS < BS ? len - j * BS : BS, block = table[j] * block_size + kv * D;
        const int64_t t0 = j * BS < lo ? lo - j * BS : 0; /* the block's first key seen */
        for (int64_t a = j == first ? 1 : AHEAD; prefetch && a <= AHEAD && (j + a) * BS < len; a++)
            for (int64_t t = 0; t < BS; t++)
                for (int64_t o = 0; o < D * size; o += 64) { /* (0, 2: read, into L2) */
                    __builtin_prefetch((const char *)k_cache + (table[j + a] * block_size + t * row + kv * D) * size + o, 0, 2);
                    __builtin_prefetch((const char *)v_cache + (table[j + a] * block_size + t * row + kv * D) * size + o, 0, 2);
                }
        const void *kp = k_cache, *vp = v_cache; /* the block's rows: at, row apart, of kind */
        int64_t at = block, stride = row;
        int kind = kv_kind;
        if (widen) {
            for (int64_t t = 0; t < n; t++) {
                head_row(k_cache, block + t * row, D, kv_kind, kb + t * D); /* (into kb: never in place) */
                head_row(v_cache, block + t * row, D, kv_kind, vb + t * D);
            }
            kp = kb, vp = vb, at = 0, stride = D, kind = KV_F32;
        }
        for (int64_t g = 0; g < nh; g++) {
            block_scores(qf[g], kp, at, stride, n, D, kind, s[g]); /* (keys before t0 too: never used) */
            if (dm->softcap > 0.f)
                for (int64_t t = t0; t < n; t++) s[g][t] = dm->softcap * tanhf(s[g][t] / dm->softcap);
        }
        float mx[MAX_G], corr[MAX_G];
        for (int64_t g = 0; g < nh; g++) {
            mx[g] = max_score(s[g], t0, n, parts[g].m);
            /* m is finite from the first block on (it holds the first key seen): no exp(-inf + inf); a span
               without keys for this query never gets here */
            corr[g] = expf(parts[g].m - mx[g]);
            for (int64_t t = 0; t < t0; t++) s[g][t] = mx[g]; /* keys before the window: exponentiated, never used */
            for (int64_t t = n; t % 8; t++) s[g][t] = 0.f;    /* the last 8's tail, read and never used */
        }
        for (int64_t g = 0; g < nh; g++)
            for (int64_t t = 0; t < n; t += 8) /* exp8 (within 2 ulp of expf): a scalar expf per score was ~40% of this */
                *(v8f_u *)(s[g] + t) = exp8(*(const v8f_u *)(s[g] + t) - mx[g]);
        for (int64_t g = 0; g < nh; g++) {
            float sum = parts[g].l * corr[g];
            for (int64_t t = t0; t < n; t++) sum += s[g][t];
            parts[g].l = sum, parts[g].m = mx[g];
        }
        for (int64_t g = 0; g < nh; g++) {
            v8f acc[MAX_D / 8];
            for (int64_t i = 0; i < D / 8; i++) acc[i] = corr[g] != 1.f ? parts[g].acc[i] * corr[g] : parts[g].acc[i];
            for (int64_t t = t0; t < n; t++)
                for (int64_t i = 0; i < D / 8; i++) acc[i] += s[g][t] * load8(vp, at + t * stride + 8 * i, kind);
            for (int64_t i = 0; i < D / 8; i++) parts[g].acc[i] = acc[i];
        }
    }
    if (!last) return;
    for (int64_t g = 0; g < nh; g++) {
        const Partial *p = parts + g;
        float l = p->l;
        if (dm->sinks) l += expf(dm->sinks[h0 + g] - p->m); /* (a sink far above every score: l inf, the output 0) */
        const float inv = 1.f / l * unit;
        for (int64_t i = 0; i < D / 8; i++)
            for (int d = 0; d < 8; d++) {
                const int64_t at = (b * dm->H + h0 + g) * D + 8 * i + d;
                if (bf16)
                    ((uint16_t *)out)[at] = float_to_bf16(p->acc[i][d] * inv);
                else
                    ((float *)out)[at] = p->acc[i][d] * inv;
            }
    }
}

/* One instantiation per head size D (constant where the caller passes one) and mode: q fp32 (even modes)
   or bf16 (odd), the cache q's dtype (0, 1), e4m3fn (2, 3) or e5m2 (4, 5); each one's conversions inlined. */
static inline __attribute__((always_inline)) void attend_mode(const void *q, const void *k_cache,
                                                              const void *v_cache, const int64_t *table,
                                                              int64_t len, int64_t b, int64_t h0, int64_t nh,
                                                              int64_t kv, const Dims *dm, void *out, const int64_t D,
                                                              const int mode, const int prefetch, int64_t j0,
                                                              int64_t j1, Partial *p, float *kb, float *vb,
                                                              const int last) {
#define HEADS(bf16, kind) \
    attend_heads(q, k_cache, v_cache, table, len, b, h0, nh, kv, dm, out, D, bf16, kind, prefetch, j0, j1, p, kb, vb, last)
    switch (mode) {
    case 0: HEADS(0, KV_F32); break;
    case 1: HEADS(1, KV_BF16); break;
    case 2: HEADS(0, KV_E4M3); break;
    case 3: HEADS(1, KV_E4M3); break;
    case 4: HEADS(0, KV_E5M2); break;
    default: HEADS(1, KV_E5M2); break;
    }
#undef HEADS
}

/* attend_mode with D a constant where it is 64 or 128 */
static void attend_d(const void *q, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                     int64_t b, int64_t h0, int64_t nh, int64_t kv, const Dims *dm, void *out, int mode, int prefetch,
                     int64_t j0, int64_t j1, Partial *p, float *kb, float *vb, int last) {
    if (dm->D == 64)
        attend_mode(q, k_cache, v_cache, table, len, b, h0, nh, kv, dm, out, 64, mode, prefetch, j0, j1, p, kb, vb, last);
    else if (dm->D == 128)
        attend_mode(q, k_cache, v_cache, table, len, b, h0, nh, kv, dm, out, 128, mode, prefetch, j0, j1, p, kb, vb, last);
    else
        attend_mode(q, k_cache, v_cache, table, len, b, h0, nh, kv, dm, out, dm->D, mode, prefetch, j0, j1, p, kb, vb, last);
}

/* KV heads [kv0, kv1) of sequences [b0, b1), whose block tables agree (a request's decode row and its
   speculative drafts, each with one more key than the last; or one sequence), each read through its own:
   each KV head's query heads together (attend_heads). Several sequences walk the blocks together, a span of them (about
   128 KB of K and V) at a time, every query head of every sequence over a span before the next span is
   read, their softmax states kept between spans: the context comes from memory once, not once per row
   (k + 1 rows read it k + 1 times: at 8000 tokens, 5 rows took 6.3x one row's time). Returns
   OUT_OF_MEMORY where the states cannot be allocated. */
static int attend_rows(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                       const int64_t *seq_lens, int64_t b0, int64_t b1, int64_t kv0, int64_t kv1, const Dims *dm,
                       void *out, int mode) {
    const int64_t G = dm->H / dm->HKV, n = b1 - b0, widened = dm->BS * dm->D;
    /* every row's states, then the widened K and V of a block */
    Partial *parts = aligned_alloc(32, sizeof(Partial) * (size_t)(n * G) + sizeof(float) * (size_t)(2 * widened));
    if (!parts) return OUT_OF_MEMORY;
    float *kb = (float *)(parts + n * G), *vb = kb + widened;
    const int64_t size = dm->kv_fp8 ? 1 : mode == 1 ? 2 : 4; /* bytes per cached value: fp8, bf16, fp32 */
    const int64_t span = n == 1 ? INT64_MAX /* (one pass) */
                         : 131072 / (2 * dm->BS * dm->D * size) > 0 ? 131072 / (2 * dm->BS * dm->D * size) : 1;
    int64_t longest = b0; /* the row that reads the most blocks, which prefetches them */
    for (int64_t b = b0; b < b1; b++) longest = seq_lens[b] > seq_lens[longest] ? b : longest;
    const int64_t blocks = (seq_lens[longest] + dm->BS - 1) / dm->BS;
    for (int64_t kv = kv0; kv < kv1; kv++) {
        for (int64_t i = 0; i < n * G; i++) {
            parts[i].m = -INFINITY, parts[i].l = 0.f;
            for (int64_t d = 0; d < MAX_D / 8; d++) parts[i].acc[d] = (v8f){0};
        }
        for (int64_t j0 = 0;;) { /* every row over every span: the last writes it */
            const int last = span >= blocks - j0;
            const int64_t j1 = last ? blocks : j0 + span;
            for (int64_t b = b0; b < b1; b++)
                for (int64_t h = kv * G; h < (kv + 1) * G; h += MAX_G)
                    attend_d(q, k_cache, v_cache, block_tables + b * dm->W, seq_lens[b], b, h,
                             (kv + 1) * G - h < MAX_G ? (kv + 1) * G - h : MAX_G, kv, dm, out, mode,
                             b == longest && h == kv * G, j0, j1, parts + (b - b0) * G + (h - kv * G), kb, vb, last);
            if (last) break;
            j0 = j1;
        }
    }
    free(parts);
    return OK;
}

static int attend(const void *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                  const int64_t *seq_lens, void *out, int64_t B, const Dims *dm, int num_threads, int bf16) {
    if (dm->D % 8 || dm->D > MAX_D || dm->BS > MAX_BS || dm->kv_fp8 < 0 || dm->kv_fp8 > 2) return BAD_ARGUMENTS;
    /* groups of consecutive sequences whose tables agree with their group's first one on the blocks they
       read (attend_rows; only where they read: a table's later columns may hold anything), from first[g] */
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(B + 1)), groups = 0;
    if (!first) return OUT_OF_MEMORY;
    for (int64_t b = 0; b < B; b++) {
        const int64_t used = seq_lens[b] > 0 ? (seq_lens[b] + dm->BS - 1) / dm->BS : 0;
        if (!b || memcmp(block_tables + b * dm->W, block_tables + first[groups - 1] * dm->W,
                         sizeof(int64_t) * (size_t)(used < dm->W ? used : dm->W)))
            first[groups++] = b;
    }
    first[groups] = B;
    const int64_t parts = groups < num_threads ? dm->HKV : 1, items = groups * parts;
    const int threads = items < num_threads ? (int)items : num_threads; /* never wake a thread with nothing to do */
    const int mode = 2 * (int)dm->kv_fp8 + bf16;
    int status = OK;
    (void)threads;  /* without OpenMP: one thread */
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < items; i++) {
        const int64_t g = i / parts, kv0 = parts == 1 ? 0 : i % parts, kv1 = parts == 1 ? dm->HKV : kv0 + 1;
        if (attend_rows(q, k_cache, v_cache, block_tables, seq_lens, first[g], first[g + 1], kv0, kv1, dm, out,
                        mode) != OK) {
#pragma omp atomic write
            status = OUT_OF_MEMORY;
        }
    }
    free(first);
    return status;
}

/* k_cache, v_cache: q's dtype, or fp8 bytes (dm->kv_fp8) */
int paged_decode_f32(const float *q, const void *k_cache, const void *v_cache, const int64_t *block_tables,
                     const int64_t *seq_lens, float *out, int64_t B, const Dims *dm, int num_threads) {
    return attend(q, k_cache, v_cache, block_tables, seq_lens, out, B, dm, num_threads, 0);
}

int paged_decode_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
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

/* f rounded to fp8 (e4m3fn, or e5m2), to the nearest value, ties to even; from the largest finite value
   on (infinities too) saturated to it; a NaN stays NaN: torch's .to() after a clamp to that value. */
static inline __attribute__((always_inline)) uint8_t to_fp8(float f, const int e5m2) {
    const int mbits = e5m2 ? 2 : 3, shift = 23 - mbits, bias = e5m2 ? 15 : 7;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    u &= 0x7fffffffu;
    float a;
    memcpy(&a, &u, 4);
    if (u > 0x7f800000u) return sign | 0x7f;                           /* NaN */
    if (a >= (e5m2 ? 57344.f : 448.f)) return sign | (e5m2 ? 0x7b : 0x7e); /* the largest */
    if (a < (e5m2 ? 0x1p-14f : 0x1p-6f))  /* subnormal: a multiple of the smallest step (8 or 4 of them: the smallest normal) */
        return sign | (uint8_t)nearbyintf(a * (e5m2 ? 0x1p16f : 0x1p9f));
    u += (1u << (shift - 1)) - 1 + ((u >> shift) & 1); /* the mantissa to mbits, ties to even; a carry goes on up */
    return sign | (uint8_t)((u >> shift) - ((uint32_t)(127 - bias) << mbits));
}

static inline __attribute__((always_inline)) void fp8_row(uint8_t *dst, const char *src, int64_t n,
                                                          const int bf16, const int e5m2) {
    for (int64_t i = 0; i < n; i++)
        dst[i] = to_fp8(bf16 ? bf16_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i], e5m2);
}

/* store_kv for an fp8 cache (e5m2: 0 e4m3fn, 1 e5m2): rows of `row` values, fp32 or bf16 (src_bf16), each
   value rounded by to_fp8; every slot checked first. */
int store_kv_fp8(const char *k, int64_t k_stride, const char *v, int64_t v_stride, uint8_t *k_cache,
                 uint8_t *v_cache, const int64_t *slots, int64_t T, int64_t row, int64_t num_slots, int src_bf16,
                 int e5m2) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return OUT_OF_RANGE;
    for (int64_t t = 0; t < T; t++)
        for (int i = 0; i < 2; i++) {
            uint8_t *dst = (i ? v_cache : k_cache) + slots[t] * row;
            const char *src = i ? v + t * v_stride : k + t * k_stride;
            if (src_bf16 && e5m2) fp8_row(dst, src, row, 1, 1);
            else if (src_bf16) fp8_row(dst, src, row, 1, 0);
            else if (e5m2) fp8_row(dst, src, row, 0, 1);
            else fp8_row(dst, src, row, 0, 0);
        }
    return OK;
}

int paged_decode_f32_packed(const int64_t *a) { return paged_decode_f32(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), PTR(5), a[6], PTR(7), (int)a[8]); }
int paged_decode_bf16_packed(const int64_t *a) { return paged_decode_bf16(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), PTR(5), a[6], PTR(7), (int)a[8]); }
int store_kv_packed(const int64_t *a) { return store_kv(PTR(0), a[1], PTR(2), a[3], PTR(4), PTR(5), PTR(6), a[7], a[8], a[9]); }
int store_kv_fp8_packed(const int64_t *a) { return store_kv_fp8(PTR(0), a[1], PTR(2), a[3], PTR(4), PTR(5), PTR(6), a[7], a[8], a[9], (int)a[10], (int)a[11]); }
