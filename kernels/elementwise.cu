/*
 * kernels/elementwise.cu - CUDA fill, arange, binary, scalar and unary ops.
 * Same semantics as kernels/elementwise.c: f32 computes in float, f64 in
 * double, integers through the double path with the CPU's truncation and
 * saturation (ml_store). Built with --fmad=false, so add/sub/mul/div, sqrt
 * and comparisons are bit-identical to the CPU; exp, log and tanh use the
 * CUDA math library (within 2 ulp of glibc), which the GPU spec allows for.
 * bf16 (binary, scalar and unary float ops: the model's residual adds,
 * scales and activations) loads to f32, computes as f32 does and stores
 * rounded to nearest even (cuda_float.cuh), so it equals the f32 op on the
 * widened values, rounded once; the CPU has no bf16 twin.
 */
#include "cuda_float.cuh"

extern "C" {
#include "elementwise_ops.h"
}

/* ---- fill / arange ------------------------------------------------------ */

/* The host rounds v to the target dtype once (ml_store, as the CPU does);
 * the kernel only replicates the bit pattern. */
template <typename T>
__global__ void fill_kernel(T *out, T v, int64_t n)
{
    ML_CUDA_FOR(i, n) out[i] = v;
}

__global__ void arange_kernel(ml_dtype dt, void *out, double start, double step, int64_t n)
{
    ML_CUDA_FOR(i, n) ml_store(dt, out, (size_t)i, start + (double)i * step);
}

template <typename T>
static ml_status fill_launch(void *out, const unsigned char *pattern, int64_t n, cudaStream_t st)
{
    T v;
    memcpy(&v, pattern, sizeof v);
    fill_kernel<T><<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>((T *)out, v, n);
    return ml_cuda_launched();
}

extern "C" ml_status ml_fill_cuda(ml_dtype dt, void *out, double v, int64_t n, const ml_kctx *ctx)
{
    if (n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    unsigned char pattern[8] = {0};   /* ml_store writes dt's bytes of it */
    ml_store(dt, pattern, 0, v);
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (ml_dtype_size(dt)) {
    case 1:  return fill_launch<uint8_t>(out, pattern, n, st);
    case 2:  return fill_launch<uint16_t>(out, pattern, n, st);
    case 4:  return fill_launch<uint32_t>(out, pattern, n, st);
    default: return fill_launch<uint64_t>(out, pattern, n, st);
    }
}

extern "C" ml_status ml_arange_cuda(ml_dtype dt, void *out, double start, double step, int64_t n,
                                    const ml_kctx *ctx)
{
    if (n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    arange_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, ml_cuda_stream(ctx)>>>(
        dt, out, start, step, n);
    return ml_cuda_launched();
}

/* ---- binary ------------------------------------------------------------- */

template <typename T> struct binop_of;
template <> struct binop_of<float> {
    static __device__ __forceinline__ float apply(ml_binop op, float x, float y) { return ml_binop_f32(op, x, y); }
};
template <> struct binop_of<double> {
    static __device__ __forceinline__ double apply(ml_binop op, double x, double y) { return ml_binop_f64(op, x, y); }
};
template <> struct binop_of<ml_bf16> {
    static __device__ __forceinline__ ml_bf16 apply(ml_binop op, ml_bf16 x, ml_bf16 y)
    {
        typedef ml_float<ml_bf16> F;
        return F::store(ml_binop_f32(op, F::load(x), F::load(y)));
    }
};
template <> struct binop_of<int32_t> {
    static __device__ __forceinline__ int32_t apply(ml_binop op, int32_t x, int32_t y)
    {
        int32_t r;
        ml_store(ML_I32, &r, 0, ml_binop_int(op, (double)x, (double)y));
        return r;
    }
};
template <> struct binop_of<int64_t> {
    static __device__ __forceinline__ int64_t apply(ml_binop op, int64_t x, int64_t y)
    {
        int64_t r;
        ml_store(ML_I64, &r, 0, ml_binop_int(op, (double)x, (double)y));
        return r;
    }
};

template <typename T>
__global__ void binary_kernel(ml_binop op, T *out, const T *a, const T *b, int64_t n, int64_t na, int64_t nb)
{
    ML_CUDA_FOR(i, n) {
        T x = a[na == n ? i : i % na], y = b[nb == n ? i : i % nb];
        out[i] = binop_of<T>::apply(op, x, y);
    }
}

/* The scalar arrives as the CPU uses it: (float)s for f32 (and bf16, which
 * computes in f32), s for f64, and as a double for the integer path. */
template <typename T>
__global__ void scalar_kernel(ml_binop op, T *out, const T *a, typename ml_float<T>::acc s,
                              int reverse, int64_t n)
{
    typedef ml_float<T> F;
    typedef binop_of<typename F::acc> B;
    ML_CUDA_FOR(i, n) {
        typename F::acc x = F::load(a[i]);
        out[i] = F::store(reverse ? B::apply(op, s, x) : B::apply(op, x, s));
    }
}

template <typename T>
__global__ void scalar_int_kernel(ml_binop op, T *out, const T *a, double s, int reverse, int64_t n)
{
    ML_CUDA_FOR(i, n) {
        double x = (double)a[i];
        T r;
        ml_store(sizeof(T) == 4 ? ML_I32 : ML_I64, &r, 0,
                 reverse ? ml_binop_int(op, s, x) : ml_binop_int(op, x, s));
        out[i] = r;
    }
}

template <typename T>
static ml_status binary_launch(ml_binop op, void *out, const void *a, const void *b,
                               int64_t n, int64_t na, int64_t nb, cudaStream_t st)
{
    binary_kernel<T><<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        op, (T *)out, (const T *)a, (const T *)b, n, na, nb);
    return ml_cuda_launched();
}

extern "C" ml_status ml_binary_cuda(ml_binop op, ml_dtype dt, void *out, const void *a, const void *b,
                                    int64_t n, int64_t na, int64_t nb, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16 && dt != ML_I32 && dt != ML_I64)
        return ML_EUNSUPPORTED;
    if (n <= 0)
        return ML_OK;
    if (na <= 0 || nb <= 0)
        return ML_EUNSUPPORTED;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (dt) {
    case ML_F32: return binary_launch<float>(op, out, a, b, n, na, nb, st);
    case ML_F64: return binary_launch<double>(op, out, a, b, n, na, nb, st);
    case ML_BF16: return binary_launch<ml_bf16>(op, out, a, b, n, na, nb, st);
    case ML_I32: return binary_launch<int32_t>(op, out, a, b, n, na, nb, st);
    default:     return binary_launch<int64_t>(op, out, a, b, n, na, nb, st);
    }
}

extern "C" ml_status ml_binary_scalar_cuda(ml_binop op, ml_dtype dt, void *out, const void *a, double s,
                                           int reverse, int64_t n, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16 && dt != ML_I32 && dt != ML_I64)
        return ML_EUNSUPPORTED;
    if (n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    unsigned blocks = ml_cuda_blocks(n, ML_CUDA_THREADS);
    switch (dt) {
    case ML_F32:
        scalar_kernel<float><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (float *)out, (const float *)a, (float)s, reverse, n);
        break;
    case ML_F64:
        scalar_kernel<double><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (double *)out, (const double *)a, s, reverse, n);
        break;
    case ML_BF16:
        scalar_kernel<ml_bf16><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (ml_bf16 *)out, (const ml_bf16 *)a, (float)s, reverse, n);
        break;
    case ML_I32:
        scalar_int_kernel<int32_t><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (int32_t *)out, (const int32_t *)a, s, reverse, n);
        break;
    default:
        scalar_int_kernel<int64_t><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (int64_t *)out, (const int64_t *)a, s, reverse, n);
        break;
    }
    return ml_cuda_launched();
}

/* ---- unary -------------------------------------------------------------- */

__device__ __forceinline__ float unop_of(ml_unop op, float x) { return ml_unop_f32(op, x); }
__device__ __forceinline__ double unop_of(ml_unop op, double x) { return ml_unop_f64(op, x); }

template <typename T>
__global__ void unary_float_kernel(ml_unop op, T *out, const T *a, int64_t n)
{
    typedef ml_float<T> F;
    ML_CUDA_FOR(i, n) out[i] = F::store(unop_of(op, F::load(a[i])));
}

/* Two's complement wrap-around for -INT_MIN, as on the CPU. */
template <typename T, typename U>
__global__ void unary_int_kernel(ml_unop op, T *out, const T *a, int64_t n)
{
    ML_CUDA_FOR(i, n) {
        U u = (U)a[i], neg = (U)0 - u;
        out[i] = (T)((op == ML_NEG || a[i] < 0) ? neg : u);
    }
}

extern "C" ml_status ml_unary_cuda(ml_unop op, ml_dtype dt, void *out, const void *a, int64_t n,
                                   const ml_kctx *ctx)
{
    int is_int = dt == ML_I32 || dt == ML_I64;
    if (!(dt == ML_F32 || dt == ML_F64 || dt == ML_BF16 || (is_int && (op == ML_NEG || op == ML_ABS))))
        return ML_EUNSUPPORTED;
    if (n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    unsigned blocks = ml_cuda_blocks(n, ML_CUDA_THREADS);
    switch (dt) {
    case ML_F32:
        unary_float_kernel<float><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (float *)out, (const float *)a, n);
        break;
    case ML_F64:
        unary_float_kernel<double><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (double *)out, (const double *)a, n);
        break;
    case ML_BF16:
        unary_float_kernel<ml_bf16><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (ml_bf16 *)out, (const ml_bf16 *)a, n);
        break;
    case ML_I32:
        unary_int_kernel<int32_t, uint32_t><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (int32_t *)out, (const int32_t *)a, n);
        break;
    default:
        unary_int_kernel<int64_t, uint64_t><<<blocks, ML_CUDA_THREADS, 0, st>>>(
            op, (int64_t *)out, (const int64_t *)a, n);
        break;
    }
    return ml_cuda_launched();
}
