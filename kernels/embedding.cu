/*
 * kernels/embedding.cu - embedding lookup and its gradient (CUDA; see
 * embedding.h).
 *
 * The forward copies rows, one thread per output element.
 *
 * The backward uses no float atomics and no scratch (the signature has
 * none): block b owns the vocabulary rows [b*EMB_ROWS, (b+1)*EMB_ROWS) and
 * scans every id, a tile of EMB_THREADS ids at a time. Each token of the
 * tile that hits its rows takes its stable rank by (row, token) in a shared
 * list: the tile's segments of a sort by id, tokens in order within each.
 * Then each thread, for the columns it owns, walks the segments, adding
 * dout[t] into a register that starts from dW[v] and goes back to dW[v] at
 * the segment's end. So dW[v, d] receives its tokens in token order, one
 * add at a time in dW's dtype: the CPU's operations exactly, so f32 and
 * f64 are bitwise equal to kernels/embedding.c. For bf16, dW is f32
 * (ml_grad_dtype) and dout is widened exactly: bitwise the CPU's f32
 * kernel on the widened dout.
 *
 * Cost: every block reads all T ids, ceil(V / EMB_ROWS) * T * 8 bytes in
 * all (about 0.6 GB, from L2, for V = 150k and T = 32k); dout is read once.
 * A row hit by many tokens is summed by one block, like a sorted segment.
 * A sort into a scratch buffer (T token indices and V + 1 segment starts)
 * would drop the id scans; the signature would then need a scratch pointer.
 */
#include "cuda_float.cuh"

extern "C" {
#include "embedding.h"
}

#define EMB_THREADS 256
#define EMB_ROWS 64

template <typename T>
__global__ void emb_fwd_kernel(T *out, const int64_t *ids, const T *W, int64_t T_, int64_t D)
{
    ML_CUDA_FOR(q, T_ * D) {
        int64_t t = q / D, d = q % D;
        out[q] = W[ids[t] * D + d];
    }
}

/* dW of the gradient type G (ml_grad_dtype: f32 for a bf16 T) */
template <typename T, typename G>
__global__ void __launch_bounds__(EMB_THREADS)
emb_bwd_kernel(G *dW, const T *dout, const int64_t *ids, int64_t T_, int64_t V, int64_t D)
{
    typedef ml_float<T> F;
    typedef ml_float<G> FG;
    typedef typename FG::acc A;
    __shared__ int64_t tile_v[EMB_THREADS];   /* the tile's rows; -1: not the block's */
    __shared__ int64_t seg_t[EMB_THREADS];    /* hits sorted by (row, token): the token */
    __shared__ int64_t seg_v[EMB_THREADS];    /* and its row */
    for (int64_t v0 = (int64_t)blockIdx.x * EMB_ROWS; v0 < V; v0 += (int64_t)gridDim.x * EMB_ROWS) {
        int64_t v1 = v0 + EMB_ROWS < V ? v0 + EMB_ROWS : V;
        for (int64_t t0 = 0; t0 < T_; t0 += EMB_THREADS) {
            int64_t t = t0 + threadIdx.x, v = t < T_ ? ids[t] : -1;
            int hit = v >= v0 && v < v1;
            tile_v[threadIdx.x] = hit ? v : -1;
            int n = __syncthreads_count(hit);
            if (hit) {
                int rank = 0;
                for (int k = 0; k < EMB_THREADS; k++) {
                    int64_t u = tile_v[k];
                    rank += u >= 0 && (u < v || (u == v && k < (int)threadIdx.x));
                }
                seg_t[rank] = t;
                seg_v[rank] = v;
            }
            __syncthreads();
            for (int64_t d = threadIdx.x; n > 0 && d < D; d += EMB_THREADS) {
                int64_t cur = seg_v[0];
                A acc = FG::load(dW[cur * D + d]);
                for (int j = 0; j < n; j++) {
                    if (seg_v[j] != cur) {
                        dW[cur * D + d] = FG::store(acc);
                        cur = seg_v[j];
                        acc = FG::load(dW[cur * D + d]);
                    }
                    acc += F::load(dout[seg_t[j] * D + d]);
                }
                dW[cur * D + d] = FG::store(acc);
            }
            __syncthreads();   /* the tile's lists are rewritten by the next tile */
        }
    }
}

template <typename T>
static ml_status fwd_launch(void *out, const int64_t *ids, const void *W, int64_t T_, int64_t D,
                            cudaStream_t st)
{
    emb_fwd_kernel<T><<<ml_cuda_blocks(T_ * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (T *)out, ids, (const T *)W, T_, D);
    return ml_cuda_launched();
}

extern "C" ml_status ml_embedding_forward_cuda(ml_dtype dt, void *out, const int64_t *ids,
                                               const void *W, int64_t T, int64_t V, int64_t D,
                                               const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (T <= 0 || D <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (dt) {
    case ML_F32: return fwd_launch<float>(out, ids, W, T, D, st);
    case ML_F64: return fwd_launch<double>(out, ids, W, T, D, st);
    default:     return fwd_launch<ml_bf16>(out, ids, W, T, D, st);
    }
}

template <typename T, typename G>
static ml_status bwd_launch(void *dW, const void *dout, const int64_t *ids, int64_t T_, int64_t V,
                            int64_t D, cudaStream_t st)
{
    int64_t ranges = (V + EMB_ROWS - 1) / EMB_ROWS;
    unsigned blocks = (unsigned)(ranges < ML_CUDA_MAX_BLOCKS ? ranges : ML_CUDA_MAX_BLOCKS);
    emb_bwd_kernel<T, G><<<blocks, EMB_THREADS, 0, st>>>((G *)dW, (const T *)dout, ids, T_, V, D);
    return ml_cuda_launched();
}

extern "C" ml_status ml_embedding_backward_cuda(ml_dtype dt, void *dW, const void *dout,
                                                const int64_t *ids, int64_t T, int64_t V,
                                                int64_t D, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (T <= 0 || V <= 0 || D <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (dt) {
    case ML_F32: return bwd_launch<float, float>(dW, dout, ids, T, V, D, st);
    case ML_F64: return bwd_launch<double, double>(dW, dout, ids, T, V, D, st);
    default:     return bwd_launch<ml_bf16, float>(dW, dout, ids, T, V, D, st);
    }
}
