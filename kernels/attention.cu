/*
 * kernels/attention.cu - tiled causal GQA attention on CUDA (see
 * attention.h): the CPU's f64 tile walk with AT_B x AT_B tiles, one thread
 * block per tile, never an S x S matrix and no atomics.
 *
 * A block has AT_B * AT_B threads; thread x is tile row x / AT_B and column
 * x % AT_B. A column is a key of the tile while scores are computed and a
 * slice of the head dim (d = col, col + AT_B, ...) while rows accumulate,
 * kept in registers (AT_NE slots). Tiles of q, k, v and dout sit in
 * dynamic shared memory as the accumulation type (f32 for f32 and bf16,
 * f64 for f64), rows padded to an odd stride against bank conflicts.
 *
 * Forward: one block per (query tile, head), key tiles up to the diagonal
 * (with a KV cache, Sq < Sk: up to the tile's last query's position),
 * online softmax (running max in the accumulation type, running sum in
 * f64), lse = m + log l. Backward: drow = dout . out per (head, row) in
 * f64; dk, dv per (key tile, kv head) over the group's heads and the query
 * tiles at and after it; dq per (query tile, head) over the key tiles up to
 * the diagonal; both recompute P from q, k and lse. Every sum runs in the
 * CPU f64 path's order (dots over d ascending, keys ascending, heads then
 * queries ascending) and --fmad=false keeps products unfused, so f64
 * differs from the CPU only through the tile size of the online softmax
 * and CUDA's exp/log (a few ulp); f32 differs from the CPU's sgemm tiles
 * by reordering (normwise ~1e-6). Deterministic: each output element is
 * written by one thread, in a fixed order.
 *
 * Shared memory, dynamic and sized by hd: 2 tiles [AT_B, hd | 1] (forward)
 * or 4 (backward) plus up to two [AT_B, AT_B]. f32 and bf16: forward at
 * most 35 KiB; backward within 48 KiB up to hd = 176, 66 KiB at hd = 256.
 * f64: within 48 KiB up to hd = 160 forward and 80 backward, 133 KiB at
 * most. Beyond 48 KiB needs the opt-in: each kernel is granted its size at
 * ML_ATT_HD_MAX with cudaFuncSetAttribute before each launch.
 *
 * The caller's scratch is not used. The interrupt flag is polled before each
 * launch.
 */
#include "cuda_common.cuh"

extern "C" {
#include "attention.h"
}

#include <math.h>

#define AT_B 16                          /* rows of a query or key tile */
#define AT_THREADS (AT_B * AT_B)
#define AT_NE (ML_ATT_HD_MAX / AT_B)     /* head-dim slots per thread */

/* ---- element access: f32, f64, bf16 (as uint16_t) ------------------------ */

__device__ __forceinline__ float ld_el(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ double ld_el(const double *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld_el(const uint16_t *p, int64_t i) { return ml_bf16_to_f32(p[i]); }

__device__ __forceinline__ void st_el(float *p, int64_t i, float x) { p[i] = x; }
__device__ __forceinline__ void st_el(double *p, int64_t i, double x) { p[i] = x; }
__device__ __forceinline__ void st_el(uint16_t *p, int64_t i, float x) { p[i] = ml_f32_to_bf16(x); }

__device__ __forceinline__ float at_exp(float x) { return expf(x); }
__device__ __forceinline__ double at_exp(double x) { return exp(x); }

/* rows [r0, r0 + AT_B) of head h of a [S, heads, hd] tensor -> tile
 * [AT_B, ld]; rows >= S are zero */
template <typename T, typename A>
__device__ void load_tile(A *tile, int ld, const T *p, int64_t r0, int64_t S, int64_t heads,
                          int64_t h, int hd)
{
    for (int x = threadIdx.x; x < AT_B * hd; x += AT_THREADS) {
        int r = x / hd, d = x % hd;
        int64_t i = r0 + r;
        tile[r * ld + d] = i < S ? (A)ld_el(p, (i * heads + h) * hd + d) : (A)0;
    }
}

/* sum_d x[d] * y[d], d ascending */
template <typename A>
__device__ __forceinline__ A dot(const A *x, const A *y, int hd)
{
    A s = 0;
    for (int d = 0; d < hd; d++)
        s += x[d] * y[d];
    return s;
}

/* keys of the tile at j0 that query i sees: j0 <= j <= i, j < S */
__device__ __forceinline__ int keys_seen(int64_t i, int64_t j0, int64_t S)
{
    int64_t n = i + 1 < S ? i + 1 - j0 : S - j0;
    return (int)(n < AT_B ? n : AT_B);
}

/* ---- kernels --------------------------------------------------------------- */

/* out, lse for one (query tile blockIdx.x, head blockIdx.y); query i sits at
 * position P + i of the Sk keys, P = Sk - Sq. A row past its last key in a
 * tile (P > 0 only) sees no key there: its max stays, corr = exp(0) = 1. */
template <typename T, typename A>
__global__ void __launch_bounds__(AT_THREADS)
fwd_kernel(T *out, double *lse, const T *q, const T *k, const T *v, int64_t Sq, int64_t Sk,
           int64_t H, int64_t KV, int hd, A scale)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int ld = hd | 1;
    A *Qs = (A *)smem, *KVs = Qs + AT_B * ld, *Ss = KVs + AT_B * ld, *Ps = Ss + AT_B * AT_B;
    int64_t h = blockIdx.y, g = h / (H / KV), i0 = (int64_t)blockIdx.x * AT_B;
    int row = threadIdx.x / AT_B, col = threadIdx.x % AT_B;
    int64_t i = i0 + row;
    A m = -INFINITY, acc[AT_NE];
    double l = 0;
    #pragma unroll
    for (int e = 0; e < AT_NE; e++)
        acc[e] = 0;
    int64_t P = Sk - Sq, iend = P + (i0 + AT_B < Sq ? i0 + AT_B : Sq);
    load_tile(Qs, ld, q, i0, Sq, H, h, hd);
    for (int64_t j0 = 0; j0 < iend; j0 += AT_B) {
        int nv = keys_seen(P + i, j0, Sk);
        __syncthreads();   /* the previous tile's V and P are read */
        load_tile(KVs, ld, k, j0, Sk, KV, g, hd);
        __syncthreads();
        Ss[row * AT_B + col] = dot(Qs + row * ld, KVs + col * ld, hd) * scale;
        __syncthreads();   /* scores complete, K read */
        A mx = m;
        for (int c = 0; c < nv; c++)
            mx = Ss[row * AT_B + c] > mx ? Ss[row * AT_B + c] : mx;
        Ps[row * AT_B + col] = col < nv ? at_exp(Ss[row * AT_B + col] - mx) : (A)0;
        load_tile(KVs, ld, v, j0, Sk, KV, g, hd);
        __syncthreads();
        A corr = m == (A)-INFINITY ? (A)0 : at_exp(m - mx);
        l *= corr;
        #pragma unroll
        for (int e = 0; e < AT_NE; e++)
            acc[e] *= corr;
        for (int c = 0; c < nv; c++) {
            A p = Ps[row * AT_B + c];
            l += p;
            #pragma unroll
            for (int e = 0; e < AT_NE; e++) {
                int d = col + e * AT_B;
                if (d < hd)
                    acc[e] += p * KVs[c * ld + d];
            }
        }
        m = mx;
    }
    if (i >= Sq)
        return;
    double inv = 1.0 / l;
    #pragma unroll
    for (int e = 0; e < AT_NE; e++) {
        int d = col + e * AT_B;
        if (d < hd)
            st_el(out, (i * H + h) * hd + d, (A)(acc[e] * inv));
    }
    if (col == 0)
        lse[h * Sq + i] = (double)m + log(l);
}

/* drow[h, i] = dout_i . out_i in f64, d ascending */
template <typename T>
__global__ void drow_kernel(double *drow, const T *dout, const T *out, int64_t S, int64_t H, int hd)
{
    ML_CUDA_FOR(x, H * S) {
        int64_t h = x / S, i = x % S, base = (i * H + h) * hd;
        double s = 0;
        for (int d = 0; d < hd; d++)
            s += (double)ld_el(dout, base + d) * (double)ld_el(out, base + d);
        drow[x] = s;
    }
}

/* dk, dv for one (key tile blockIdx.x, kv head blockIdx.y): the group's
 * heads ascending, then the query tiles at and after the key tile. While
 * scoring, row is a query and col a key; while accumulating, row is a key
 * and col a head-dim slice. */
template <typename T, typename A>
__global__ void __launch_bounds__(AT_THREADS)
dkv_kernel(T *dk, T *dv, const T *dout, const T *q, const T *k, const T *v, const double *lse,
           const double *drow, int64_t S, int64_t H, int64_t KV, int hd, A scale)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int ld = hd | 1;
    A *Ks = (A *)smem, *Vs = Ks + AT_B * ld, *Qs = Vs + AT_B * ld, *Gs = Qs + AT_B * ld;
    A *Ps = Gs + AT_B * ld, *Ds = Ps + AT_B * AT_B;
    int64_t g = blockIdx.y, group = H / KV, j0 = (int64_t)blockIdx.x * AT_B;
    int row = threadIdx.x / AT_B, col = threadIdx.x % AT_B;
    int64_t j = j0 + row;   /* this thread's key while accumulating */
    A ak[AT_NE], av[AT_NE];
    #pragma unroll
    for (int e = 0; e < AT_NE; e++)
        ak[e] = av[e] = 0;
    load_tile(Ks, ld, k, j0, S, KV, g, hd);
    load_tile(Vs, ld, v, j0, S, KV, g, hd);
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        for (int64_t i0 = j0; i0 < S; i0 += AT_B) {
            __syncthreads();   /* the previous tile's Q, dout, P, dS are read */
            load_tile(Qs, ld, q, i0, S, H, h, hd);
            load_tile(Gs, ld, dout, i0, S, H, h, hd);
            __syncthreads();
            int64_t iq = i0 + row;
            A p = 0, ds = 0;
            if (iq < S && j0 + col <= iq) {
                p = at_exp(dot(Qs + row * ld, Ks + col * ld, hd) * scale - (A)lse[h * S + iq]);
                ds = p * (dot(Gs + row * ld, Vs + col * ld, hd) - (A)drow[h * S + iq]);
            }
            Ps[row * AT_B + col] = p;
            Ds[row * AT_B + col] = ds;
            __syncthreads();
            /* the queries that see key j: i >= j, i < S */
            int r0 = j - i0 > 0 ? (int)(j - i0) : 0;
            int r1 = S - i0 < AT_B ? (int)(S - i0) : AT_B;
            for (int r = r0; r < r1; r++) {
                A pr = Ps[r * AT_B + row], dr = Ds[r * AT_B + row];
                #pragma unroll
                for (int e = 0; e < AT_NE; e++) {
                    int d = col + e * AT_B;
                    if (d < hd) {
                        av[e] += pr * Gs[r * ld + d];
                        ak[e] += dr * Qs[r * ld + d];
                    }
                }
            }
        }
    }
    if (j >= S)
        return;
    #pragma unroll
    for (int e = 0; e < AT_NE; e++) {
        int d = col + e * AT_B;
        if (d < hd) {
            st_el(dk, (j * KV + g) * hd + d, ak[e] * scale);
            st_el(dv, (j * KV + g) * hd + d, av[e]);
        }
    }
}

/* dq for one (query tile blockIdx.x, head blockIdx.y), key tiles ascending
 * up to the diagonal */
template <typename T, typename A>
__global__ void __launch_bounds__(AT_THREADS)
dq_kernel(T *dq, const T *dout, const T *q, const T *k, const T *v, const double *lse,
          const double *drow, int64_t S, int64_t H, int64_t KV, int hd, A scale)
{
    extern __shared__ __align__(16) unsigned char smem[];
    int ld = hd | 1;
    A *Qs = (A *)smem, *Gs = Qs + AT_B * ld, *Ks = Gs + AT_B * ld, *Vs = Ks + AT_B * ld;
    A *Ds = Vs + AT_B * ld;
    int64_t h = blockIdx.y, g = h / (H / KV), i0 = (int64_t)blockIdx.x * AT_B;
    int row = threadIdx.x / AT_B, col = threadIdx.x % AT_B;
    int64_t i = i0 + row;
    A z = i < S ? (A)lse[h * S + i] : (A)0, di = i < S ? (A)drow[h * S + i] : (A)0;
    A acc[AT_NE];
    #pragma unroll
    for (int e = 0; e < AT_NE; e++)
        acc[e] = 0;
    load_tile(Qs, ld, q, i0, S, H, h, hd);
    load_tile(Gs, ld, dout, i0, S, H, h, hd);
    for (int64_t j0 = 0; j0 <= i0; j0 += AT_B) {
        int nv = keys_seen(i, j0, S);
        __syncthreads();   /* the previous tile's K and dS are read */
        load_tile(Ks, ld, k, j0, S, KV, g, hd);
        load_tile(Vs, ld, v, j0, S, KV, g, hd);
        __syncthreads();
        A ds = 0;
        if (col < nv) {
            A p = at_exp(dot(Qs + row * ld, Ks + col * ld, hd) * scale - z);
            ds = p * (dot(Gs + row * ld, Vs + col * ld, hd) - di);
        }
        Ds[row * AT_B + col] = ds;
        __syncthreads();
        for (int c = 0; c < nv; c++) {
            A dc = Ds[row * AT_B + c];
            #pragma unroll
            for (int e = 0; e < AT_NE; e++) {
                int d = col + e * AT_B;
                if (d < hd)
                    acc[e] += dc * Ks[c * ld + d];
            }
        }
    }
    if (i >= S)
        return;
    #pragma unroll
    for (int e = 0; e < AT_NE; e++) {
        int d = col + e * AT_B;
        if (d < hd)
            st_el(dq, (i * H + h) * hd + d, acc[e] * scale);
    }
}

/* ---- launchers ------------------------------------------------------------- */

/* dynamic shared memory of `tiles` [AT_B, hd | 1] tiles and `squares`
 * [AT_B, AT_B] ones of A */
template <typename A>
static size_t smem_bytes(int hd, int tiles, int squares)
{
    return ((size_t)tiles * AT_B * (hd | 1) + (size_t)squares * AT_B * AT_B) * sizeof(A);
}

/* Allow a kernel the shared memory of the largest head dim (the same value
 * on every call, so concurrent callers never lower it under each other). */
template <typename F>
static ml_status allow_smem(F *kernel, size_t bytes)
{
    return ml_cuda_status(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)bytes));
}

template <typename T, typename A>
static ml_status fwd_launch(void *out, double *lse, const void *q, const void *k, const void *v,
                            int64_t Sq, int64_t Sk, int64_t H, int64_t KV, int hd,
                            const ml_kctx *ctx)
{
    ml_status s = allow_smem(fwd_kernel<T, A>, smem_bytes<A>(ML_ATT_HD_MAX, 2, 2));
    if (s != ML_OK)
        return s;
    dim3 grid((unsigned)((Sq + AT_B - 1) / AT_B), (unsigned)H);
    fwd_kernel<T, A><<<grid, AT_THREADS, smem_bytes<A>(hd, 2, 2), ml_cuda_stream(ctx)>>>(
        (T *)out, lse, (const T *)q, (const T *)k, (const T *)v, Sq, Sk, H, KV, hd,
        (A)(1.0 / sqrt((double)hd)));
    return ml_cuda_launched();
}

template <typename T, typename A>
static ml_status bwd_launch(void *dq, void *dk, void *dv, double *drow, const void *dout,
                            const void *q, const void *k, const void *v, const void *out,
                            const double *lse, int64_t S, int64_t H, int64_t KV, int hd,
                            const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    A scale = (A)(1.0 / sqrt((double)hd));
    unsigned nt = (unsigned)((S + AT_B - 1) / AT_B);
    drow_kernel<T><<<ml_cuda_blocks(H * S, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        drow, (const T *)dout, (const T *)out, S, H, hd);
    ml_status s = ml_cuda_launched();
    if (s != ML_OK)
        return s;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    s = allow_smem(dkv_kernel<T, A>, smem_bytes<A>(ML_ATT_HD_MAX, 4, 2));
    if (s != ML_OK)
        return s;
    dkv_kernel<T, A><<<dim3(nt, (unsigned)KV), AT_THREADS, smem_bytes<A>(hd, 4, 2), st>>>(
        (T *)dk, (T *)dv, (const T *)dout, (const T *)q, (const T *)k, (const T *)v, lse, drow,
        S, H, KV, hd, scale);
    s = ml_cuda_launched();
    if (s != ML_OK)
        return s;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    s = allow_smem(dq_kernel<T, A>, smem_bytes<A>(ML_ATT_HD_MAX, 4, 1));
    if (s != ML_OK)
        return s;
    dq_kernel<T, A><<<dim3(nt, (unsigned)H), AT_THREADS, smem_bytes<A>(hd, 4, 1), st>>>(
        (T *)dq, (const T *)dout, (const T *)q, (const T *)k, (const T *)v, lse, drow, S, H, KV,
        hd, scale);
    return ml_cuda_launched();
}

/* the CPU's argument checks, with bf16 as a third dtype */
static ml_status check_args(ml_dtype dt, int64_t S, int64_t H, int64_t KV, int64_t hd)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (hd < 1 || hd > ML_ATT_HD_MAX || KV < 1 || H % KV != 0)
        return ML_EUNSUPPORTED;
    return ML_OK;
}

extern "C" ml_status ml_attention_forward_cuda(ml_dtype dt, void *out, double *lse, const void *q,
                                               const void *k, const void *v, int64_t Sq, int64_t Sk,
                                               int64_t H, int64_t KV, int64_t hd, void *scratch,
                                               const ml_kctx *ctx)
{
    ml_status s = Sq < 0 || Sq > Sk ? ML_EUNSUPPORTED : check_args(dt, Sq, H, KV, hd);
    if (s != ML_OK || Sq == 0 || H == 0)
        return s;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    switch (dt) {
    case ML_F32:
        return fwd_launch<float, float>(out, lse, q, k, v, Sq, Sk, H, KV, (int)hd, ctx);
    case ML_F64:
        return fwd_launch<double, double>(out, lse, q, k, v, Sq, Sk, H, KV, (int)hd, ctx);
    default:
        return fwd_launch<uint16_t, float>(out, lse, q, k, v, Sq, Sk, H, KV, (int)hd, ctx);
    }
}

extern "C" ml_status ml_attention_backward_cuda(ml_dtype dt, void *dq, void *dk, void *dv,
                                                double *drow, const void *dout, const void *q,
                                                const void *k, const void *v, const void *out,
                                                const double *lse, int64_t S, int64_t H,
                                                int64_t KV, int64_t hd, void *scratch,
                                                const ml_kctx *ctx)
{
    ml_status s = check_args(dt, S, H, KV, hd);
    if (s != ML_OK || S == 0 || H == 0)
        return s;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    switch (dt) {
    case ML_F32:
        return bwd_launch<float, float>(dq, dk, dv, drow, dout, q, k, v, out, lse, S, H, KV,
                                        (int)hd, ctx);
    case ML_F64:
        return bwd_launch<double, double>(dq, dk, dv, drow, dout, q, k, v, out, lse, S, H, KV,
                                          (int)hd, ctx);
    default:
        return bwd_launch<uint16_t, float>(dq, dk, dv, drow, dout, q, k, v, out, lse, S, H, KV,
                                           (int)hd, ctx);
    }
}
