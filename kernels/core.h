/*
 * kernels/core.h - what every kernel family shares: dtypes, status codes,
 * the kernel context, and scalar conversions for the 16-bit float formats.
 *
 * Not here: tensors, allocation, Lua. Kernels see raw pointers and sizes
 * only (DESIGN.md, Layers); the host owns every byte they touch.
 */
#ifndef ML_KERNELS_CORE_H
#define ML_KERNELS_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <signal.h>

/* Helpers that CUDA kernels call too (the f16/bf16 conversions, ml_load,
 * ml_store) are __host__ __device__ under nvcc and plain C elsewhere, so
 * both backends round bit-identically. */
#ifndef ML_HD
#if defined(__CUDACC__)
#define ML_HD __host__ __device__
#else
#define ML_HD
#endif
#endif

typedef enum {
    ML_F32, ML_F64, ML_BF16, ML_F16, ML_I32, ML_I64, ML_U8, ML_NDTYPES
} ml_dtype;

/* Kernel results. A kernel never raises: the binding turns these into Lua
 * errors after any parallel region has ended. */
typedef enum {
    ML_OK = 0,
    ML_EINTERRUPTED,  /* the interrupt flag was seen between tiles */
    ML_ENAN,          /* a NaN where the op refuses one */
    ML_EUNSUPPORTED,  /* dtype / op combination the backend lacks */
    ML_EDEVICE,       /* the device reported an error */
    /* Op layer only (host/runtime/op.h); the ml_err says more: */
    ML_EINVAL,        /* an argument's dtype, shape, device or value is wrong */
    ML_EALLOC,        /* the ledger or the system refused an allocation */
    ML_EIO            /* a file could not be read or written */
} ml_status;

/* Per-call context. `interrupt` points at the host's Ctrl-C flag; kernels
 * poll it between tiles, never inside one. `stream` is a cudaStream_t on the
 * CUDA backend and unused on the CPU. `progress` (may be NULL), called by
 * the main thread between tiles of long CPU kernels: MPI advances
 * non-blocking collectives (a ZeRO-3 prefetch) only inside MPI calls
 * (DESIGN.md, Distribution). */
typedef struct {
    int nthreads;
    volatile sig_atomic_t *interrupt;
    void *stream;
    void (*progress)(void *ud);
    void *progress_ud;
} ml_kctx;

/* The CPU threads a kernel may use (1 without a context). */
static inline int ml_kctx_threads(const ml_kctx *ctx)
{
    return ctx && ctx->nthreads > 0 ? ctx->nthreads : 1;
}

static inline int ml_kctx_interrupted(const ml_kctx *ctx)
{
    return ctx && ctx->interrupt && *ctx->interrupt;
}

/* Only from the process's main thread (MPI_THREAD_FUNNELED). */
static inline void ml_kctx_progress(const ml_kctx *ctx)
{
    if (ctx && ctx->progress)
        ctx->progress(ctx->progress_ud);
}

/* Work below this many elements runs on one thread: the fork/join costs
 * more than it saves. */
#define ML_PAR_MIN 32768

static inline size_t ml_dtype_size(ml_dtype dt)
{
    static const size_t sz[ML_NDTYPES] = {4, 8, 2, 2, 4, 8, 1};
    return sz[dt];
}

/* ---- 16-bit floats, bit-exact on every backend ------------------------ */

#if defined(__CUDA_ARCH__)
static inline ML_HD uint32_t ml_f32_bits(float f) { return __float_as_uint(f); }
static inline ML_HD float ml_bits_f32(uint32_t u) { return __uint_as_float(u); }
#else
static inline ML_HD uint32_t ml_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline ML_HD float ml_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
#endif

/* bf16 = the top 16 bits of an f32, rounded to nearest even; NaN stays NaN
 * (a quiet bit is forced so truncation cannot turn it into infinity). */
static inline ML_HD uint16_t ml_f32_to_bf16(float f)
{
    uint32_t u = ml_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline ML_HD float ml_bf16_to_f32(uint16_t h) { return ml_bits_f32((uint32_t)h << 16); }

/* Mixed precision (DESIGN.md, Numerics): a kernel called with dt = bf16
 * reads and writes activations and weights in bf16, computes in f32 (or
 * f64 where its f32 path does), and writes weight gradients in f32: this
 * returns that dtype, bf16's compute and gradient dtype (the CPU's
 * reference dtype for a bf16 kernel too); every other dtype's is itself. */
static inline ML_HD ml_dtype ml_grad_dtype(ml_dtype dt) { return dt == ML_BF16 ? ML_F32 : dt; }

/* IEEE binary16, round to nearest even, with subnormals, infinities, NaN. */
static inline ML_HD uint16_t ml_f32_to_f16(float f)
{
    uint32_t u = ml_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return sign | 0x7e00u;          /* NaN */
    if (absu >= 0x477ff000u) return sign | 0x7c00u;         /* overflow -> inf */
    if (absu < 0x38800000u) {                               /* subnormal or zero */
        if (absu < 0x33000000u) return sign;                /* below half the smallest subnormal */
        uint32_t mant = (absu & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(absu >> 23);                /* 14..24 */
        uint32_t half = 1u << (shift - 1);
        uint32_t rest = mant & ((1u << shift) - 1u);
        uint32_t r = mant >> shift;
        if (rest > half || (rest == half && (r & 1u))) r++;
        return sign | (uint16_t)r;
    }
    uint32_t r = absu - 0x38000000u;                        /* rebias exponent 127 -> 15 */
    uint32_t rest = r & 0x1fffu;
    r >>= 13;
    if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) r++;
    return sign | (uint16_t)r;
}

static inline ML_HD float ml_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        if (mant == 0) return ml_bits_f32(sign);
        float f = (float)mant * (1.0f / 16777216.0f);       /* mant * 2^-24 */
        return sign ? -f : f;
    }
    if (exp == 31) return ml_bits_f32(sign | 0x7f800000u | (mant << 13));
    return ml_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* Read element i of any dtype as a double, and write one back (with the
 * rounding of the target dtype). The slow generic path: kernels use it only
 * where a dtype has no specialised loop. */
static inline ML_HD double ml_load(ml_dtype dt, const void *p, size_t i)
{
    switch (dt) {
    case ML_F32:  return ((const float *)p)[i];
    case ML_F64:  return ((const double *)p)[i];
    case ML_BF16: return ml_bf16_to_f32(((const uint16_t *)p)[i]);
    case ML_F16:  return ml_f16_to_f32(((const uint16_t *)p)[i]);
    case ML_I32:  return ((const int32_t *)p)[i];
    case ML_I64:  return (double)((const int64_t *)p)[i];
    case ML_U8:   return ((const uint8_t *)p)[i];
    default:      return 0;
    }
}

/* Integer targets truncate toward zero, saturate at the type's range and
 * map NaN to 0: a defined result for every input, never a UB cast. */
static inline ML_HD double ml_to_int_range(double v, double lo, double hi)
{
    if (v != v) return 0;
    v = v < lo ? lo : v > hi ? hi : v;
    return v;
}

static inline ML_HD void ml_store(ml_dtype dt, void *p, size_t i, double v)
{
    switch (dt) {
    case ML_F32:  ((float *)p)[i] = (float)v; break;
    case ML_F64:  ((double *)p)[i] = v; break;
    case ML_BF16: ((uint16_t *)p)[i] = ml_f32_to_bf16((float)v); break;
    case ML_F16:  ((uint16_t *)p)[i] = ml_f32_to_f16((float)v); break;
    case ML_I32:  ((int32_t *)p)[i] = (int32_t)ml_to_int_range(v, -2147483648.0, 2147483647.0); break;
    case ML_I64: {   /* 2^63 is the first double past INT64_MAX: at or above it, INT64_MAX */
        double c = ml_to_int_range(v, -9223372036854775808.0, 9223372036854775808.0);
        ((int64_t *)p)[i] = c >= 9223372036854775808.0 ? INT64_MAX : (int64_t)c;
        break;
    }
    case ML_U8:   ((uint8_t *)p)[i] = (uint8_t)ml_to_int_range(v, 0.0, 255.0); break;
    default:      break;
    }
}

#endif
