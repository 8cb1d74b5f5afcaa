/*
 * kernels/vmath.h - f32 math that vectorises, for the CPU kernels'
 * elementwise loops (attention's softmax, the experts' SwiGLU): plain IEEE
 * operations only (no libm call, no float ?:), so a loop over them
 * vectorises, and -ffp-contract=off keeps every clone's results bitwise
 * the same. Not for CUDA (its kernels call expf).
 */
#ifndef ML_KERNELS_VMATH_H
#define ML_KERNELS_VMATH_H

#include <stdint.h>
#include <string.h>

/* Hot loops are also built for AVX-512 and AVX2 and picked at load time:
 * the same IEEE operations in the same order (no FMA: -ffp-contract=off),
 * only wider, so every clone gives bitwise the same results (attention's
 * outputs and gradients, a decode's, and the router's compared bitwise
 * across builds holding only the default, the AVX2 and the AVX-512 clone;
 * AVX-512 is 10-20% faster than AVX2 on attention at S 8192 on a Zen 4). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define ML_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ML_CLONES
#endif

/* The 16 lanes of a row's partial sums or maxima combined in registers, as
 * a fixed tree (lane t with lane t + w, for w = 8, 4, 2, 1): GCC's vector
 * extensions, so every clone, whatever its width, combines in this order
 * (a loop over a float[16] compiles to a store, then scalar reloads that
 * wait on it). The tree runs on 8-lane vectors, lanes 0-7 and 8-15 first:
 * one AVX2 register each (as 16-lane vectors, every step of an AVX2 clone
 * shuffled across two registers: the forward softmax's maxima took 6% of
 * attention's forward on a Zen 3). */
typedef float ml_v8f __attribute__((vector_size(32)));
typedef int32_t ml_v8i __attribute__((vector_size(32)));

/* v's lanes w .. 2w-1 brought down to lanes 0 .. w-1 (the rest repeat) */
#define ML_V8_HALF4(v) __builtin_shuffle(v, (ml_v8i){4, 5, 6, 7, 4, 5, 6, 7})
#define ML_V8_HALF2(v) __builtin_shuffle(v, (ml_v8i){2, 3, 2, 3, 2, 3, 2, 3})
#define ML_V8_HALF1(v) __builtin_shuffle(v, (ml_v8i){1, 1, 1, 1, 1, 1, 1, 1})

static inline float lanes16_sum(const float *part)
{
    ml_v8f v, u;
    memcpy(&v, part, sizeof v);
    memcpy(&u, part + 8, sizeof u);
    v += u;
    v += ML_V8_HALF4(v);
    v += ML_V8_HALF2(v);
    v += ML_V8_HALF1(v);
    return v[0];
}

/* each lane of v becomes u's where u > v, else stays (NaN handled as in a
 * loop of m = x > m ? x : m: a NaN u never wins, a NaN v is kept) */
#define ML_V8_MAX(v, u)                                      \
    do {                                                     \
        ml_v8f u_ = (u);                                     \
        ml_v8i gt_ = u_ > (v), ui_, vi_;                     \
        memcpy(&ui_, &u_, sizeof ui_);                       \
        memcpy(&vi_, &(v), sizeof vi_);                      \
        vi_ = (ui_ & gt_) | (vi_ & ~gt_);                    \
        memcpy(&(v), &vi_, sizeof vi_);                      \
    } while (0)

static inline float lanes16_max(const float *part)
{
    ml_v8f v, u;
    memcpy(&v, part, sizeof v);
    memcpy(&u, part + 8, sizeof u);
    ML_V8_MAX(v, u);
    ML_V8_MAX(v, ML_V8_HALF4(v));
    ML_V8_MAX(v, ML_V8_HALF2(v));
    ML_V8_MAX(v, ML_V8_HALF1(v));
    return v[0];
}

/* e^x in f32 for x <= 0 (Cephes expf: round-to-nearest range reduction, a
 * degree-5 polynomial, 2^n from the exponent bits; about 1 ulp). Plain IEEE
 * operations only, so a loop over it vectorises and every clone gives the
 * same bits; x below -87.3 is clamped (e^-87.3 ~ 1e-38). */
static inline float exp_f(float x)
{
    uint32_t ux;   /* clamp on the bits (a float ?: stops the vectoriser): */
    memcpy(&ux, &x, sizeof ux);   /* negative floats order as unsigned magnitudes */
    ux = ux < 0xC2AE999Au ? ux : 0xC2AE999Au;   /* -87.3f */
    memcpy(&x, &ux, sizeof x);
    float t = x * 1.44269504088896341f + 12582912.0f;   /* 1.5 * 2^23: round to integer */
    float n = t - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float sc;
    memcpy(&sc, &bits, sizeof sc);
    return y * sc;
}

/* The logistic sigmoid 1 / (1 + e^-x) from z = e^-|x| (exp_f's range):
 * 1 / (1 + z) for x >= 0, z / (1 + z) below, the choice made on the sign
 * bit. NaN stays NaN in what uses x (silu = x·s). For x below
 * -87.3 the result is e^-87.3 ~ 1e-38 rather than smaller. */
static inline float sigmoid_f(float x)
{
    uint32_t ux, uz, one = 0x3f800000u;
    memcpy(&ux, &x, sizeof ux);
    uint32_t mask = (uint32_t)0 - (ux >> 31), na = ux | 0x80000000u;   /* -|x| */
    float m;
    memcpy(&m, &na, sizeof m);
    float z = exp_f(m);
    memcpy(&uz, &z, sizeof uz);
    uint32_t un = (uz & mask) | (one & ~mask);
    float num;
    memcpy(&num, &un, sizeof num);
    return num / (1.0f + z);
}

#endif
