/* The per-layer elementwise steps on the CPU, each in one call: the twins of kernels.reference's
 * rms_norm, fused_add_rms_norm, apply_rope_ and silu_and_mul. At one decoded token a layer of
 * those is ~40 torch operators, each a few microseconds of dispatch for a few hundred numbers:
 * at 30 layers more time than the arithmetic.
 *
 * fp32, or bf16 rounded where torch rounds: after each operator the reference runs in bf16 (an
 * operator computes in fp32 and rounds its result to nearest even), so the results match the
 * reference's bit for bit but for the order of the sum of squares.
 * Rows go to OpenMP threads when there are enough of them to pay for waking the threads.
 */
#include <math.h>
/* a * b - c * d as two rounded products and a rounded difference, as torch computes it, never fused */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp8.h"
#include "packed.h"

/* value i of a row, as a float */
static inline float ld(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = float_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v as the dtype would hold it: an operator's result */
static inline float rd(float v, int bf16) { return bf16 ? bf16_to_float(float_to_bf16(v)) : v; }

#define PARALLEL_WORK (1 << 15) /* numbers touched below which one thread does it all */

/* 8 values of a row from i, as floats; as the dtype would hold them (rd's twin); stored (rounded to the dtype) */
static inline __attribute__((always_inline)) v8f ld8(const void *p, int64_t i, const int bf16) {
    return bf16 ? widen8((const uint16_t *)p + i) : *(const v8f_u *)((const float *)p + i);
}

static inline __attribute__((always_inline)) v8f rd8(v8f v, const int bf16) { return bf16 ? round8(v) : v; }

static inline __attribute__((always_inline)) void st8(void *p, int64_t i, v8f v, const int bf16) {
    if (bf16)
        store8((uint16_t *)p + i, round8(v));
    else
        *(v8f_u *)((float *)p + i) = v;
}

/* out = weight * (s * rsqrt(mean(s^2) + eps)), s = x (+ residual, kept in summed), for row t of D: 8 at a time,
   lane j of the squares' sum taking the columns i with i % 8 == j, as one at a time did (the same bits) */
static inline __attribute__((always_inline)) void rms_row(const void *x, const void *residual, const void *weight,
                                                          void *out, void *summed, int64_t t, int64_t D, float eps,
                                                          const int bf16) {
    const int64_t row = t * D;
    v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) {
        v8f s = ld8(x, row + i, bf16);
        if (residual) {
            s = rd8(s + ld8(residual, row + i, bf16), bf16);
            st8(summed, row + i, s, bf16);
        }
        acc = acc + s * s;
    }
    float sq[8];
    memcpy(sq, &acc, sizeof sq);
    for (; i < D; i++) {
        float s = ld(x, row + i, bf16);
        if (residual) {
            s = rd(s + ld(residual, row + i, bf16), bf16);
            st(summed, row + i, s, bf16);
        }
        sq[i & 7] += s * s;
    }
    const float mean = (((sq[0] + sq[4]) + (sq[1] + sq[5])) + ((sq[2] + sq[6]) + (sq[3] + sq[7]))) / (float)D;
    const float inv = 1.0f / sqrtf(mean + eps);
    const void *src = residual ? summed : x;
    for (i = 0; i + 8 <= D; i += 8)
        st8(out, row + i, ld8(weight, i, bf16) * rd8(ld8(src, row + i, bf16) * inv, bf16), bf16);
    for (; i < D; i++) st(out, row + i, ld(weight, i, bf16) * rd(ld(src, row + i, bf16) * inv, bf16), bf16);
}

static void rms_norm(const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t T,
                     int64_t D, float eps, int num_threads, int bf16) {
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (T * D >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        if (bf16)
            rms_row(x, residual, weight, out, summed, t, D, eps, 1);
        else
            rms_row(x, residual, weight, out, summed, t, D, eps, 0);
    }
}

/* Rotate-half RoPE in place on heads of D at x + t * stride + h * D: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) */
static inline void rotate(void *x, int64_t stride, int64_t heads, int64_t D, const void *cos, const void *sin,
                          int64_t t, int bf16) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        const int64_t at = t * stride + h * D;
        int64_t i = 0;
        if (bf16) /* 8 at a time, each product rounded where the scalar loop rounds it (fp32's is left alone: there
                     the compiler may fuse a product into the add, and the 8-wide code could fuse another) */
            for (; i + 8 <= half; i += 8) {
                const v8f c = ld8(cos, t * half + i, 1), s = ld8(sin, t * half + i, 1);
                const v8f x1 = ld8(x, at + i, 1), x2 = ld8(x, at + half + i, 1);
                st8(x, at + i, round8(x1 * c) - round8(x2 * s), 1);
                st8(x, at + half + i, round8(x2 * c) + round8(x1 * s), 1);
            }
        for (; i < half; i++) {
            const float c = ld(cos, t * half + i, bf16), s = ld(sin, t * half + i, bf16);
            const float x1 = ld(x, at + i, bf16), x2 = ld(x, at + half + i, bf16);
            st(x, at + i, rd(x1 * c, bf16) - rd(x2 * s, bf16), bf16);
            st(x, at + half + i, rd(x2 * c, bf16) + rd(x1 * s, bf16), bf16);
        }
    }
}

static void rope(void *q, int64_t q_stride, int64_t H, void *k, int64_t k_stride, int64_t HKV, int64_t D,
                 const void *cos, const void *sin, int64_t T, int num_threads, int bf16) {
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (T * (H + HKV) * D >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        rotate(q, q_stride, H, D, cos, sin, t, bf16);
        rotate(k, k_stride, HKV, D, cos, sin, t, bf16);
    }
}

/* x (T, 2I) = gate | up -> out (T, I) = silu(gate) * up. fp32 rows 8 at a time (exp8: a scalar expf
   per number was most of this call's time at a prompt's rows). */
static void silu_row_f32(const float *gate, const float *up, float *out, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const v8f g = *(const v8f_u *)(gate + i);
        *(v8f_u *)(out + i) = g / (1.0f + exp8(-g)) * *(const v8f_u *)(up + i);
    }
    for (; i < I; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static inline uint16_t silu_mul_bf16(uint16_t gate, uint16_t up) {
    const float g = bf16_to_float(gate);
    return float_to_bf16(rd(g / (1.0f + expf(-g)), 1) * bf16_to_float(up));
}

/* bf16 rows 8 at a time too (a scalar expf per number: 5 times torch's time at 32 rows of 1536, measured),
   each step rounded as torch rounds it; 8 with a gate below -88 one at a time (exp8 clamps exp(-g) where
   expf's is huge or infinite, and the gate's SiLU then is not the -0 or NaN torch gives) */
static void silu_row_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t I) {
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
        const v8f g = widen8(gate + i);
        const v8u far = (v8u)(g < -88.0f);
        uint32_t any = 0;
        for (int j = 0; j < 8; j++) any |= far[j];
        if (any)
            for (int j = 0; j < 8; j++) out[i + j] = silu_mul_bf16(gate[i + j], up[i + j]);
        else
            store8(out + i, round8(round8(g / (1.0f + exp8(-g))) * widen8(up + i)));
    }
    for (; i < I; i++) out[i] = silu_mul_bf16(gate[i], up[i]);
}

static void silu_and_mul(const void *x, void *out, int64_t T, int64_t I, int num_threads, int bf16) {
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_WORK)
    for (int64_t t = 0; t < T; t++) {
        if (bf16)
            silu_row_bf16((const uint16_t *)x + t * 2 * I, (const uint16_t *)x + t * 2 * I + I,
                          (uint16_t *)out + t * I, I);
        else
            silu_row_f32((const float *)x + t * 2 * I, (const float *)x + t * 2 * I + I, (float *)out + t * I, I);
    }
}

void rms_norm_f32(const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t T,
                  int64_t D, float eps, int num_threads) {
    rms_norm(x, residual, weight, out, summed, T, D, eps, num_threads, 0);
}

void rms_norm_bf16(const void *x, const void *residual, const void *weight, void *out, void *summed, int64_t T,
                   int64_t D, float eps, int num_threads) {
    rms_norm(x, residual, weight, out, summed, T, D, eps, num_threads, 1);
}

void rope_f32(void *q, int64_t q_stride, int64_t H, void *k, int64_t k_stride, int64_t HKV, int64_t D,
              const void *cos, const void *sin, int64_t T, int num_threads) {
    rope(q, q_stride, H, k, k_stride, HKV, D, cos, sin, T, num_threads, 0);
}

void rope_bf16(void *q, int64_t q_stride, int64_t H, void *k, int64_t k_stride, int64_t HKV, int64_t D,
               const void *cos, const void *sin, int64_t T, int num_threads) {
    rope(q, q_stride, H, k, k_stride, HKV, D, cos, sin, T, num_threads, 1);
}

void silu_and_mul_f32(const void *x, void *out, int64_t T, int64_t I, int num_threads) {
    silu_and_mul(x, out, T, I, num_threads, 0);
}

void silu_and_mul_bf16(const void *x, void *out, int64_t T, int64_t I, int num_threads) {
    silu_and_mul(x, out, T, I, num_threads, 1);
}

#define RMS_NORM_PACKED(name) \
    int name##_packed(const int64_t *a) { \
        name(PTR(0), PTR(1), PTR(2), PTR(3), PTR(4), a[5], a[6], packed_float(a[7]), (int)a[8]); \
        return 0; \
    }
#define ROPE_PACKED(name) \
    int name##_packed(const int64_t *a) { \
        name(PTR(0), a[1], a[2], PTR(3), a[4], a[5], a[6], PTR(7), PTR(8), a[9], (int)a[10]); \
        return 0; \
    }
#define SILU_PACKED(name) \
    int name##_packed(const int64_t *a) { \
        name(PTR(0), PTR(1), a[2], a[3], (int)a[4]); \
        return 0; \
    }
RMS_NORM_PACKED(rms_norm_f32)
RMS_NORM_PACKED(rms_norm_bf16)
ROPE_PACKED(rope_f32)
ROPE_PACKED(rope_bf16)
SILU_PACKED(silu_and_mul_f32)
SILU_PACKED(silu_and_mul_bf16)
