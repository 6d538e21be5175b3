/* y = x W^T (+ b) on the CPU for the few-row steps of decoding, where torch's GEMM (MKL) runs far
 * below the memory floor (measured on an AVX2 EPYC: 7-8 GB/s of weights at 1 row, 2-3 GB/s at 2 to
 * 32, against 17 GB/s for a copy).
 *
 *   x (M, K), W (N, K), b (N) or NULL, y (M, N); all contiguous; x, W, b and y of one dtype,
 *   fp32 or bf16 (widened on load, rounded to nearest even on store, as torch rounds); fp32
 *   arithmetic throughout, the bias added before the one rounding.
 *
 * Each thread takes a contiguous range of W's rows, so every weight is read from memory once,
 * front to back. Within it, a tile of NR weight rows (a few KiB: it stays in L1) meets every
 * group of up to MR rows of x (x stays in L2): MR x NR accumulators of 8 lanes, so per 8 columns
 * of K, MR + NR loads from cache feed MR x NR fused multiply-adds. 3 x 3 measured best on AVX2
 * (16 registers: 9 accumulators, 3 weights, 1 row of x, and no spill); 4 x 3 spilled. With AVX-512's
 * 32 registers (its 8-lane instructions too), 4 x 4: a dense 2048 x 2048 at 32 rows 2.27-2.29 -> 1.82-1.85
 * ms on an AMX Xeon, in turns. A sum over
 * K runs in 8 lanes, which are summed as a tree at the end: a row's result does not depend on M.
 * The weight rows after the tile are prefetched as it goes (rows of a few KiB are too short for the
 * hardware prefetcher to ramp up on): +10-40% at 1 to 4 rows, measured.
 *
 * Packed weights (``linear_q_*``): W as GGUF blocks along K, as llama.cpp keeps them: blocks of 32 (Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL: an fp16 scale, an fp16 minimum for Q4_1 and Q5_1, 4-, 5- or 8-bit integers,
 * IQ4's an index into 16 levels; MXFP4: a power of two and FP4 values, GPT-OSS's experts) and super-blocks of 256 (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: sub-blocks of
 * 16 or 32 with scales of their own, read 32 weights at a time like a block of 32), or as Q4_Z blocks (an fp16
 * scale, an fp16 zero point, 4-bit integers: AWQ's and GPTQ's groups, ``engine/quant.py``): 2.6 to 8.5 bits a
 * weight instead of 32, and a single-stream step reads that much less. Up to IN_REGISTERS_UP_TO rows of x each block is expanded in
 * registers as it is used; past that, each work item's rows are expanded KC columns at a time into a
 * buffer of floats that stays in L1, which every row of x meets before the next KC columns (each tile's
 * lanes kept between them, so the sums run as above). A whole work item's rows expanded at once (24 KiB
 * at K = 1024) stayed in L2: a Q4_1 2048 x 2048 at 16, 32, 64 rows took 1.00-1.23, 2.01-2.42, 3.74-4.37 ms
 * that way with 3 x 3 tiles, 0.93-1.01, 1.64-1.69, 3.01-3.10 this way with 4 x 4 (the AMX Xeon, in turns).
 * The expansion is exact (a product of an fp16 scale,
 * a 6- or 8-bit sub-block scale and a small integer is exact or rounded once, as gguf's dequantize rounds
 * it, and so is a minimum's one addition), so a row's result is bit for bit the dense kernel's on the
 * dequantized weights, at any number of rows (not the dot products' below). Past X_CHUNK_ROWS rows, x is taken in chunks, each
 * against every work item of the thread (each expanded again).
 *
 * A bf16 step of 16 rows or more (``linear_q_dot_bf16``, where AVX512-BF16 compiles: a prompt's, or a batch of
 * decodes') multiplies the blocks, whose weights are d q + m for each 32 or 16, by their integers, in vdpbf16ps's
 * exact bf16 products: see "bf16 steps of many rows" below.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "packed.h"
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#ifdef __AVX512VL__ /* 32 vector registers: 16 accumulators, 4 weights, 1 row of x */
#define MR 4
#define NR 4
#else
#define MR 3
#define NR 3
#endif
#define NB (2 * NR) /* weight rows per work item */
#define NB_PACKED 6 /* ... where packed weights are expanded in registers: 3 x 2 or 1 x 6 accumulators at a time */

/* rows of x up to which packed weights are expanded in registers (up to four rows at a time), not into a
   buffer: for the default model's layers at 2 rows 10.6 ms against 18.6; for a 4096 x 2048 Q4_1 weight on
   the AVX-512 EPYC at 6 and 8 rows 0.93 and 1.11 ms against 1.86 and 2.09 (Q4_K: 1.19, 1.40 against 1.36,
   1.68); from 12 rows on the buffer wins by 8-15%, measured */
#define IN_REGISTERS_UP_TO 8
#define PACKED_AHEAD 4096 /* bytes of packed weights prefetched ahead when expanding them into a buffer */
#define KC 256 /* columns of K a pass of the buffered packed kernel: whole super-blocks, a few KiB a weight row */
#define X_CHUNK_ROWS 64 /* rows of x a pass over the packed weights (a work item expanded again for each pass) */

/* acc + a * b, always fused where the CPU can (explicitly: gcc fuses some of the spelled-out forms and
   not others, and then a row's result would depend on the tile that computed it) */
#ifdef __FMA__
#define FMA8(acc, a, b) ((v8f)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(acc)))
#define FMA1(acc, a, b) fmaf((a), (b), (acc))
#else
#define FMA8(acc, a, b) ((acc) + (a) * (b))
#define FMA1(acc, a, b) ((acc) + (a) * (b))
#endif

/* Loaded once into a register and used from there: left alone, gcc folds the load into every
   multiply-add that uses it, and the loads, not the multiply-adds, set the pace. */
#if defined(__GNUC__) && defined(__AVX__)
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#else
#define IN_REGISTER(v) (void)0
#endif

/* 8 weights from column k of a row, as floats */
static inline __attribute__((always_inline)) v8f load_w(const void *w, int64_t at, int bf16) {
    return bf16 ? widen8((const uint16_t *)w + at) : *(const v8f_u *)((const float *)w + at);
}

static inline float hsum(v8f a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

static inline void store(void *y, int64_t at, float v, int bf16) {
    if (bf16)
        ((uint16_t *)y)[at] = float_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

/* y[at] = a row's sum, plus b[n] where there is a bias (added before the one rounding) */
static inline void store_biased(void *y, int64_t at, float sum, const void *b, int64_t n, int bf16) {
    if (b) sum += bf16 ? bf16_to_float(((const uint16_t *)b)[n]) : ((const float *)b)[n];
    store(y, at, sum, bf16);
}

/* y[m0:m0+R, n0:n0+C] = x[m0:m0+R] . w[0:C]^T (+ b[n0:n0+C]), w the tile's first weight row (the rows
   after it K apart; prefetched as it goes), R <= MR and C <= NR constants once inlined:
   every loop over them unrolled, so the accumulators live in registers. wbf16: the weights are bf16;
   obf16: the bias and y are. */
static inline __attribute__((always_inline)) void tile(const float *xf, const char *w,
                                                       const void *b, void *y, int64_t m0, const int R, int64_t n0,
                                                       const int C, int64_t N, int64_t K, const int wbf16,
                                                       const int obf16) {
    const int64_t row = K * (wbf16 ? 2 : 4);
    v8f acc[MR][NB];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) acc[i][j] = (v8f){0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if ((k & 15) == 0) /* the next C rows, a line at a time: short rows defeat the hardware's prefetcher */
#pragma GCC unroll 8
            for (int j = 0; j < C; j++)
                if (n0 + C + j < N) __builtin_prefetch(w + (C + j) * row + k * (wbf16 ? 2 : 4));
        v8f wv[NB];
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) {
            wv[j] = load_w(w, j * K + k, wbf16);
            IN_REGISTER(wv[j]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            v8f xv = *(const v8f_u *)(xf + (m0 + i) * K + k);
            IN_REGISTER(xv);
#pragma GCC unroll 8
            for (int j = 0; j < C; j++) acc[i][j] = FMA8(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            float sum = hsum(acc[i][j]);
            const int64_t n = n0 + j;
            for (int64_t kk = k; kk < K; kk++)
                sum = FMA1(sum, xf[(m0 + i) * K + kk], wbf16 ? bf16_to_float(((const uint16_t *)w)[j * K + kk])
                                                             : ((const float *)w)[j * K + kk]);
            store_biased(y, (m0 + i) * N + n, sum, b, n, obf16);
        }
}

/* The rows m0.. (up to MR of them) against the weight rows n0.. (NR, or 1 in N's tail). */
static inline __attribute__((always_inline)) void tiles(const float *xf, const char *w,
                                                        const void *b, void *y, int64_t m0, int64_t mr, int64_t n0,
                                                        const int C, int64_t N, int64_t K, const int wbf16,
                                                        const int obf16) {
    switch (mr) {
#if MR > 3
    case 4: tile(xf, w, b, y, m0, 4, n0, C, N, K, wbf16, obf16); break;
#endif
    case 3: tile(xf, w, b, y, m0, 3, n0, C, N, K, wbf16, obf16); break;
    case 2: tile(xf, w, b, y, m0, 2, n0, C, N, K, wbf16, obf16); break;
    default: tile(xf, w, b, y, m0, 1, n0, C, N, K, wbf16, obf16);
    }
}

/* Every row of x against the weight rows of block t (NB of them, or N's tail a row at a time), whose
   first row is at w. One row of x has NB accumulators, a chain per weight row: more loads in flight
   than NR would give. */
static inline __attribute__((always_inline)) void column(const float *xf, const char *w,
                                                         const void *b, void *y, int64_t M, int64_t N, int64_t K,
                                                         int64_t t, const int wbf16, const int obf16) {
    const int64_t n0 = t * NB, row = K * (wbf16 ? 2 : 4);
    if (n0 + NB > N) {
        for (int64_t m0 = 0; m0 < M; m0 += MR)
            for (int64_t n = n0; n < N; n++)
                tiles(xf, w + (n - n0) * row, b, y, m0, M - m0 < MR ? M - m0 : MR, n, 1, N, K, wbf16, obf16);
    } else {
        for (int64_t m0 = 0; m0 < M; m0 += MR)
            if (M - m0 == 1) /* a last row alone: against all NB rows at once, or its NR chains would wait */
                tile(xf, w, b, y, m0, 1, n0, NB, N, K, wbf16, obf16);
            else
                for (int64_t n = n0; n < n0 + NB; n += NR)
                    tiles(xf, w + (n - n0) * row, b, y, m0, M - m0 < MR ? M - m0 : MR, n, NR, N, K, wbf16,
                          obf16);
    }
}

/* One function per dtype, with the dtype a constant in it: OpenMP outlines its loop body before
   constants propagate, so the branch on the dtype must be taken outside the loops. */
static void column_f32(const float *xf, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                       int64_t t) {
    column(xf, (const char *)w + t * NB * K * 4, b, y, M, N, K, t, 0, 0);
}

static void column_bf16(const float *xf, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                        int64_t t) {
    column(xf, (const char *)w + t * NB * K * 2, b, y, M, N, K, t, 1, 1);
}

/* x as floats: x itself, or (bf16) a widened copy to free after; NULL when out of memory */
static float *widened(const void *x, int64_t n, int bf16) {
    if (!bf16) return (float *)x;
    float *wide = malloc(sizeof(float) * (n ? n : 1));
    if (wide)
        for (int64_t i = 0; i < n; i++) wide[i] = bf16_to_float(((const uint16_t *)x)[i]);
    return wide;
}

/* The exported functions return OK, or OUT_OF_MEMORY (y unwritten), or BAD_ARGUMENTS (which matmul.py never
   passes): packed.h's codes. */

static int linear(const void *x, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                  int num_threads, int bf16) {
    float *xf = widened(x, M * K, bf16); /* once: it is read once per NR weight rows */
    if (!xf) return OUT_OF_MEMORY;
    const int64_t tiles_n = (N + NB - 1) / NB;
    (void)num_threads; /* without OpenMP: one thread */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles_n; t++) {
        if (bf16)
            column_bf16(xf, w, b, y, M, N, K, t);
        else
            column_f32(xf, w, b, y, M, N, K, t);
    }
    if (bf16) free(xf);
    return OK;
}

int linear_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
               int num_threads) {
    return linear(x, w, b, y, M, N, K, num_threads, 0);
}

int linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                int64_t K, int num_threads) {
    return linear(x, w, b, y, M, N, K, num_threads, 1);
}

/* ------------------------------------------------------------------------------ packed weights */

enum { Q4_0, Q4_1, Q8_0, Q4_Z, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4, FORMATS }; /* PACKED_FORMATS */
static const int64_t BLOCK_WEIGHTS[] = {32, 32, 32, 32, 32, 32, 256, 256, 256, 256, 256, 32, 256, 32};
static const int64_t BLOCK_BYTES[] = {18, 20, 34, 20, 22, 24, 144, 176, 210, 84, 110, 18, 136, 17};
#define K_QUANT(fmt) (BLOCK_WEIGHTS[fmt] == 256) /* super-blocks of 256, with scales of their own (k_scales) */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's (GPT-OSS's experts): FP4 E2M1's values doubled, halved again by the block's scale (e8m0_half) */
static const int8_t MXFP4_LEVELS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float e8m0_half(uint8_t e) { /* 2^(e - 128), exactly (a subnormal float for e < 2), as ggml's */
    const uint32_t u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float half_to_float(const uint8_t *p) { /* exact: every fp16 is a float */
    uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h >> 10 & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f)
        u = sign | 0x7f800000 | man << 13; /* inf, NaN */
    else if (exp)
        u = sign | (exp + 112) << 23 | man << 13;
    else if (!man)
        u = sign;
    else { /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) man <<= 1, exp--;
        u = sign | exp << 23 | (man & 0x3ff) << 13;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* A K-quant super-block's scales as floats, once for its 8 sub-blocks: Q4_K and Q5_K d sc of sub-block g at
   [g] and -(dmin m) at [8 + g] (their 6-bit scales and minimums unpacked 4 at a time, as llama.cpp does);
   Q6_K d sc of its 16 groups of 16; Q3_K d (sc - 32) of those; Q2_K d sc at [i] and -(dmin m) at [16 + i];
   IQ4_XS d (sc - 32) of its 8 groups of 32. Each product is exact. */
static inline __attribute__((always_inline)) void k_scales(const uint8_t *blk, const int fmt, float s[32]) {
    if (fmt == Q2_K) {
        const float d = half_to_float(blk + 80), dmin = half_to_float(blk + 82);
#if defined(__AVX2__) && defined(__F16C__)
        const __m128i v = _mm_loadu_si128((const __m128i *)blk), low = _mm_set1_epi8(15);
        const __m128i part[2] = {_mm_and_si128(v, low), _mm_and_si128(_mm_srli_epi16(v, 4), low)};
        for (int h = 0; h < 2; h++) /* scales, then minimums */
            for (int i = 0; i < 2; i++)
                _mm256_storeu_ps(s + 16 * h + 8 * i, _mm256_mul_ps(_mm256_set1_ps(h ? -dmin : d), _mm256_cvtepi32_ps(
                                                          _mm256_cvtepu8_epi32(i ? _mm_srli_si128(part[h], 8) : part[h]))));
#else
        for (int i = 0; i < 16; i++) s[i] = d * (float)(blk[i] & 15), s[16 + i] = -(dmin * (float)(blk[i] >> 4));
#endif
        return;
    }
    if (fmt == Q3_K) { /* scale i: 4 bits from byte i mod 8 (half i / 8), 2 from byte 8 + i mod 4 (bits 2 (i / 4)) */
        uint64_t lo;
        uint32_t hi;
        memcpy(&lo, blk + 96, 8), memcpy(&hi, blk + 104, 4);
        const uint64_t v[2] = {(lo & 0x0f0f0f0f0f0f0f0f) | ((uint64_t)(hi >> 2 & 0x03030303) << 32 | (hi & 0x03030303)) << 4,
                               (lo >> 4 & 0x0f0f0f0f0f0f0f0f) |
                                   ((uint64_t)(hi >> 6 & 0x03030303) << 32 | (hi >> 4 & 0x03030303)) << 4};
        uint8_t b[16];
        memcpy(b, v, 16);
        const float d = half_to_float(blk + 108);
        for (int i = 0; i < 16; i++) s[i] = d * (float)((int)b[i] - 32);
        return;
    }
    if (fmt == IQ4_XS) { /* scale i: 4 bits from byte 4 + i / 2 (half i mod 2), 2 from bits 2i of the 16 at 2 */
        const float d = half_to_float(blk);
        const int high = blk[2] | blk[3] << 8;
#if defined(__AVX2__) && defined(__F16C__)
        const __m256i lo = _mm256_setr_epi32(blk[4], blk[4], blk[5], blk[5], blk[6], blk[6], blk[7], blk[7]);
        const __m256i ls = _mm256_or_si256(
            _mm256_and_si256(_mm256_srlv_epi32(lo, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)), _mm256_set1_epi32(15)),
            _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high),
                                                                 _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
                                               _mm256_set1_epi32(3)), 4));
        _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)))));
#else
        for (int i = 0; i < 8; i++) s[i] = d * (float)(((blk[4 + i / 2] >> 4 * (i % 2) & 15) | (high >> 2 * i & 3) << 4) - 32);
#endif
        return;
    }
    if (fmt == Q6_K) {
        const float d = half_to_float(blk + 208);
#if defined(__AVX2__) && defined(__F16C__)
        const __m128i v = _mm_loadu_si128((const __m128i *)(blk + 192));
        _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
        _mm256_storeu_ps(s + 8, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
#else
        for (int i = 0; i < 16; i++) s[i] = d * (float)(int8_t)blk[192 + i];
#endif
        return;
    }
    uint32_t a, b, c, u[4];
    memcpy(&a, blk + 4, 4), memcpy(&b, blk + 8, 4), memcpy(&c, blk + 12, 4);
    u[0] = a & 0x3f3f3f3f, u[1] = (c & 0x0f0f0f0f) | (a >> 2 & 0x30303030); /* scales 0-3, 4-7 */
    u[2] = b & 0x3f3f3f3f, u[3] = (c >> 4 & 0x0f0f0f0f) | (b >> 2 & 0x30303030); /* minimums 0-3, 4-7 */
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i v = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(half_to_float(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))));
    _mm256_storeu_ps(s + 8, _mm256_xor_ps(_mm256_set1_ps(-0.0f), _mm256_mul_ps(
        _mm256_set1_ps(half_to_float(blk + 2)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))))));
#else
    uint8_t v[16];
    memcpy(v, u, 16); /* (bytes in order on little-endian machines, as the blocks themselves assume) */
    const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
    for (int i = 0; i < 8; i++) s[i] = d * (float)v[i], s[8 + i] = -(dmin * (float)v[8 + i]);
#endif
}

/* Weights 32 g .. 32 g + 31 of one block (g = 0 for the blocks of 32) as floats, one at a time: the
   spec of the vector code below, and the code where it does not compile. Q4_0 d (q - 8), Q5_0 d (q - 16),
   Q4_1 and Q5_1 d q + m, Q8_0 d q, Q4_Z d (q - z), IQ4_NL d IQ4_LEVELS[q]; Q4_K, Q5_K and Q2_K (d sc) q - dmin m,
   Q6_K (d sc) (q - 32), Q3_K (d sc) q, IQ4_XS (d sc) IQ4_LEVELS[q], as reference.py lays them out, their scales
   from k_scales (s). Every product is exact; a sum is rounded
   once (fused or not). */
static inline __attribute__((always_inline)) void expand_scalar(const uint8_t *blk, const int fmt, const int g,
                                                                const float s[32], float f[32]) {
    if (fmt == Q2_K || fmt == Q3_K) {
        const uint8_t *qs = blk + (fmt == Q2_K ? 16 : 32) + 32 * (g >> 2);
        const int shift = 2 * (g & 3);
        for (int l = 0; l < 32; l++) {
            const int q = qs[l] >> shift & 3, group = 2 * g + (l >> 4);
            f[l] = fmt == Q2_K ? s[group] * (float)q + s[16 + group] : s[group] * (float)(q - (blk[l] >> g & 1 ? 0 : 4));
        }
    } else if (fmt == IQ4_NL || fmt == IQ4_XS || fmt == MXFP4) {
        const uint8_t *qs = blk + (fmt == IQ4_NL ? 2 : fmt == MXFP4 ? 1 : 8 + 16 * g);
        const float d = fmt == IQ4_NL ? half_to_float(blk) : fmt == MXFP4 ? e8m0_half(blk[0]) : s[g];
        const int8_t *levels = fmt == MXFP4 ? MXFP4_LEVELS : IQ4_LEVELS;
        for (int i = 0; i < 32; i++) f[i] = d * (float)levels[i < 16 ? qs[i] & 15 : qs[i - 16] >> 4];
    } else if (fmt == Q6_K) {
        const int h = g >> 2, r = g & 3;
        const uint8_t *ql = blk + 64 * h + 32 * (r & 1), *qh = blk + 128 + 32 * h;
        for (int l = 0; l < 32; l++)
            f[l] = s[2 * g + (l >> 4)] * (float)(((r >> 1 ? ql[l] >> 4 : ql[l] & 15) | (qh[l] >> 2 * r & 3) << 4) - 32);
    } else if (K_QUANT(fmt)) {
        const uint8_t *qs = blk + (fmt == Q4_K ? 16 : 48) + 32 * (g >> 1);
        for (int l = 0; l < 32; l++) {
            const int q = (g & 1 ? qs[l] >> 4 : qs[l] & 15) | (fmt == Q5_K ? (blk[16 + l] >> g & 1) << 4 : 0);
            f[l] = s[g] * (float)q + s[8 + g];
        }
    } else if (fmt == Q8_0) {
        const float d = half_to_float(blk);
        for (int i = 0; i < 32; i++) f[i] = d * (float)(int8_t)blk[2 + i];
    } else {
        const float d = half_to_float(blk);
        const int five = fmt == Q5_0 || fmt == Q5_1, with_m = fmt != Q4_0 && fmt != Q5_0;
        const float m = with_m ? half_to_float(blk + 2) : 0.0f;
        const uint8_t *qs = blk + 2 + 2 * with_m + 4 * five;
        uint32_t qh = 0;
        if (five) memcpy(&qh, blk + 2 + 2 * with_m, 4); /* little-endian, as x86 and ARM store it */
        for (int i = 0; i < 32; i++) {
            const int q = (i < 16 ? qs[i] & 15 : qs[i - 16] >> 4) | (five ? (int)(qh >> i & 1) << 4 : 0);
            f[i] = fmt == Q4_1 || fmt == Q5_1 ? d * (float)q + m
                 : fmt == Q4_Z ? d * ((float)q - m) : d * (float)(q - (fmt == Q4_0 ? 8 : 16));
        }
    }
}

#if defined(__AVX2__) && defined(__F16C__)
/* 32 bytes of small integers as 4 vectors of 8 floats, in order; signed: the bytes are int8, else uint8 */
static inline __attribute__((always_inline)) void widen32(__m256i q, const int sign, __m256 out[4]) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++)
        out[i] = _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(part[i]) : _mm256_cvtepu8_epi32(part[i]));
}

/* expand_scalar's K-quants, in vectors: 32 weights are 32 consecutive bytes' halves (and bits); sub-block
   g is not a constant (variable shifts, no branches) */
static inline __attribute__((always_inline)) void expand_k(const uint8_t *blk, const int fmt, const int g,
                                                           const float s[32], v8f out[4]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 q[4];
    if (fmt == Q6_K) {
        const int h = g >> 2, r = g & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (r & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        /* bits 2r, 2r + 1 of each byte of qh to bits 4, 5 (shifts of 16-bit lanes: the masks keep bytes apart) */
        const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), 4),
                                            _mm256_set1_epi8(0x30));
        const __m256i q6 = _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r >> 1))), low), hi);
        widen32(_mm256_sub_epi8(q6, _mm256_set1_epi8(32)), 1, q); /* q - 32, exact in int8 */
        const __m256 da = _mm256_broadcast_ss(s + 2 * g), db = _mm256_broadcast_ss(s + 2 * g + 1);
        for (int i = 0; i < 4; i++) out[i] = (v8f)_mm256_mul_ps(i < 2 ? da : db, q[i]);
        return;
    }
    __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (fmt == Q4_K ? 16 : 48) + 32 * (g >> 1)));
    qs = _mm256_and_si256(_mm256_srl_epi16(qs, _mm_cvtsi32_si128(4 * (g & 1))), low);
    if (fmt == Q5_K) { /* bit g of each byte to bit 4 */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        qs = _mm256_or_si256(qs, _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)), 4),
                                                  _mm256_set1_epi8(0x10)));
    }
    widen32(qs, 0, q);
    const __m256 d1 = _mm256_broadcast_ss(s + g), m1 = _mm256_broadcast_ss(s + 8 + g);
    for (int i = 0; i < 4; i++) out[i] = (v8f)_mm256_fmadd_ps(d1, q[i], m1);
}
#endif

/* The 32 weights of one block (of a K-quant's super-block: sub-block g, its scales s), in 4 vectors of 8
   (expand_scalar's). */
static inline __attribute__((always_inline)) void expand_block(const uint8_t *blk, const int fmt, const int g,
                                                               const float s[32], v8f out[4]) {
#if defined(__AVX2__) && defined(__F16C__)
    if (fmt == Q4_K || fmt == Q5_K || fmt == Q6_K) {
        expand_k(blk, fmt, g, s, out);
        return;
    }
    if (fmt == Q2_K || fmt == Q3_K) { /* 2 bits of 32 consecutive bytes (Q3_K: and a bit of 32 more); 2 groups */
        __m256i q = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(blk + (fmt == Q2_K ? 16 : 32)
                                                                                            + 32 * (g >> 2))),
                                                      _mm_cvtsi32_si128(2 * (g & 3))), _mm256_set1_epi8(3));
        if (fmt == Q3_K) /* q - 4 where bit g of the mask byte is clear: q | bit << 2, less 4, in int8 */
            q = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(
                _mm256_loadu_si256((const __m256i *)blk), _mm_cvtsi32_si128(g)), _mm256_set1_epi8(1)), 2)),
                                _mm256_set1_epi8(4));
        __m256 v[4];
        widen32(q, fmt == Q3_K, v);
        for (int i = 0; i < 4; i++) {
            const __m256 dl = _mm256_broadcast_ss(s + 2 * g + i / 2);
            out[i] = (v8f)(fmt == Q2_K ? _mm256_fmadd_ps(dl, v[i], _mm256_broadcast_ss(s + 16 + 2 * g + i / 2))
                                       : _mm256_mul_ps(dl, v[i]));
        }
        return;
    }
    /* d and m (a Q4_1 or Q5_1 block starts with both; a Q4_Z block with d and z) widened by one instruction */
    int32_t dm;
    memcpy(&dm, blk, 4);
    const __m128 both = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    const __m256 dv = _mm256_broadcastss_ps(both), mv = _mm256_broadcastss_ps(_mm_movehdup_ps(both));
    if (fmt == Q8_0) {
        for (int i = 0; i < 4; i++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * i))));
            out[i] = (v8f)_mm256_mul_ps(dv, q);
        }
        return;
    }
    const int five = fmt == Q5_0 || fmt == Q5_1, with_m = fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_Z;
    const int iq4 = fmt == IQ4_NL || fmt == IQ4_XS || fmt == MXFP4; /* 4 bits an index into 16 levels */
    /* the 16 bytes in both halves of a register; then byte j of 8 (j < 4: from the low half, else the
       high) goes to the low byte of 32-bit lane j, zeros above it: in-lane shuffles, no widening across
       (9.0 -> 7.7 ms for the default model's layers at one row, measured) */
    const uint8_t *qs = blk + (fmt == IQ4_XS ? 8 + 16 * g : fmt == MXFP4 ? 1 : 2 + 2 * with_m + 4 * five);
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i half[2] = {_mm256_and_si256(bytes, low), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low)};
    if (iq4) { /* each 4 bits an index into the levels: one in-lane lookup a half */
        const __m256i levels = _mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)(fmt == MXFP4 ? MXFP4_LEVELS : IQ4_LEVELS)));
        for (int h = 0; h < 2; h++) half[h] = _mm256_shuffle_epi8(levels, half[h]);
    }
    if (five) { /* the fifth bits of half h's 16 weights as 0x10 in its bytes (both halves of the register):
                   bit j of the word to byte j, as llama.cpp's bytes_from_bits_32 does */
        int32_t bits;
        memcpy(&bits, blk + 2 + 2 * with_m, 4);
        const __m256i word = _mm256_set1_epi32(bits), all = _mm256_set1_epi8(-1);
        const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe); /* byte k: every bit but bit k */
        for (int h = 0; h < 2; h++) {
            const int64_t lo = 0x0101010101010101 * (2 * h), hi = 0x0101010101010101 * (2 * h + 1);
            const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(_mm256_shuffle_epi8(word, _mm256_set_epi64x(hi, lo, hi, lo)), others), all);
            half[h] = _mm256_or_si256(half[h], _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
    }
    const __m256i pick[2] = {
        _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, 6,
                         -1, -1, -1, 7, -1, -1, -1),
        _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1, 12, -1, -1, -1, 13, -1, -1, -1,
                         14, -1, -1, -1, 15, -1, -1, -1)};
    const __m256 scale = iq4 ? _mm256_set1_ps(fmt == IQ4_NL ? half_to_float(blk) : fmt == MXFP4 ? e8m0_half(blk[0])
                                              : s[g]) : dv;
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 2; i++) {
            __m256i qi = _mm256_shuffle_epi8(half[h], pick[i]);
            if (iq4) qi = _mm256_srai_epi32(_mm256_slli_epi32(qi, 24), 24); /* a signed level: its sign above it */
            const __m256 q = _mm256_cvtepi32_ps(qi);
            out[2 * h + i] = (v8f)(iq4 ? _mm256_mul_ps(scale, q)
                                   : fmt == Q4_1 || fmt == Q5_1 ? _mm256_fmadd_ps(dv, q, mv)
                                   : _mm256_mul_ps(dv, _mm256_sub_ps(q, fmt == Q4_Z ? mv
                                                                     : _mm256_set1_ps(fmt == Q4_0 ? 8.0f : 16.0f))));
        }
#else
    float f[32];
    expand_scalar(blk, fmt, g, s, f);
    memcpy(out, f, sizeof f);
#endif
}

/* y[m0:m0+R, n0:n0+C] = x[m0:m0+R] . w[0:C]^T (+ b), w's rows packed, for steps of very few rows: each
   block is expanded in registers as it is used (an expanded weight used by one or two rows would only cost
   to store). Each (row, weight row) keeps its own 8 lanes, summed over K in the same order as tile's: the
   same result, bit for bit. */
static inline __attribute__((always_inline)) void tile_packed(const float *xf, const uint8_t *w, const int fmt,
                                                              const void *b, void *y, int64_t m0, const int R,
                                                              int64_t n0, const int C, int64_t N, int64_t K,
                                                              const int obf16) {
    const int64_t row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    v8f acc[4][NB_PACKED];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) acc[i][j] = (v8f){0};
    /* the rows after these (the next tile's), a line or two per block: all on their way by the time this
       tile ends. One line per block, at the same place in the next row, left most of them to the
       hardware: 15.4 -> 9.0 ms for the default model's layers at one row, measured. */
    const char *ahead = (const char *)w + C * row_bytes;
    const int64_t step = (C * row_bytes / (K / 32) + 63) / 64 * 64;
    float scales[NB_PACKED][32]; /* a K-quant's: each weight row's current super-block's, read once */
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t at = k / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
        const int g = (int)(k % BLOCK_WEIGHTS[fmt] / 32);
        if (m0 == 0)
            for (int64_t o = 0; o < step; o += 64) __builtin_prefetch(ahead + k / 32 * step + o);
        if (K_QUANT(fmt) && g == 0)
            for (int j = 0; j < C; j++) k_scales(w + j * row_bytes + at, fmt, scales[j]);
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) {
            v8f wv[4];
            expand_block(w + j * row_bytes + at, fmt, g, scales[j], wv);
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
                for (int i = 0; i < R; i++)
                    acc[i][j] = FMA8(acc[i][j], *(const v8f_u *)(xf + (m0 + i) * K + k + 8 * q), wv[q]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            store_biased(y, (m0 + i) * N + n0 + j, hsum(acc[i][j]), b, n0 + j, obf16);
        }
}

/* Every row of x (a few) against work item t, expanded in registers: one row against its NB_PACKED weight
   rows at once, two rows against 3 at a time, three or four against 2 (each expansion used by every row it can
   be, 6 to 8 accumulators; four rows against 3 spilled, eight against 1 was slower, measured). */
static inline __attribute__((always_inline)) void column_packed(const float *xf, const uint8_t *w, const int fmt,
                                                                const void *b, void *y, int64_t M, int64_t N,
                                                                int64_t K, int64_t t, const int obf16) {
    const int64_t n0 = t * NB_PACKED, row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        if (n0 + NB_PACKED > N) {
            for (int64_t n = n0; n < N; n++)
                if (left >= 2)
                    tile_packed(xf, w + n * row_bytes, fmt, b, y, m0, 2, n, 1, N, K, obf16);
                else
                    tile_packed(xf, w + n * row_bytes, fmt, b, y, m0, 1, n, 1, N, K, obf16);
            m0 += left >= 2 ? 2 : 1;
        } else if (left >= 4) {
            for (int64_t n = n0; n < n0 + NB_PACKED; n += 2)
                tile_packed(xf, w + n * row_bytes, fmt, b, y, m0, 4, n, 2, N, K, obf16);
            m0 += 4;
        } else if (left == 3) {
            for (int64_t n = n0; n < n0 + NB_PACKED; n += 2)
                tile_packed(xf, w + n * row_bytes, fmt, b, y, m0, 3, n, 2, N, K, obf16);
            m0 += 3;
        } else if (left >= 2) {
            for (int64_t n = n0; n < n0 + NB_PACKED; n += 3)
                tile_packed(xf, w + n * row_bytes, fmt, b, y, m0, 2, n, 3, N, K, obf16);
            m0 += 2;
        } else {
            tile_packed(xf, w + n0 * row_bytes, fmt, b, y, m0, 1, n0, NB_PACKED, N, K, obf16);
            m0 += 1;
        }
    }
}

/* rows of K weights each, packed, into floats */
static inline __attribute__((always_inline)) void expand_rows(const uint8_t *w, const int fmt, float *out,
                                                               int64_t rows, int64_t K) {
    const int64_t blocks = rows * (K / BLOCK_WEIGHTS[fmt]); /* (rows are whole blocks) */
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *blk = w + i * BLOCK_BYTES[fmt];
        float scales[32];
        if (K_QUANT(fmt)) k_scales(blk, fmt, scales);
        for (int g = 0; g < BLOCK_WEIGHTS[fmt] / 32; g++) {
            v8f v[4];
            expand_block(blk, fmt, g, scales, v);
            memcpy(out + i * BLOCK_WEIGHTS[fmt] + 32 * g, v, sizeof v);
        }
        __builtin_prefetch(blk + PACKED_AHEAD);
    }
}

/* a case per format, each with its constant inlined */
static void expand(const uint8_t *w, int fmt, float *out, int64_t rows, int64_t K) {
#define EXPAND(F)                                                                                                  \
    case F: expand_rows(w, F, out, rows, K); break;
    switch (fmt) {
        EXPAND(Q4_0)
        EXPAND(Q4_1)
        EXPAND(Q8_0)
        EXPAND(Q4_Z)
        EXPAND(Q5_0)
        EXPAND(Q5_1)
        EXPAND(Q4_K)
        EXPAND(Q5_K)
        EXPAND(Q6_K)
        EXPAND(Q2_K)
        EXPAND(Q3_K)
        EXPAND(IQ4_NL)
        EXPAND(IQ4_XS)
        EXPAND(MXFP4)
    }
#undef EXPAND
}

/* A few rows of x against work item t: a case per format and dtype, each with its constants inlined. */
static void rows_packed(const float *xf, const uint8_t *w, int fmt, const void *b, void *y, int64_t M, int64_t N,
                        int64_t K, int64_t t, int obf16) {
#define ROWS_PACKED(F)                                                                                             \
    case F:                                                                                                       \
        if (obf16)                                                                                                \
            column_packed(xf, w, F, b, y, M, N, K, t, 1);                                                         \
        else                                                                                                      \
            column_packed(xf, w, F, b, y, M, N, K, t, 0);                                                         \
        break;
    switch (fmt) {
        ROWS_PACKED(Q4_0)
        ROWS_PACKED(Q4_1)
        ROWS_PACKED(Q8_0)
        ROWS_PACKED(Q4_Z)
        ROWS_PACKED(Q5_0)
        ROWS_PACKED(Q5_1)
        ROWS_PACKED(Q4_K)
        ROWS_PACKED(Q5_K)
        ROWS_PACKED(Q6_K)
        ROWS_PACKED(Q2_K)
        ROWS_PACKED(Q3_K)
        ROWS_PACKED(IQ4_NL)
        ROWS_PACKED(IQ4_XS)
        ROWS_PACKED(MXFP4)
    }
#undef ROWS_PACKED
}

/* accs[m0:m0+R][0:C] += x[m0:m0+R, k0:k0+kc] . w[0:C]^T: w the first of C weight rows expanded (kc apart, in
   L1), accs the tile's lanes, kept between passes over K (each lane sums its columns in tile's order: the
   same result, bit for bit) */
static inline __attribute__((always_inline)) void part(const float *xf, const float *w, v8f *accs, int64_t m0,
                                                       const int R, const int C, int64_t K, int64_t k0, int64_t kc) {
    v8f acc[MR][NB];
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) acc[i][j] = accs[(m0 + i) * NB + j];
    for (int64_t k = 0; k < kc; k += 8) {
        v8f wv[NB];
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) {
            wv[j] = *(const v8f_u *)(w + j * kc + k);
            IN_REGISTER(wv[j]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; i++) {
            v8f xv = *(const v8f_u *)(xf + (m0 + i) * K + k0 + k);
            IN_REGISTER(xv);
#pragma GCC unroll 8
            for (int j = 0; j < C; j++) acc[i][j] = FMA8(acc[i][j], xv, wv[j]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; i++)
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) accs[(m0 + i) * NB + j] = acc[i][j];
}

static inline __attribute__((always_inline)) void parts(const float *xf, const float *w, v8f *accs, int64_t m0,
                                                        int64_t mr, const int C, int64_t K, int64_t k0, int64_t kc) {
    switch (mr) {
#if MR > 3
    case 4: part(xf, w, accs, m0, 4, C, K, k0, kc); break;
#endif
    case 3: part(xf, w, accs, m0, 3, C, K, k0, kc); break;
    case 2: part(xf, w, accs, m0, 2, C, K, k0, kc); break;
    default: part(xf, w, accs, m0, 1, C, K, k0, kc);
    }
}

/* The mc rows of x at xf against work item t: its packed rows expanded KC columns at a time into wt, so that
   they stay in L1 while every row of x meets them; accs: mc x NB vectors of lanes. */
static void column_blocked(const float *xf, const uint8_t *w, const int fmt, float *wt, v8f *accs, const void *b,
                           void *y, int64_t mc, int64_t N, int64_t K, int64_t t, const int obf16) {
    const int64_t n0 = t * NB, rows = N - n0 < NB ? N - n0 : NB;
    const int64_t row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    for (int64_t i = 0; i < mc * NB; i++) accs[i] = (v8f){0};
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = K - k0 < KC ? K - k0 : KC;
        for (int64_t r = 0; r < rows; r++)
            expand(w + (n0 + r) * row_bytes + k0 / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt], fmt, wt + r * kc, 1, kc);
        for (int64_t m0 = 0; m0 < mc; m0 += MR) {
            const int64_t mr = mc - m0 < MR ? mc - m0 : MR;
            if (rows < NB)
                for (int64_t r = 0; r < rows; r++) parts(xf, wt + r * kc, accs + r, m0, mr, 1, K, k0, kc);
            else if (mr == 1) /* a last row alone: against all NB rows at once, or its chains would wait */
                part(xf, wt, accs, m0, 1, NB, K, k0, kc);
            else
                for (int64_t r = 0; r < NB; r += NR) parts(xf, wt + r * kc, accs + r, m0, mr, NR, K, k0, kc);
        }
    }
    for (int64_t m = 0; m < mc; m++)
        for (int64_t r = 0; r < rows; r++)
            store_biased(y, m * N + n0 + r, hsum(accs[m * NB + r]), b, n0 + r, obf16);
}

/* This thread's part of per-thread buffers of ``each`` bytes (in an OpenMP parallel region) */
static inline char *thread_share(char *buffers, size_t each) {
#ifdef _OPENMP
    return buffers + each * omp_get_thread_num();
#else
    (void)each;
    return buffers;
#endif
}

static int linear_packed(const void *x, const uint8_t *w, int fmt, const void *b, void *y, int64_t M, int64_t N,
                         int64_t K, int num_threads, int bf16) {
    if (fmt < 0 || fmt >= FORMATS || K % BLOCK_WEIGHTS[fmt] || num_threads < 1) return BAD_ARGUMENTS;
    float *xf = widened(x, M * K, bf16);
    if (!xf) return OUT_OF_MEMORY;
    if (M <= IN_REGISTERS_UP_TO) {
        const int64_t items = (N + NB_PACKED - 1) / NB_PACKED;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t t = 0; t < items; t++) rows_packed(xf, w, fmt, b, y, M, N, K, t, bf16);
        if (bf16) free(xf);
        return OK;
    }
    const int64_t tiles_n = (N + NB - 1) / NB;
    /* per thread: a chunk's lanes, then a work item's KC columns expanded */
    const size_t each = (sizeof(v8f) * X_CHUNK_ROWS * NB + sizeof(float) * NB * KC + 63) / 64 * 64;
    char *buffers = aligned_alloc(64, each * num_threads);
    if (!buffers) {
        if (bf16) free(xf);
        return OUT_OF_MEMORY;
    }
#pragma omp parallel num_threads(num_threads)
    {
        char *mine = thread_share(buffers, each);
        v8f *accs = (v8f *)mine;
        float *wt = (float *)(mine + sizeof(v8f) * X_CHUNK_ROWS * NB);
        for (int64_t m0 = 0; m0 < M; m0 += X_CHUNK_ROWS) {
            const int64_t mc = M - m0 < X_CHUNK_ROWS ? M - m0 : X_CHUNK_ROWS;
            void *yc = (char *)y + m0 * N * (bf16 ? 2 : 4);
            /* the same work items for a thread in every chunk */
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles_n; t++) column_blocked(xf + m0 * K, w, fmt, wt, accs, b, yc, mc, N, K, t, bf16);
        }
    }
    free(buffers);
    if (bf16) free(xf);
    return OK;
}

int linear_q_f32(const float *x, const uint8_t *w, int fmt, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                 int num_threads) {
    return linear_packed(x, w, fmt, b, y, M, N, K, num_threads, 0);
}

int linear_q_bf16(const uint16_t *x, const uint8_t *w, int fmt, const uint16_t *b, uint16_t *y, int64_t M,
                  int64_t N, int64_t K, int num_threads) {
    return linear_packed(x, w, fmt, b, y, M, N, K, num_threads, 1);
}

/* ------------------------------------------------------------------ bf16 steps of many rows: dot products

   A bf16 step's x W^T on packed weights (a prompt's, or from 16 rows a batch of decodes', where tune measured
   them faster than the C kernel above), whose weights are d q + m with small integers q for each group of 32
   (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_Z, IQ4_NL, MXFP4; the sub-blocks of Q4_K, Q5_K and IQ4_XS) or of 16 (Q2_K,
   Q3_K, Q6_K): per group, d (x . q) + m (sum of x), the dot products x . q by AVX512-BF16's vdpbf16ps, which
   multiplies bf16 pairs exactly (each q is exact in bf16) and sums in float, 32 products an instruction where
   float32's multiply-add does 16. The weights are the exact ones (d q + m without its rounding to a float:
   2^-24 of a weight at most), summed in float32, in another order than the float32 GEMM's; a row's result does
   not depend on the others. (Save where x . q passes float's largest before d scales it down, or where
   vdpbf16ps flushes subnormal inputs and sums to zero: no activation comes near either.) y's columns are the
   vectors' lanes' rows: x is laid out once as pairs of columns for 16 rows a vector (``dot_x``), a work item's
   DOT_COLS weight rows are expanded once into their integers (``dot_block``), and each pass of DOT_ROWS rows
   keeps a group's 2 x DOT_COLS sums in registers, the running sums in L1 (held in registers too, they spilled
   x's). On the AVX-512 EPYC, 144 x 576 by 3072 x 576 Q4_1: 6 columns 2.24 ms, 8 2.04, 12 2.48 (float32's GEMM
   on the expanded weight: 4.8-5.4). */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DOT_COLS 8
#define DOT_ROWS 32
#define DOT_CHUNK 256 /* rows of x laid out at a time (for each, the weights are expanded again) */

static inline int dot_sums(const int fmt) { /* the formats whose weights add m to d q */
    return fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_Z || fmt == Q4_K || fmt == Q5_K || fmt == Q2_K;
}

static inline int dot_group(const int fmt) { /* the weights one d (and m) covers: 32, or 16 */
    return fmt == Q2_K || fmt == Q3_K || fmt == Q6_K ? 16 : 32;
}

/* 16 bytes' low nibbles then their high ones: 32 int16 */
static inline __attribute__((always_inline)) __m512i dot_nibbles(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low)));
}

/* The bf16 bits (exact) of the integers each int16's low 5 bits name, as vpermw reads them: 0..31 (``whole``),
   -16..15 (``sign``), -32..-1 (``low``: Q6_K's lower half, ``whole`` its upper), and a format's 16 levels */
typedef struct {
    __m512i whole, sign, low, levels;
} dot_tables;

static inline dot_tables dot_tables_for(const int fmt) {
    uint16_t t[4][32];
    for (int i = 0; i < 32; i++) {
        float f[4] = {(float)i, (float)(i < 16 ? i : i - 32), (float)(i - 32),
                      (float)(fmt == MXFP4 ? MXFP4_LEVELS[i & 15] : IQ4_LEVELS[i & 15])};
        for (int j = 0; j < 4; j++) {
            uint32_t u;
            memcpy(&u, f + j, 4);
            t[j][i] = (uint16_t)(u >> 16);
        }
    }
    const dot_tables out = {_mm512_loadu_si512(t[0]), _mm512_loadu_si512(t[1]), _mm512_loadu_si512(t[2]),
                            _mm512_loadu_si512(t[3])};
    return out;
}

/* The 32 weights of one block (of a K-quant's or IQ4_XS's super-block: sub-block g, its scales s from k_scales)
   as d q + m: their integers q as bf16 (looked up in ``tab``), in order, and d and m (expand_scalar's weights,
   without its rounding); Q2_K, Q3_K and Q6_K: a d and an m for each 16 (d[0], d[1]) */
static inline __attribute__((always_inline)) void dot_block(const uint8_t *blk, const int fmt, const int g,
                                                            const float s[32], const dot_tables *tab, uint16_t *q,
                                                            float *d, float *m) {
    const int with_m = fmt == Q4_1 || fmt == Q5_1 || fmt == Q4_Z; /* (the blocks of 32 with a second fp16) */
    __m512i v; /* 32 int16 */
    float scale, second = 0.0f;
    if (fmt == Q6_K) {
        const int h = g >> 2, r = g & 3;
        const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (r & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (r >> 1))),
                                            _mm256_set1_epi8(15));
        const __m256i hi = _mm256_and_si256(_mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * r)), 4),
                                            _mm256_set1_epi8(0x30));
        v = _mm512_cvtepu8_epi16(_mm256_or_si256(lo, hi)); /* (0..63: q + 32) */
        d[1] = s[2 * g + 1], m[1] = 0.0f;
        scale = s[2 * g];
    } else if (fmt == Q2_K || fmt == Q3_K) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + (fmt == Q2_K ? 16 : 32) + 32 * (g >> 2)));
        v = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(2 * (g & 3))),
                                                  _mm256_set1_epi8(3)));
        if (fmt == Q3_K) /* 4 less where bit g of the high mask's byte is clear */
            v = _mm512_mask_sub_epi16(v, ~_mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i *)blk),
                                                                _mm256_set1_epi8((char)(1 << g))),
                                      v, _mm512_set1_epi16(4));
        d[1] = s[2 * g + 1], m[1] = fmt == Q2_K ? s[16 + 2 * g + 1] : 0.0f;
        scale = s[2 * g], second = fmt == Q2_K ? s[16 + 2 * g] : 0.0f;
    } else if (fmt == Q4_K || fmt == Q5_K) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + (fmt == Q4_K ? 16 : 48) + 32 * (g >> 1)));
        v = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srl_epi16(b, _mm_cvtsi32_si128(4 * (g & 1))),
                                                  _mm256_set1_epi8(15)));
        if (fmt == Q5_K) /* bit g of each of 32 bytes: 16 more */
            v = _mm512_mask_add_epi16(v, _mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i *)(blk + 16)),
                                                               _mm256_set1_epi8((char)(1 << g))),
                                      v, _mm512_set1_epi16(16));
        scale = s[g], second = s[8 + g];
    } else if (fmt == IQ4_XS || fmt == IQ4_NL || fmt == MXFP4) {
        v = dot_nibbles(blk + (fmt == IQ4_XS ? 8 + 16 * g : fmt == MXFP4 ? 1 : 2)); /* (the levels' indices) */
        scale = fmt == IQ4_XS ? s[g] : fmt == MXFP4 ? e8m0_half(blk[0]) : half_to_float(blk);
    } else if (fmt == Q8_0) {
        v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 2)));
        scale = half_to_float(blk);
    } else {
        const int five = fmt == Q5_0 || fmt == Q5_1;
        v = dot_nibbles(blk + 2 + 2 * with_m + 4 * five);
        if (five) {
            uint32_t qh;
            memcpy(&qh, blk + 2 + 2 * with_m, 4);
            v = _mm512_mask_add_epi16(v, (__mmask32)qh, v, _mm512_set1_epi16(16));
        }
        if (fmt == Q4_0 || fmt == Q5_0) v = _mm512_sub_epi16(v, _mm512_set1_epi16(fmt == Q4_0 ? 8 : 16));
        scale = half_to_float(blk);
        if (with_m) second = half_to_float(blk + 2);
        if (fmt == Q4_Z) second = -(scale * second); /* d (q - z): an exact product of two halves */
    }
    if (fmt == Q8_0) { /* (-128..127: converted, exact) */
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
        v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    } else if (fmt == Q6_K) { /* (bit 5 of each index picks the upper half) */
        v = _mm512_permutex2var_epi16(tab->low, v, tab->whole);
    } else {
        const int sign = fmt == Q4_0 || fmt == Q5_0 || fmt == Q3_K;
        const int levels = fmt == IQ4_XS || fmt == IQ4_NL || fmt == MXFP4;
        v = _mm512_permutexvar_epi16(v, levels ? tab->levels : sign ? tab->sign : tab->whole);
    }
    _mm512_storeu_si512(q, v);
    *d = scale, *m = second;
}

/* A work item's ``cols`` weight rows (from w, whole blocks each) as their integers (q: K / 2 pairs a row) and their
   groups' d and m (K / gw a row); rows past ``cols`` up to DOT_COLS: zeros */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *w, const int fmt, int64_t cols, int64_t K,
                                                           uint32_t *q, float *d, float *m) {
    const int gw = dot_group(fmt), per = BLOCK_WEIGHTS[fmt] / 32;
    const int64_t P = K / 2, G = K / gw, row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    const dot_tables tab = dot_tables_for(fmt);
    for (int c = 0; c < DOT_COLS; c++) {
        if (c >= cols) { /* (a last item's missing rows) */
            memset(q + c * P, 0, 4 * P);
            memset(d + c * G, 0, 4 * G), memset(m + c * G, 0, 4 * G);
            continue;
        }
        for (int64_t g = 0; g < K / 32; g += per) { /* (g: 32 weights) */
            const uint8_t *blk = w + c * row_bytes + g / per * BLOCK_BYTES[fmt];
            float s[32];
            if (per > 1) k_scales(blk, fmt, s);
            for (int j = 0; j < per; j++)
                dot_block(blk, fmt, j, s, &tab, (uint16_t *)(q + c * P) + 32 * (g + j),
                          d + c * G + (g + j) * 32 / gw, m + c * G + (g + j) * 32 / gw);
            __builtin_prefetch(blk + PACKED_AHEAD);
        }
    }
}

/* a case per format, each with its constant inlined */
static void dot_expand(const uint8_t *w, int fmt, int64_t cols, int64_t K, uint32_t *q, float *d, float *m) {
#define DOT_EXPAND(F)                                                                                              \
    case F: dot_rows(w, F, cols, K, q, d, m); break;
    switch (fmt) {
        DOT_EXPAND(Q4_0)
        DOT_EXPAND(Q4_1)
        DOT_EXPAND(Q8_0)
        DOT_EXPAND(Q4_Z)
        DOT_EXPAND(Q5_0)
        DOT_EXPAND(Q5_1)
        DOT_EXPAND(Q4_K)
        DOT_EXPAND(Q5_K)
        DOT_EXPAND(Q6_K)
        DOT_EXPAND(Q2_K)
        DOT_EXPAND(Q3_K)
        DOT_EXPAND(IQ4_NL)
        DOT_EXPAND(IQ4_XS)
        DOT_EXPAND(MXFP4)
    }
#undef DOT_EXPAND
}

/* Pass ``pass`` (DOT_ROWS rows from m0 + pass DOT_ROWS, of the ``rows`` from m0) of x (bf16, K columns) as pairs
   of columns for 16 rows a vector: xp[p][r] holds row r's columns 2p, 2p + 1 (rows past the last: zeros), and,
   with ``sums``, xs[g][r] row r's sum over group g (of gw columns) */
static void dot_x(const uint16_t *x, int64_t m0, int64_t rows, int64_t K, int64_t pass, uint32_t *xp, float *xs,
                  int sums, int gw) {
    const int64_t P = K / 2, G = K / gw;
    uint32_t *dst = xp + pass * P * DOT_ROWS;
    float *sum = xs + pass * G * DOT_ROWS;
    for (int r = 0; r < DOT_ROWS; r++) {
        const int64_t row = pass * DOT_ROWS + r;
        const uint16_t *src = row < rows ? x + (m0 + row) * K : x; /* (a row past the last: zeros) */
        for (int64_t p = 0; p < P; p++) {
            uint32_t pair = 0;
            if (row < rows) memcpy(&pair, src + 2 * p, 4);
            dst[p * DOT_ROWS + r] = pair;
        }
        for (int64_t g = 0; sums && g < G; g++) {
            __m512 s = _mm512_setzero_ps();
            for (int i = 0; row < rows && i < gw; i += 16) { /* bf16 to float: 16 bits up */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + gw * g + i));
                s = _mm512_add_ps(s, (__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
            }
            sum[g * DOT_ROWS + r] = _mm512_reduce_add_ps(s);
        }
    }
}

/* One pass: DOT_ROWS rows of x (xp, xs laid out by dot_x) times DOT_COLS expanded weight rows (q: K / 2 pairs
   each; d, m: K / gw each, a group of gw weights a scale) into out[c][r]; with ``vecs`` 1, its first 16 rows only
   (a pass of 16 rows or fewer: half the work) */
static inline __attribute__((always_inline)) void dot_pass(const uint32_t *xp, const float *xs, const uint32_t *q,
                                                           const float *d, const float *m, const int64_t K,
                                                           const int sums, const int gw, const int vecs,
                                                           float out[DOT_COLS][DOT_ROWS]) {
    const int64_t P = K / 2, G = K / gw;
    memset(out, 0, sizeof(float) * DOT_COLS * DOT_ROWS); /* (the sums live there: registers hold a group's) */
    for (int64_t g = 0; g < G; g++) {
        __m512 part[DOT_COLS][2];
        for (int c = 0; c < DOT_COLS; c++) part[c][0] = part[c][1] = _mm512_setzero_ps();
        for (int64_t p = gw / 2 * g; p < gw / 2 * (g + 1); p++) {
            __m512i x0 = _mm512_load_si512(xp + p * DOT_ROWS);
            __m512i x1 = vecs > 1 ? _mm512_load_si512(xp + p * DOT_ROWS + 16) : x0;
            IN_REGISTER(x0);
            if (vecs > 1) IN_REGISTER(x1);
            for (int c = 0; c < DOT_COLS; c++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)q[c * P + p]);
                part[c][0] = _mm512_dpbf16_ps(part[c][0], (__m512bh)x0, w);
                if (vecs > 1) part[c][1] = _mm512_dpbf16_ps(part[c][1], (__m512bh)x1, w);
            }
        }
        for (int c = 0; c < DOT_COLS; c++)
            for (int h = 0; h < vecs; h++) {
                __m512 o = _mm512_fmadd_ps(part[c][h], _mm512_set1_ps(d[c * G + g]), _mm512_loadu_ps(out[c] + 16 * h));
                if (sums)
                    o = _mm512_fmadd_ps(_mm512_load_ps(xs + g * DOT_ROWS + 16 * h), _mm512_set1_ps(m[c * G + g]), o);
                _mm512_storeu_ps(out[c] + 16 * h, o);
            }
    }
}
#endif

/* taken[f]: whether linear_q_dot_bf16 takes weights of format f here (built with AVX512-BF16: every format),
   for each of the FORMATS */
int q_dot_formats(int32_t *taken) {
    for (int f = 0; f < FORMATS; f++)
#ifdef DOT_COLS
        taken[f] = 1;
#else
        taken[f] = 0;
#endif
    return OK;
}

int linear_q_dot_bf16(const uint16_t *x, const uint8_t *w, int fmt, const uint16_t *b, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int num_threads) {
#ifdef DOT_COLS
    if (fmt < 0 || fmt >= FORMATS || K % BLOCK_WEIGHTS[fmt] || num_threads < 1) return BAD_ARGUMENTS;
    if (M <= 0) return OK;
    const int gw = dot_group(fmt), sums = dot_sums(fmt);
    const int64_t P = K / 2, G = K / gw, items = (N + DOT_COLS - 1) / DOT_COLS;
    const int64_t row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    /* chunks of at most DOT_CHUNK rows, as even as whole passes allow (257 rows: two of 160 and 97, not 256 and 1:
       each chunk expands the weights again) */
    const int64_t chunks = (M + DOT_CHUNK - 1) / DOT_CHUNK;
    const int64_t chunk = ((M + chunks - 1) / chunks + DOT_ROWS - 1) / DOT_ROWS * DOT_ROWS;
    uint32_t *xp = aligned_alloc(64, (size_t)chunk * P * 4);
    float *xs = aligned_alloc(64, (size_t)chunk * G * 4);
    const size_t each = ((size_t)DOT_COLS * (P * 4 + G * 8) + 63) / 64 * 64; /* a thread's weights expanded */
    char *buffers = aligned_alloc(64, each * num_threads);
    int status = xp && xs && buffers ? OK : OUT_OF_MEMORY;
    for (int64_t m0 = 0; status == OK && m0 < M; m0 += chunk) {
        const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
        const int64_t passes = (rows + DOT_ROWS - 1) / DOT_ROWS;
#pragma omp parallel num_threads(num_threads)
        {
#pragma omp for schedule(static)
            for (int64_t pass = 0; pass < passes; pass++) dot_x(x, m0, rows, K, pass, xp, xs, sums, gw);
            uint32_t *q = (uint32_t *)thread_share(buffers, each);
            float *d = (float *)(q + DOT_COLS * P), *m = d + DOT_COLS * G, out[DOT_COLS][DOT_ROWS];
#pragma omp for schedule(static)
            for (int64_t t = 0; t < items; t++) {
                const int64_t n0 = t * DOT_COLS, cols = N - n0 < DOT_COLS ? N - n0 : DOT_COLS;
                dot_expand(w + n0 * row_bytes, fmt, cols, K, q, d, m);
                for (int64_t pass = 0; pass * DOT_ROWS < rows; pass++) {
                    const uint32_t *xpp = xp + pass * P * DOT_ROWS;
                    const float *xsp = xs + pass * G * DOT_ROWS;
                    const int half = rows - pass * DOT_ROWS <= 16; /* (each a constant: its loops unrolled) */
                    if (gw == 16 && half)
                        dot_pass(xpp, xsp, q, d, m, K, sums, 16, 1, out);
                    else if (gw == 16)
                        dot_pass(xpp, xsp, q, d, m, K, sums, 16, 2, out);
                    else if (half)
                        dot_pass(xpp, xsp, q, d, m, K, sums, 32, 1, out);
                    else
                        dot_pass(xpp, xsp, q, d, m, K, sums, 32, 2, out);
                    for (int64_t r = 0; r < DOT_ROWS && pass * DOT_ROWS + r < rows; r++)
                        for (int64_t c = 0; c < cols; c++)
                            store_biased(y, (m0 + pass * DOT_ROWS + r) * N + n0 + c, out[c][r], b, n0 + c, 1);
                }
            }
        }
    }
    free(xp), free(xs), free(buffers);
    return status;
#else
    (void)x, (void)w, (void)fmt, (void)b, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return BAD_ARGUMENTS;
#endif
}

/* rows (gathered by ids, or all of them when ids is NULL) of a packed matrix, as floats */
int dequantize_rows(const uint8_t *w, int fmt, const int64_t *ids, float *out, int64_t rows, int64_t K,
                    int num_threads) {
    if (fmt < 0 || fmt >= FORMATS || K % BLOCK_WEIGHTS[fmt]) return BAD_ARGUMENTS;
    const int64_t row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * K >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) expand(w + (ids ? ids[r] : r) * row_bytes, fmt, out + r * K, 1, K);
    return OK;
}

/* f rounded to bf16 (to nearest even; a NaN stays one), as a float */
static inline float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u & 0x7fffffff) > 0x7f800000 ? u | 0x00400000 : u + 0x7fff + ((u >> 16) & 1);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* the bf16 of a float that is one already */
static inline uint16_t to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* Rows of a packed weight, each as three bf16 rows whose sum is its floats exactly: out (rows, 3K) of
 * bf16, a row's high parts, then what they leave, then what those leave. A float's 24 bits of
 * mantissa are three bf16's 8, and each remainder is exact in float (it is below the part's last
 * bit), so [x | x | x] . [hi | mid | lo] is x . W on the exact weights, for a bf16 GEMM that sums in
 * float (AMX's: several times float32's rate). A row is expanded a super-block at a time. A weight
 * that is not finite is its high part alone (so is one that rounds past bf16's largest, whose sum is
 * then infinite). Exact down to weights of about 2^-110, below which the low part falls under bf16's
 * subnormals: no format makes one (fp16 scales give multiples of 2^-24, MXFP4 2^-128 and up with two
 * bits). */
int dequantize_split(const uint8_t *w, int fmt, uint16_t *out, int64_t rows, int64_t K, int num_threads) {
    if (fmt < 0 || fmt >= FORMATS || K % BLOCK_WEIGHTS[fmt]) return BAD_ARGUMENTS;
    const int64_t row_bytes = K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt];
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * K >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        float f[256];
        uint16_t *hi = out + r * 3 * K, *mid = hi + K, *lo = mid + K;
        for (int64_t k0 = 0; k0 < K; k0 += 256) {
            const int64_t n = K - k0 < 256 ? K - k0 : 256;
            expand(w + r * row_bytes + k0 / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt], fmt, f, 1, n);
            for (int64_t i = 0; i < n; i++) { /* (branch-free: it vectorizes) */
                const float h = bf16_round(f[i]), rest = isfinite(f[i] - h) ? f[i] - h : 0.f, m = bf16_round(rest);
                hi[k0 + i] = to_bf16_bits(h);
                mid[k0 + i] = to_bf16_bits(m);
                lo[k0 + i] = to_bf16_bits(rest - m);
            }
        }
    }
    return OK;
}

int linear_f32_packed(const int64_t *a) { return linear_f32(PTR(0), PTR(1), PTR(2), PTR(3), a[4], a[5], a[6], (int)a[7]); }
int linear_bf16_packed(const int64_t *a) { return linear_bf16(PTR(0), PTR(1), PTR(2), PTR(3), a[4], a[5], a[6], (int)a[7]); }
int linear_q_f32_packed(const int64_t *a) {
    return linear_q_f32(PTR(0), PTR(1), (int)a[2], PTR(3), PTR(4), a[5], a[6], a[7], (int)a[8]);
}
int linear_q_bf16_packed(const int64_t *a) {
    return linear_q_bf16(PTR(0), PTR(1), (int)a[2], PTR(3), PTR(4), a[5], a[6], a[7], (int)a[8]);
}
int linear_q_dot_bf16_packed(const int64_t *a) {
    return linear_q_dot_bf16(PTR(0), PTR(1), (int)a[2], PTR(3), PTR(4), a[5], a[6], a[7], (int)a[8]);
}
int dequantize_rows_packed(const int64_t *a) { return dequantize_rows(PTR(0), (int)a[1], PTR(2), PTR(3), a[4], a[5], (int)a[6]); }
