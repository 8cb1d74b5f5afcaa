/*
 * kernels/dispatch.cu - the stable counting sort of kernels/dispatch.h on
 * CUDA; results are bitwise the CPU's (integers only).
 *
 *   histogram  every thread counts its assignments into counts[e] with
 *              integer atomics (exact, order-free)
 *   sort       one warp: lane 0 turns the counts into offsets (with the
 *              capacity), then the warp walks the assignments 32 at a time
 *              in (t, j) order; __match_any_sync groups the lanes of one
 *              expert, the group's lowest lane reads and advances that
 *              expert's cursor, and each lane's rank in its group gives its
 *              place: order within an expert is (t, j) order (stable), the
 *              first cap are kept, the rest are dropped in (t, j) order.
 * Limits: the sort is one warp's sequential walk, n/32 steps (about 0.1 ms
 * for n = 64K assignments on an H100-class GPU); the cursors live in shared
 * memory for E <= 6144 and in counts (global memory, slower) beyond.
 *
 * ndropped is a host scalar on both backends: the call reads offsets[E]
 * back (synchronising the stream). find_bad and check_plan run on the
 * legacy default stream and synchronise; their result slot is __device__
 * module state (one host thread drives the device, as in topk.cu), and they
 * return ML_DISPATCH_EDEVICE when the device reported an error.
 */
#include "cuda_common.cuh"

extern "C" {
#include "dispatch.h"
}

#define SHARED_CURSORS 6144   /* 48 KiB of int64 cursors */

__device__ unsigned long long dispatch_first;   /* find_bad / check_plan: first bad position */
__device__ long long dispatch_offsets_bad;      /* check_plan: -1, or -2 - e */

__global__ void histogram_kernel(unsigned long long *counts, const int64_t *idx, int64_t n)
{
    ML_CUDA_FOR(a, n)
        atomicAdd(counts + idx[a], 1ull);
}

__global__ void sort_kernel(int64_t *offsets, int64_t *order, int64_t *counts, uint8_t *dropped,
                            const int64_t *idx, int64_t n, int64_t E, int64_t cap)
{
    extern __shared__ int64_t shared_cur[];
    int64_t *cur = E <= SHARED_CURSORS ? shared_cur : counts;
    const unsigned full = 0xffffffffu;
    int lane = threadIdx.x;
    if (lane == 0) {
        offsets[0] = 0;
        for (int64_t e = 0; e < E; e++) {
            int64_t kept = cap >= 0 && counts[e] > cap ? cap : counts[e];
            offsets[e + 1] = offsets[e] + kept;
        }
    }
    __syncwarp();
    for (int64_t e = lane; e < E; e += 32)
        cur[e] = 0;
    __syncwarp();
    int64_t nkept = offsets[E], nd = 0;
    unsigned lt = (1u << lane) - 1u;
    for (int64_t base = 0; base < n; base += 32) {
        int64_t a = base + lane;
        int active = a < n;
        long long e = active ? (long long)idx[a] : -1;
        unsigned peers = __match_any_sync(full, e);
        int leader = __ffs(peers) - 1;
        long long start = 0;
        if (active && lane == leader)
            start = cur[e];
        start = __shfl_sync(full, start, leader);
        int64_t pos = start + __popc(peers & lt);
        int keep = active && pos < offsets[e + 1] - offsets[e];
        int drop = active && !keep;
        unsigned dm = __ballot_sync(full, drop);
        if (keep) {
            order[offsets[e] + pos] = a;
            dropped[a] = 0;
        } else if (drop) {
            order[nkept + nd + __popc(dm & lt)] = a;
            dropped[a] = 1;
        }
        if (active && lane == leader)
            cur[e] = start + __popc(peers);
        nd += __popc(dm);
        __syncwarp();   /* the cursor writes are seen by the next step's leaders */
    }
    for (int64_t e = lane; e < E; e += 32)
        counts[e] = offsets[e + 1] - offsets[e];
}

extern "C" ml_status ml_dispatch_cuda(int64_t *offsets, int64_t *order, int64_t *counts,
                                      uint8_t *dropped, int64_t *ndropped, const int64_t *idx,
                                      int64_t n, int64_t E, int64_t cap, const ml_kctx *ctx)
{
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_status s = ml_cuda_status(cudaMemsetAsync(counts, 0, (size_t)E * sizeof(int64_t), st));
    if (s != ML_OK)
        return s;
    if (n > 0) {
        histogram_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            (unsigned long long *)counts, idx, n);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    size_t shm = E <= SHARED_CURSORS ? (size_t)E * sizeof(int64_t) : 0;
    sort_kernel<<<1, 32, shm, st>>>(offsets, order, counts, dropped, idx, n, E, cap);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    int64_t kept = 0;
    s = ml_cuda_status(cudaMemcpyAsync(&kept, offsets + E, sizeof kept, cudaMemcpyDeviceToHost, st));
    if (s == ML_OK)
        s = ml_cuda_status(cudaStreamSynchronize(st));
    if (s != ML_OK)
        return s;
    *ndropped = n - kept;
    return ML_OK;
}

/* ---- validation ------------------------------------------------------------ */

__global__ void find_bad_kernel(const int64_t *idx, int64_t n, int64_t E)
{
    ML_CUDA_FOR(a, n)
        if (idx[a] < 0 || idx[a] >= E)
            atomicMin(&dispatch_first, (unsigned long long)a);
}

/* Reset the result slots, run, read back. */
static int64_t first_bad(void)
{
    unsigned long long first = 0;
    if (ml_cuda_status(cudaMemcpyFromSymbol(&first, dispatch_first, sizeof first)) != ML_OK)
        return ML_DISPATCH_EDEVICE;
    return first == ~0ull ? -1 : (int64_t)first;
}

static ml_status reset_first(void)
{
    unsigned long long none = ~0ull;
    return ml_cuda_status(cudaMemcpyToSymbol(dispatch_first, &none, sizeof none));
}

extern "C" int64_t ml_dispatch_find_bad_cuda(const int64_t *idx, int64_t n, int64_t E)
{
    if (n <= 0)
        return -1;
    if (reset_first() != ML_OK)
        return ML_DISPATCH_EDEVICE;
    find_bad_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS>>>(idx, n, E);
    if (ml_cuda_launched() != ML_OK)
        return ML_DISPATCH_EDEVICE;
    return first_bad();
}

/* One thread: the offsets, in the CPU's order. */
__global__ void check_offsets_kernel(const int64_t *offsets, int64_t n, int64_t E)
{
    long long bad = -1;
    if (offsets[0] != 0) {
        bad = -2;
    } else {
        for (int64_t e = 0; e < E; e++)
            if (offsets[e + 1] < offsets[e] || offsets[e + 1] > n) {
                bad = -2 - (e + 1);
                break;
            }
    }
    dispatch_offsets_bad = bad;
}

/* Every kept position p: order[p] in [0, n) and routed to the expert whose
 * range holds p (the last e with offsets[e] <= p, by binary search). */
__global__ void check_positions_kernel(const int64_t *offsets, const int64_t *order,
                                       const int64_t *idx, int64_t n, int64_t E)
{
    if (dispatch_offsets_bad != -1)
        return;
    int64_t kept = offsets[E];
    ML_CUDA_FOR(p, kept) {
        int64_t lo = 0, hi = E;          /* offsets[lo] <= p < offsets[hi] */
        while (hi - lo > 1) {
            int64_t mid = (lo + hi) / 2;
            if (offsets[mid] <= p)
                lo = mid;
            else
                hi = mid;
        }
        int64_t a = order[p];
        /* strictly increasing within the expert's range: no assignment twice */
        if (a < 0 || a >= n || idx[a] != lo || (p > offsets[lo] && order[p - 1] >= a))
            atomicMin(&dispatch_first, (unsigned long long)p);
    }
}

extern "C" int64_t ml_dispatch_check_plan_cuda(const int64_t *offsets, const int64_t *order,
                                               const int64_t *idx, int64_t n, int64_t E)
{
    if (reset_first() != ML_OK)
        return ML_DISPATCH_EDEVICE;
    check_offsets_kernel<<<1, 1>>>(offsets, n, E);
    if (ml_cuda_launched() != ML_OK)
        return ML_DISPATCH_EDEVICE;
    if (n > 0) {
        check_positions_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS>>>(
            offsets, order, idx, n, E);
        if (ml_cuda_launched() != ML_OK)
            return ML_DISPATCH_EDEVICE;
    }
    long long bad = 0;
    if (ml_cuda_status(cudaMemcpyFromSymbol(&bad, dispatch_offsets_bad, sizeof bad)) != ML_OK)
        return ML_DISPATCH_EDEVICE;
    return bad != -1 ? (int64_t)bad : first_bad();
}
