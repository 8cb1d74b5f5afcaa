/*
 * kernels/copy.cu - strided copy with dtype conversion (CUDA). One thread
 * per output element: the flat index is unravelled over the shape and
 * dotted with both stride vectors. Conversions are core.h's ml_load /
 * ml_store, the CPU's own code, so every cast is bit-identical.
 */
#include "cuda_common.cuh"

extern "C" {
#include "copy.h"
}

#define MAXDIM 16

typedef struct {
    int64_t shape[MAXDIM], os[MAXDIM], is[MAXDIM];
    int ndim;
} copy_geom;

__device__ __forceinline__ void copy_offsets(const copy_geom &g, int64_t q, int64_t *oo, int64_t *io)
{
    int64_t o = 0, in = 0;
    for (int d = g.ndim - 1; d >= 0; d--) {
        int64_t s = g.shape[d], x = q % s;
        q /= s;
        o += x * g.os[d];
        in += x * g.is[d];
    }
    *oo = o;
    *io = in;
}

/* Same dtype: move the element's bytes. */
template <typename T>
__global__ void copy_same_kernel(T *out, const T *in, copy_geom g, int64_t n)
{
    ML_CUDA_FOR(q, n) {
        int64_t oo, io;
        copy_offsets(g, q, &oo, &io);
        out[oo] = in[io];
    }
}

__global__ void copy_convert_kernel(ml_dtype dto, void *out, ml_dtype dti, const void *in, copy_geom g, int64_t n)
{
    ML_CUDA_FOR(q, n) {
        int64_t oo, io;
        copy_offsets(g, q, &oo, &io);
        ml_store(dto, out, (size_t)oo, ml_load(dti, in, (size_t)io));
    }
}

template <typename T>
static void copy_same_launch(void *out, const void *in, const copy_geom &g, int64_t n, cudaStream_t st)
{
    copy_same_kernel<T><<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (T *)out, (const T *)in, g, n);
}

extern "C" ml_status ml_copy_cuda(ml_dtype dt_out, void *out, const int64_t *out_stride,
                                  ml_dtype dt_in, const void *in, const int64_t *in_stride,
                                  int ndim, const int64_t *shape, const ml_kctx *ctx)
{
    if (ndim > MAXDIM || ndim < 0)
        return ML_EUNSUPPORTED;
    copy_geom g;
    int64_t n = 1;
    g.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        g.shape[d] = shape[d];
        g.os[d] = out_stride[d];
        g.is[d] = in_stride[d];
        n *= shape[d];
    }
    if (n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    if (dt_out == dt_in) {
        switch (ml_dtype_size(dt_out)) {
        case 1:  copy_same_launch<uint8_t>(out, in, g, n, st); break;
        case 2:  copy_same_launch<uint16_t>(out, in, g, n, st); break;
        case 4:  copy_same_launch<uint32_t>(out, in, g, n, st); break;
        default: copy_same_launch<uint64_t>(out, in, g, n, st); break;
        }
    } else {
        copy_convert_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            dt_out, out, dt_in, in, g, n);
    }
    return ml_cuda_launched();
}
