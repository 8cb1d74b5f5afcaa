/*
 * host/runtime/backend_cuda.c - the CUDA backend table: a caching device allocator
 * that reports its reserved bytes to the ledger, cudaMemcpy in every
 * direction, and the CUDA kernels (kernels/<family>.cu).
 *
 * Not here: kernels, and the decision to allocate (host/runtime/tensor.c charges
 * the ledger; this file only supplies and recycles device memory).
 */
#include "ledger.h"
#include "backend.h"
#include "backend_cuda.h"
#include "../../kernels/cuda_util.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

/* ---- availability ------------------------------------------------------- */

static int avail = -1;            /* devices usable; -1: not asked yet */
static char unavail_reason[256];

/* The oldest compute capability the binary carries code for (Makefile
 * NVFLAGS: sm_80, sm_90, compute_90 PTX). On an older GPU every launch
 * would fail with "no kernel image", so the device is reported unavailable
 * with a reason instead. */
#define MIN_CC_MAJOR 8
#define MIN_CC_MINOR 0

static int capability_ok(void)
{
    int dev = 0;
    struct cudaDeviceProp p;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess)
        e = cudaGetDeviceProperties(&p, dev);
    if (e != cudaSuccess) {
        snprintf(unavail_reason, sizeof unavail_reason, "%s (%d): %s",
                 cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
        cudaGetLastError();
        return 0;
    }
    if (p.major < MIN_CC_MAJOR || (p.major == MIN_CC_MAJOR && p.minor < MIN_CC_MINOR)) {
        snprintf(unavail_reason, sizeof unavail_reason,
                 "%.120s has compute capability %d.%d; this build needs %d.%d or newer",
                 p.name, p.major, p.minor, MIN_CC_MAJOR, MIN_CC_MINOR);
        return 0;
    }
    return 1;
}

static int cuda_available(void)
{
    if (avail >= 0)
        return avail;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(unavail_reason, sizeof unavail_reason, "%s (%d): %s",
                 cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
        cudaGetLastError();   /* clear it: nothing else should see it */
        avail = 0;
    } else if (n <= 0) {
        snprintf(unavail_reason, sizeof unavail_reason, "no CUDA device found");
        avail = 0;
    } else {
        avail = capability_ok() ? n : 0;
    }
    return avail;
}

const char *ml_cuda_unavailable_reason(void)
{
    return unavail_reason;
}

const char *ml_cuda_last_error(void)
{
    return ml_cuda_error_string();   /* a cuBLAS load failure is noted there too */
}

/* ---- caching allocator -------------------------------------------------- */

#define SMALL_STEP  ((size_t)512)        /* ml_cuda_round_size's smallest step */
#define NBUCKETS    256                   /* hash heads of the free lists */

typedef struct bucket {
    size_t size;               /* rounded size of every block in the list */
    void **blocks;
    size_t n, cap;
    struct bucket *next;
} bucket;

typedef struct {               /* a live block: open-addressing slot */
    void *p;                   /* NULL: empty; TOMB: deleted */
    size_t size, requested;
} live_slot;

#define TOMB ((void *)1)

static struct {
    pthread_mutex_t mu;
    bucket *heads[NBUCKETS];
    live_slot *live;
    size_t live_cap, live_used;   /* used counts tombstones too */
    ml_cuda_alloc_stats st;
    ml_ledger *lg;                /* last ledger seen, for reports */
} A = {.mu = PTHREAD_MUTEX_INITIALIZER};

static void fatal(const char *file, int line, const char *why)
{
    fprintf(stderr, "moelua: %s:%d: %s\n", file, line, why);
    abort();
}

static size_t hash_size(size_t s) { return (s / SMALL_STEP * 2654435761u) % NBUCKETS; }

static size_t hash_ptr(const void *p, size_t cap)
{
    uint64_t x = (uint64_t)(uintptr_t)p;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)(x & (cap - 1));
}

static bucket *bucket_of(size_t size, int create)
{
    size_t h = hash_size(size);
    for (bucket *b = A.heads[h]; b; b = b->next)
        if (b->size == size)
            return b;
    if (!create)
        return NULL;
    bucket *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->size = size;
    b->next = A.heads[h];
    A.heads[h] = b;
    return b;
}

/* The cached block that serves a request of rounded size `size`: the
 * smallest non-empty free list of size in [size, size + size/8] (best fit,
 * at most 1/8 wasted; at most FIT_PROBES sizes are tried), or NULL. Before,
 * only the identical size was reused, so a slightly larger request always
 * went to cudaMalloc while a fitting block sat in the cache. Caller holds A.mu. */
#define FIT_PROBES 64

static bucket *best_fit(size_t size)
{
    size_t step = ml_cuda_round_size(size + 1) - size;   /* the rounding step at this size */
    size_t limit = size + size / 8;
    for (size_t k = 0, s = size; k < FIT_PROBES && s <= limit; k++, s += step) {
        bucket *b = bucket_of(s, 0);
        if (b && b->n)
            return b;
    }
    return NULL;
}

/* Rehash, dropping tombstones; the table doubles only when live blocks
 * fill a quarter of it, so alloc/free churn does not grow it. */
static int live_grow(void)
{
    size_t nlive = 0;
    for (size_t i = 0; i < A.live_cap; i++)
        nlive += A.live[i].p && A.live[i].p != TOMB;
    size_t cap = !A.live_cap ? 1024 : (nlive + 1) * 4 > A.live_cap ? A.live_cap * 2 : A.live_cap;
    live_slot *t = calloc(cap, sizeof *t);
    if (!t)
        return -1;
    for (size_t i = 0; i < A.live_cap; i++) {
        void *p = A.live[i].p;
        if (!p || p == TOMB)
            continue;
        size_t j = hash_ptr(p, cap);
        while (t[j].p)
            j = (j + 1) & (cap - 1);
        t[j] = A.live[i];
    }
    free(A.live);
    A.live = t;
    A.live_cap = cap;
    A.live_used = 0;
    for (size_t i = 0; i < cap; i++)
        A.live_used += t[i].p != NULL;
    return 0;
}

static int live_insert(void *p, size_t size, size_t requested)
{
    if ((A.live_used + 1) * 2 > A.live_cap && live_grow() != 0)
        return -1;
    size_t j = hash_ptr(p, A.live_cap);
    while (A.live[j].p && A.live[j].p != TOMB)
        j = (j + 1) & (A.live_cap - 1);
    if (!A.live[j].p)
        A.live_used++;
    A.live[j] = (live_slot){p, size, requested};
    return 0;
}

static live_slot *live_find(const void *p)
{
    if (!A.live_cap)
        return NULL;
    size_t j = hash_ptr(p, A.live_cap);
    while (A.live[j].p) {
        if (A.live[j].p == p)
            return &A.live[j];
        j = (j + 1) & (A.live_cap - 1);
    }
    return NULL;
}

static void report(ml_ledger *lg)
{
    if (lg)
        A.lg = lg;
    if (A.lg)
        ml_ledger_set_reserved(A.lg, A.st.reserved);
}

/* Caller holds A.mu. cudaFree synchronises the device, so no kernel still
 * uses a block when it goes back. */
static void release_cache(void)
{
    for (size_t h = 0; h < NBUCKETS; h++) {
        for (bucket *b = A.heads[h]; b; b = b->next) {
            for (size_t i = 0; i < b->n; i++) {
                cudaFree(b->blocks[i]);
                A.st.reserved -= b->size;
                A.st.cached -= b->size;
            }
            b->n = 0;
        }
    }
    cudaGetLastError();
    A.st.nflush++;
}

static void *cuda_alloc(size_t nbytes, ml_ledger *lg)
{
    size_t size = ml_cuda_round_size(nbytes);
    if (size == SIZE_MAX || !cuda_available())
        return NULL;
    pthread_mutex_lock(&A.mu);
    void *p = NULL;
    bucket *b = best_fit(size);
    if (b) {
        p = b->blocks[--b->n];
        size = b->size;   /* the block keeps its size: it goes back to its own list */
        A.st.cached -= size;
        A.st.nhits++;
    } else {
        /* Keep reserved within the device budget while the cache can give. */
        if (lg && lg->budget_total && A.st.cached && A.st.reserved + size > lg->budget_total)
            release_cache();
        cudaError_t e = cudaMalloc(&p, size);
        if (e != cudaSuccess) {
            cudaGetLastError();
            p = NULL;
            if (A.st.cached) {
                release_cache();
                e = cudaMalloc(&p, size);
                if (e != cudaSuccess) {
                    cudaGetLastError();
                    p = NULL;
                }
            }
            if (!p)
                ml_cuda_note_error(cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
        }
        if (p) {
            A.st.reserved += size;
            A.st.nmalloc++;
        }
    }
    if (p && live_insert(p, size, nbytes) != 0) {   /* host OOM: give it back */
        cudaFree(p);
        A.st.reserved -= size;
        p = NULL;
    }
    if (p) {
        A.st.allocated += size;
        A.st.requested += nbytes;
    } else {
        A.st.nfail++;
    }
    report(lg);
    pthread_mutex_unlock(&A.mu);
    return p;
}

/* What the reservation grows by (ml_memory.reserve_bytes): a new block's
 * rounded size, 0 when a cached block will serve the request. */
static size_t cuda_reserve_bytes(size_t nbytes)
{
    size_t size = ml_cuda_round_size(nbytes);
    if (size == SIZE_MAX)
        return size;
    pthread_mutex_lock(&A.mu);
    int hit = best_fit(size) != NULL;
    pthread_mutex_unlock(&A.mu);
    return hit ? 0 : size;
}

static void cuda_free(void *p, size_t nbytes, ml_ledger *lg)
{
    if (!p)
        return;
    pthread_mutex_lock(&A.mu);
    live_slot *s = live_find(p);
    if (!s)
        fatal(__FILE__, __LINE__, "cuda free of a block this allocator does not own");
    if (s->requested != nbytes)
        fatal(__FILE__, __LINE__, "cuda free with a size other than the allocated one");
    size_t size = s->size;
    s->p = TOMB;
    A.st.allocated -= size;
    A.st.requested -= nbytes;
    bucket *b = bucket_of(size, 1);
    if (b && b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 8;
        void **t = realloc(b->blocks, cap * sizeof *t);
        if (t) {
            b->blocks = t;
            b->cap = cap;
        }
    }
    if (b && b->n < b->cap) {
        b->blocks[b->n++] = p;
        A.st.cached += size;
    } else {                      /* no host memory for the list: return it */
        cudaFree(p);
        cudaGetLastError();
        A.st.reserved -= size;
    }
    report(lg);
    pthread_mutex_unlock(&A.mu);
}

void ml_cuda_alloc_get_stats(ml_cuda_alloc_stats *s)
{
    pthread_mutex_lock(&A.mu);
    *s = A.st;
    pthread_mutex_unlock(&A.mu);
}

void ml_cuda_empty_cache(ml_ledger *lg)
{
    pthread_mutex_lock(&A.mu);
    if (A.st.cached)
        release_cache();
    report(lg);
    pthread_mutex_unlock(&A.mu);
}

int ml_cuda_mem_info(size_t *free_bytes, size_t *total_bytes)
{
    *free_bytes = *total_bytes = 0;
    if (!cuda_available())
        return -1;
    if (cudaMemGetInfo(free_bytes, total_bytes) != cudaSuccess) {
        cudaGetLastError();
        *free_bytes = *total_bytes = 0;
        return -1;
    }
    return 0;
}

void ml_cuda_shutdown(void)
{
    if (avail <= 0)
        return;
    ml_cublas_release();
    pthread_mutex_lock(&A.mu);
    if (A.st.cached)
        release_cache();
    for (size_t h = 0; h < NBUCKETS; h++) {
        bucket *b = A.heads[h];
        while (b) {
            bucket *next = b->next;
            free(b->blocks);
            free(b);
            b = next;
        }
        A.heads[h] = NULL;
    }
    A.lg = NULL;   /* the ledger dies with the host */
    pthread_mutex_unlock(&A.mu);
    /* Live blocks would be a leak the ledger check already reported; the
     * device reset returns them with everything else. */
    cudaDeviceReset();
}

/* ---- copies, streams, events ------------------------------------------- */

/* A failed CUDA call: remember its text for ML_EDEVICE messages, clear it. */
static ml_status device_error(cudaError_t e)
{
    ml_cuda_note_error(cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
    cudaGetLastError();
    return ML_EDEVICE;
}

static ml_status cuda_memcpy(void *dst, const void *src, size_t n, ml_copy_dir dir, void *stream)
{
    static const enum cudaMemcpyKind kinds[] = {
        [ML_COPY_H2H] = cudaMemcpyHostToHost, [ML_COPY_H2D] = cudaMemcpyHostToDevice,
        [ML_COPY_D2H] = cudaMemcpyDeviceToHost, [ML_COPY_D2D] = cudaMemcpyDeviceToDevice,
    };
    if (n == 0)
        return ML_OK;
    if (dir == ML_COPY_H2H) {
        memcpy(dst, src, n);
        return ML_OK;
    }
    cudaError_t e = stream ? cudaMemcpyAsync(dst, src, n, kinds[dir], (cudaStream_t)stream)
                           : cudaMemcpy(dst, src, n, kinds[dir]);
    return e == cudaSuccess ? ML_OK : device_error(e);
}

/* Pinned host memory: the copy engine reads and writes it without a
 * staging copy, so copies on a stream are truly asynchronous. */
static void *cuda_host_alloc(size_t nbytes)
{
    void *p = NULL;
    if (cudaHostAlloc(&p, nbytes, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_host_free(void *p, size_t nbytes)
{
    (void)nbytes;
    if (p)
        cudaFreeHost(p);
    cudaGetLastError();
}

static ml_status cuda_stream_new(void **stream)
{
    cudaStream_t s = NULL;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    *stream = s;
    return e == cudaSuccess ? ML_OK : device_error(e);
}

static void cuda_stream_free(void *stream)
{
    if (stream)
        cudaStreamDestroy((cudaStream_t)stream);
    cudaGetLastError();
}

static ml_status cuda_event_new(void **event)
{
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    *event = ev;
    return e == cudaSuccess ? ML_OK : device_error(e);
}

static void cuda_event_free(void *event)
{
    if (event)
        cudaEventDestroy((cudaEvent_t)event);
    cudaGetLastError();
}

static ml_status cuda_event_record(void *event, void *stream)
{
    cudaError_t e = cudaEventRecord((cudaEvent_t)event, (cudaStream_t)stream);
    return e == cudaSuccess ? ML_OK : device_error(e);
}

static ml_status cuda_stream_wait(void *stream, void *event)
{
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, (cudaEvent_t)event, 0);
    return e == cudaSuccess ? ML_OK : device_error(e);
}

static ml_status cuda_synchronize(void *stream)
{
    if (!cuda_available())
        return ML_OK;
    cudaError_t e = stream ? cudaStreamSynchronize((cudaStream_t)stream) : cudaDeviceSynchronize();
    return e == cudaSuccess ? ML_OK : device_error(e);
}

static const ml_memory cuda_memory = {
    .name = "cuda",
    .available = cuda_available,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .reserve_bytes = cuda_reserve_bytes,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .memcpy = cuda_memcpy,
    .stream_new = cuda_stream_new,
    .stream_free = cuda_stream_free,
    .event_new = cuda_event_new,
    .event_free = cuda_event_free,
    .event_record = cuda_event_record,
    .stream_wait = cuda_stream_wait,
    .synchronize = cuda_synchronize,
};

/* ---- kernels ------------------------------------------------------------ */

static const ml_kernels cuda_kernels = {
    ML_CUDA_SIZING,
    .fill = ml_fill_cuda,
    .arange = ml_arange_cuda,
    .binary = ml_binary_cuda,
    .binary_scalar = ml_binary_scalar_cuda,
    .unary = ml_unary_cuda,
    .copy = ml_copy_cuda,
    .reduce = ml_reduce_cuda,
    .reduce_all = ml_reduce_all_cuda,
    .cumsum = ml_cumsum_cuda,
    .softmax = ml_softmax_cuda,
    .topk = ml_topk_cuda,
    .index_select = ml_index_select_cuda,
    .gather = ml_gather_cuda,
    .scatter_add = ml_scatter_add_cuda,
    .bincount = ml_bincount_cuda,
    .matmul = ml_matmul_cuda,
    .rand = ml_rand_cuda,
    .randn = ml_randn_cuda,
    .router_forward = ml_router_forward_cuda,
    .router_backward = ml_router_backward_cuda,
    .router_update_bias = ml_router_update_bias_cuda,
    .dispatch = ml_dispatch_cuda,
    .dispatch_pack = ml_dispatch_pack_cuda,
    .dispatch_unpack = ml_dispatch_unpack_cuda,
    .dispatch_find_bad = ml_dispatch_find_bad_cuda,
    .dispatch_check_plan = ml_dispatch_check_plan_cuda,
    .experts_forward = ml_experts_forward_cuda,
    .experts_backward = ml_experts_backward_cuda,
    .attention_forward = ml_attention_forward_cuda,
    .attention_backward = ml_attention_backward_cuda,
    .adamw = ml_adamw_cuda,
    .lazy_adamw = ml_lazy_adamw_cuda,
    .sgd = ml_sgd_cuda,
    .sumsq = ml_sumsq_cuda,
    .slice_norms = ml_slice_norms_cuda,
    .scale_slices = ml_scale_slices_cuda,
    .rmsnorm_forward = ml_rmsnorm_forward_cuda,
    .rmsnorm_backward = ml_rmsnorm_backward_cuda,
    .rope_forward = ml_rope_forward_cuda,
    .rope_backward = ml_rope_backward_cuda,
    .embedding_forward = ml_embedding_forward_cuda,
    .embedding_backward = ml_embedding_backward_cuda,
    .ce_forward = ml_ce_forward_cuda,
    .ce_backward = ml_ce_backward_cuda,
};

const ml_backend ml_backend_cuda = {"cuda", &cuda_memory, &cuda_kernels};
