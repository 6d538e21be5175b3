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
 * (16 registers: 9 accumulators, 3 weights, 1 row of x, and no spill); 4 x 3 spilled. A sum over
 * K runs in 8 lanes, which are summed as a tree at the end: a row's result does not depend on M.
 * The weight rows after the tile are prefetched as it goes (rows of a few KiB are too short for the
 * hardware prefetcher to ramp up on): +10-40% at 1 to 4 rows, measured.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4)));
typedef uint16_t v8h_u __attribute__((vector_size(16), aligned(2)));
typedef uint32_t v8u __attribute__((vector_size(32)));

#define MR 3
#define NR 3
#define NB (2 * NR) /* weight rows per work item */

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

/* 8 weights from column k of a row, as floats (bf16 is the top half of an fp32) */
static inline __attribute__((always_inline)) v8f load_w(const void *w, int64_t at, int bf16) {
    if (!bf16) return *(const v8f_u *)((const float *)w + at);
#ifdef __AVX2__ /* one widening instruction where gcc's generic vectors would take three */
    __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + at))), 16);
#else
    v8u wide = __builtin_convertvector(*(const v8h_u *)((const uint16_t *)w + at), v8u) << 16;
#endif
    v8f f;
    memcpy(&f, &wide, 32);
    return f;
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

/* y[m0:m0+R, n0:n0+C] = x[m0:m0+R] . w[n0:n0+C]^T (+ b), R <= MR and C <= NR constants once
   inlined: every loop over them unrolled, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(const float *xf, const void *w, const void *b, void *y,
                                                       int64_t m0, const int R, int64_t n0, const int C,
                                                       int64_t N, int64_t K, const int bf16) {
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
                if (n0 + C + j < N) __builtin_prefetch((const char *)w + ((n0 + C + j) * K + k) * (bf16 ? 2 : 4));
        v8f wv[NB];
#pragma GCC unroll 8
        for (int j = 0; j < C; j++) {
            wv[j] = load_w(w, (n0 + j) * K + k, bf16);
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
                sum = FMA1(sum, xf[(m0 + i) * K + kk], bf16 ? bf16_to_float(((const uint16_t *)w)[n * K + kk])
                                                            : ((const float *)w)[n * K + kk]);
            if (b) sum += bf16 ? bf16_to_float(((const uint16_t *)b)[n]) : ((const float *)b)[n];
            store(y, (m0 + i) * N + n, sum, bf16);
        }
}

/* The rows m0.. (up to MR of them) against the weight rows n0.. (NR, or 1 in N's tail). */
static inline __attribute__((always_inline)) void tiles(const float *xf, const void *w, const void *b, void *y,
                                                        int64_t m0, int64_t mr, int64_t n0, const int C,
                                                        int64_t N, int64_t K, const int bf16) {
    switch (mr) {
    case 3: tile(xf, w, b, y, m0, 3, n0, C, N, K, bf16); break;
    case 2: tile(xf, w, b, y, m0, 2, n0, C, N, K, bf16); break;
    default: tile(xf, w, b, y, m0, 1, n0, C, N, K, bf16);
    }
}

/* Every row of x against the weight rows of block t (NB of them, or N's tail a row at a time). One
   row of x has NB accumulators, a chain per weight row: more loads in flight than NR would give. */
static inline __attribute__((always_inline)) void column(const float *xf, const void *w, const void *b, void *y,
                                                         int64_t M, int64_t N, int64_t K, int64_t t,
                                                         const int bf16) {
    const int64_t n0 = t * NB;
    if (n0 + NB > N) {
        for (int64_t m0 = 0; m0 < M; m0 += MR)
            for (int64_t n = n0; n < N; n++) tiles(xf, w, b, y, m0, M - m0 < MR ? M - m0 : MR, n, 1, N, K, bf16);
    } else if (M == 1) {
        tile(xf, w, b, y, 0, 1, n0, NB, N, K, bf16);
    } else {
        for (int64_t m0 = 0; m0 < M; m0 += MR)
            for (int64_t n = n0; n < n0 + NB; n += NR) tiles(xf, w, b, y, m0, M - m0 < MR ? M - m0 : MR, n, NR, N, K, bf16);
    }
}

/* One function per dtype, with the dtype a constant in it: OpenMP outlines its loop body before
   constants propagate, so the branch on the dtype must be taken outside the loops. */
static void column_f32(const float *xf, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                       int64_t t) {
    column(xf, w, b, y, M, N, K, t, 0);
}

static void column_bf16(const float *xf, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                        int64_t t) {
    column(xf, w, b, y, M, N, K, t, 1);
}

static void linear(const void *x, const void *w, const void *b, void *y, int64_t M, int64_t N, int64_t K,
                   int num_threads, int bf16) {
    float *xf = (float *)x, *wide = NULL;
    if (bf16) { /* x widened once: it is read once per NR weight rows */
        wide = malloc(sizeof(float) * M * K);
        if (!wide) return;
        for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_float(((const uint16_t *)x)[i]);
        xf = wide;
    }
    const int64_t tiles_n = (N + NB - 1) / NB;
    (void)num_threads; /* without OpenMP: one thread */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles_n; t++) {
        if (bf16)
            column_bf16(xf, w, b, y, M, N, K, t);
        else
            column_f32(xf, w, b, y, M, N, K, t);
    }
    free(wide);
}

void linear_f32(const float *x, const float *w, const float *b, float *y, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    linear(x, w, b, y, M, N, K, num_threads, 0);
}

void linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, uint16_t *y, int64_t M, int64_t N,
                 int64_t K, int num_threads) {
    linear(x, w, b, y, M, N, K, num_threads, 1);
}
