/*
 * kernels/optim.cu - AdamW, lazy AdamW, SGD, squared norms and scaling on
 * flat CUDA buffers (kernels/optim.h), bit-identical to kernels/optim.c:
 *   - updates: one thread per element, templated on float / double so every
 *     operation rounds in the buffers' dtype, in the CPU's operation order;
 *     the per-step scalars are computed on the host (ml_adamw_coef_of, the
 *     CPU's function) and rounded to the dtype there, as the CPU does. Built
 *     with --fmad=false and IEEE division and sqrt (nvcc's defaults), so
 *     nothing is contracted or approximated;
 *   - lazy AdamW and scale_slices launch once per expert (slice), with that
 *     expert's scalars and state pointers by value: the mask, counts,
 *     pointer tables and factors are host memory (kernels/optim.h);
 *   - norms: one thread per ML_OPTIM_BLOCK block summing its squares in f64
 *     sequentially, one CUDA block per super block of SUPER blocks whose
 *     partials thread 0 adds in block order, then one thread per slice adds
 *     the super partials in order: kernels/reduce.c's order exactly.
 * The super partials (and sumsq's total) live in the caller's scratch
 * (ml_sumsq_scratch_bytes_cuda, ml_slice_norms_scratch_bytes_cuda, in
 * optim.c): no module-level state, so calls on concurrent streams do not
 * collide, and no allocation outside the ledger.
 *
 * Never polls ctx->interrupt: an optimizer step is not interruptible.
 */
#include "cuda_common.cuh"

extern "C" {
#include "optim.h"
}

#define SUPER ML_OPTIM_SUPER /* must equal kernels/reduce.c's SUPER */
#define SUPER_ELEMS ((int64_t)SUPER * ML_OPTIM_BLOCK)
#define MAX_GRID_Y 65535     /* CUDA's limit on gridDim.y */

/* A failed CUDA runtime call (not a launch): record it and clear it, so
 * the next launch check does not report it again. */
static ml_status call_failed(cudaError_t e)
{
    cudaGetLastError();
    return ml_cuda_status(e);
}

__device__ __forceinline__ float dev_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double dev_sqrt(double x) { return sqrt(x); }

/* ---- AdamW ---------------------------------------------------------------- */

/* The step's scalars in the buffers' dtype (the CPU's adam_f32 / adam_f64). */
template <typename T>
struct adam_k {
    T decay, w, w1, b2, c2, bs, eps, ns;
    int low;
};

template <typename T>
static adam_k<T> adam_k_of(const ml_adamw_coef &c)
{
    adam_k<T> k;
    k.decay = (T)c.decay;
    k.w = (T)c.w;
    k.w1 = (T)1 - k.w;
    k.b2 = (T)c.b2;
    k.c2 = (T)c.c2;
    k.bs = (T)c.bc2_sqrt;
    k.eps = (T)c.eps;
    k.ns = (T)c.neg_step;
    k.low = c.low;
    return k;
}

template <typename T>
__global__ void adam_kernel(T *p, T *m, T *v, const T *g, int64_t n, adam_k<T> c)
{
    ML_CUDA_FOR(i, n) {
        T pi = p[i] * c.decay, gi = g[i], mi = m[i];
        mi = c.low ? mi + c.w * (gi - mi) : gi - (gi - mi) * c.w1;
        T vi = v[i] * c.b2;
        vi = vi + c.c2 * gi * gi;
        T den = dev_sqrt(vi) / c.bs + c.eps;
        p[i] = pi + c.ns * mi / den;
        m[i] = mi;
        v[i] = vi;
    }
}

template <typename T>
static ml_status adam_launch(void *p, void *m, void *v, const void *g, int64_t n,
                             const ml_adamw_coef &c, cudaStream_t st)
{
    if (n <= 0)
        return ML_OK;
    adam_kernel<T><<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (T *)p, (T *)m, (T *)v, (const T *)g, n, adam_k_of<T>(c));
    return ml_cuda_launched();
}

/* dt is f32 or f64 (the callers check). */
static ml_status adam_run(ml_dtype dt, void *p, void *m, void *v, const void *g, int64_t n,
                          const ml_adamw_coef &c, cudaStream_t st)
{
    return dt == ML_F32 ? adam_launch<float>(p, m, v, g, n, c, st)
                        : adam_launch<double>(p, m, v, g, n, c, st);
}

extern "C" ml_status ml_adamw_cuda(ml_dtype dt, void *p, void *m, void *v, const void *g,
                                   int64_t n, const ml_adamw_hp *hp, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    return adam_run(dt, p, m, v, g, n, ml_adamw_coef_of(hp, hp->step), ml_cuda_stream(ctx));
}

/* ---- lazy AdamW: per-expert states ------------------------------------------ */

/* One launch per active expert over its slice e*S .. (e+1)*S, with its own
 * count and states; the counts advance for every active expert, as on the
 * CPU, and the first failed launch is returned. */
extern "C" ml_status ml_lazy_adamw_cuda(ml_dtype dt, void *p, void *const *m, void *const *v,
                                        int64_t *steps, const void *g, const uint8_t *active,
                                        int64_t n, int64_t E, const ml_adamw_hp *hp,
                                        int64_t *nactive, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E < 1 || n % E != 0 || !ml_lazy_states_present(m, v, active, E))
        return ML_EUNSUPPORTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t S = n / E;
    size_t bytes = (size_t)S * ml_dtype_size(dt);
    ml_status s = ML_OK;
    for (int64_t e = 0; e < E && s == ML_OK; e++) {
        if (!active[e])
            continue;
        size_t at = (size_t)e * bytes;
        s = adam_run(dt, (char *)p + at, m[e], v[e], (const char *)g + at, S,
                     ml_adamw_coef_of(hp, steps[e] + 1), st);
    }
    int64_t k = 0;
    for (int64_t e = 0; e < E; e++) {
        if (active[e]) {
            steps[e]++;
            k++;
        }
    }
    if (nactive)
        *nactive = k;
    return s;
}

/* ---- SGD ------------------------------------------------------------------ */

/* The step's scalars in the buffers' dtype (the CPU's sgd_tile). */
template <typename T>
struct sgd_k {
    T lam, mom, damp1, nlr;
    int wd, first, nest;
};

template <typename T>
__global__ void sgd_kernel(T *p, T *b, const T *g, int64_t n, sgd_k<T> c)
{
    ML_CUDA_FOR(i, n) {
        T d = g[i];
        if (c.wd)
            d = d + c.lam * p[i];
        if (b) {
            T bi = c.first ? d : b[i] * c.mom + c.damp1 * d;
            b[i] = bi;
            d = c.nest ? d + c.mom * bi : bi;
        }
        p[i] = p[i] + c.nlr * d;
    }
}

template <typename T>
static ml_status sgd_launch(void *p, void *buf, const void *g, int64_t n, const ml_sgd_hp *h,
                            cudaStream_t st)
{
    sgd_k<T> c;
    c.lam = (T)h->weight_decay;
    c.mom = (T)h->momentum;
    c.damp1 = (T)(1.0 - h->dampening);
    c.nlr = (T)-h->lr;
    c.wd = h->weight_decay != 0;
    c.first = h->first;
    c.nest = h->nesterov;
    sgd_kernel<T><<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (T *)p, (T *)buf, (const T *)g, n, c);
    return ml_cuda_launched();
}

extern "C" ml_status ml_sgd_cuda(ml_dtype dt, void *p, void *buf, const void *g, int64_t n,
                                 const ml_sgd_hp *hp, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (n <= 0)
        return ML_OK;
    void *b = hp->momentum != 0 ? buf : NULL;   /* as on the CPU */
    cudaStream_t st = ml_cuda_stream(ctx);
    return dt == ML_F32 ? sgd_launch<float>(p, b, g, n, hp, st)
                        : sgd_launch<double>(p, b, g, n, hp, st);
}

/* ---- norms ------------------------------------------------------------------ */

/* Block (x, y) reduces super block x of slice e0 + y (slices of S
 * elements) into part[(e0 + y) * nsup + x]: kernels/reduce.c's all_tile
 * (square) for each of its blocks, then their sum in block order. */
__global__ void __launch_bounds__(SUPER)
sumsq_super_kernel(ml_dtype dt, double *part, const void *x, int64_t S, int64_t e0,
                   int64_t nsup)
{
    __shared__ double blk[SUPER];
    int64_t e = e0 + blockIdx.y;
    int64_t sbase = (int64_t)blockIdx.x * SUPER_ELEMS;      /* inside the slice */
    int64_t s = sbase + (int64_t)threadIdx.x * ML_OPTIM_BLOCK;
    if (s < S) {
        int64_t end = s + ML_OPTIM_BLOCK < S ? s + ML_OPTIM_BLOCK : S;
        double acc = 0;
        for (int64_t i = s; i < end; i++) {
            double v = ml_load(dt, x, (size_t)(e * S + i));
            acc += v * v;
        }
        blk[threadIdx.x] = acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t nblocks = (S - sbase + ML_OPTIM_BLOCK - 1) / ML_OPTIM_BLOCK;
        if (nblocks > SUPER)
            nblocks = SUPER;
        double sacc = 0;
        for (int64_t b = 0; b < nblocks; b++)
            sacc += blk[b];
        part[e * nsup + blockIdx.x] = sacc;
    }
}

/* dst[e] = the sum of slice e's super partials in order (root: its square
 * root), starting from 0 as the CPU does. */
__global__ void sumsq_fold_kernel(double *dst, const double *part, int64_t nsup, int64_t E,
                                  int root)
{
    ML_CUDA_FOR(e, E) {
        double acc = 0;
        for (int64_t s = 0; s < nsup; s++)
            acc += part[e * nsup + s];
        dst[e] = root ? sqrt(acc) : acc;
    }
}

/* dst[e] (device memory) = the sum of squares of slice e of x, E slices of
 * S elements (root: the L2 norm), with the super partials in part ([E,
 * nsup] doubles). dt is f32 or f64 (the callers check). */
static ml_status sumsq_slices(ml_dtype dt, double *dst, const void *x, int64_t S, int64_t E,
                              int root, double *part, cudaStream_t st)
{
    int64_t nsup = (S + SUPER_ELEMS - 1) / SUPER_ELEMS;
    if (nsup > INT32_MAX)
        return ML_EUNSUPPORTED;
    ml_status s = ML_OK;
    for (int64_t e0 = 0; nsup > 0 && e0 < E && s == ML_OK; e0 += MAX_GRID_Y) {
        int64_t ne = E - e0 < MAX_GRID_Y ? E - e0 : MAX_GRID_Y;
        sumsq_super_kernel<<<dim3((unsigned)nsup, (unsigned)ne), SUPER, 0, st>>>(dt, part, x, S,
                                                                                e0, nsup);
        s = ml_cuda_launched();
    }
    if (s == ML_OK) {
        sumsq_fold_kernel<<<ml_cuda_blocks(E, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            dst, part, nsup, E, root);
        s = ml_cuda_launched();
    }
    return s;
}

/* The total lands in the scratch's first double, comes back on the
 * stream, and the call waits for it: out is host memory. */
extern "C" ml_status ml_sumsq_cuda(ml_dtype dt, double *out, const void *x, int64_t n,
                                   void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    double *total = (double *)scratch;
    ml_status s = sumsq_slices(dt, total, x, n, 1, 0, total + 1, st);
    cudaError_t ce;
    if (s == ML_OK && (ce = cudaMemcpyAsync(out, total, sizeof(double), cudaMemcpyDeviceToHost,
                                            st)) != cudaSuccess)
        s = call_failed(ce);
    if (s == ML_OK && (ce = cudaStreamSynchronize(st)) != cudaSuccess)
        s = call_failed(ce);
    return s;
}

extern "C" ml_status ml_slice_norms_cuda(ml_dtype dt, double *norms, const void *x, int64_t n,
                                         int64_t E, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E < 1 || n % E != 0)
        return ML_EUNSUPPORTED;
    return sumsq_slices(dt, norms, x, n / E, E, 1, (double *)scratch, ml_cuda_stream(ctx));
}

/* ---- scaling ------------------------------------------------------------------ */

template <typename T>
__global__ void scale_kernel(T *x, int64_t n, T f)
{
    ML_CUDA_FOR(i, n) x[i] = x[i] * f;
}

template <typename T>
static ml_status scale_launch(void *x, int64_t n, double f, cudaStream_t st)
{
    scale_kernel<T><<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (T *)x, n, (T)f);
    return ml_cuda_launched();
}

/* One launch per slice, its factor rounded to the dtype on the host. */
extern "C" ml_status ml_scale_slices_cuda(ml_dtype dt, void *x, const double *factors, int64_t n,
                                          int64_t E, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E < 1 || n % E != 0)
        return ML_EUNSUPPORTED;
    if (n == 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t S = n / E;
    size_t bytes = (size_t)S * ml_dtype_size(dt);
    ml_status s = ML_OK;
    for (int64_t e = 0; e < E && s == ML_OK; e++) {
        char *xe = (char *)x + (size_t)e * bytes;
        s = dt == ML_F32 ? scale_launch<float>(xe, S, factors[e], st)
                         : scale_launch<double>(xe, S, factors[e], st);
    }
    return s;
}
