/*
 * kernels/dispatch.cu - the stable counting sort of kernels/dispatch.h on
 * CUDA, and pack / unpack of a plan's rows; results are bitwise the CPU's
 * (integers; unpack adds in the CPU's order, built with --fmad=false).
 *
 * The n assignments are cut into B tiles of `tile` consecutive ids, one
 * warp (one CUDA block) per tile, so the sort spreads over the GPU instead
 * of one warp walking all n:
 *   histogram  hist[b, e] = assignments of tile b routed to e (integer
 *              atomics: exact, order-free)
 *   scan       per expert, over tiles in order: hist[b, e] becomes the
 *              rank within expert e of the tile's first e-assignment, and
 *              counts[e] the kept total (capacity applied); each tile's
 *              drops are counted from the same ranks. Then one thread turns
 *              counts into offsets (expert order) and the drop counts into
 *              each tile's first slot in the dropped region (tile order).
 *   scatter    each warp walks its tile 32 at a time in (t, j) order;
 *              __match_any_sync groups the lanes of one expert, the group's
 *              lowest lane reads and advances the tile's cursor for that
 *              expert, and each lane's rank in its group gives its place.
 * So the place of an assignment within its expert is its rank in (t, j)
 * order (stable), the first cap are kept, and the dropped ones follow in
 * (t, j) order: the CPU's order exactly. The per-(tile, expert) ranks are
 * the caller's scratch (ml_dispatch_scratch_bytes_cuda: at most 2^22
 * entries, 32 MiB; the tile, ml_dispatch_cuda_tile, grows with n·E to stay
 * within it).
 *
 * ndropped is a host scalar on both backends: the call reads offsets[E]
 * back (synchronising the stream). find_bad and check_plan run on ctx's
 * stream too, keep their result slots in the caller's scratch,
 * synchronise that stream, and return ML_DISPATCH_EDEVICE when the device
 * reported an error.
 *
 * Pack: one thread per element, moved as an unsigned integer of the
 * element's size. Unpack: the inverse map pos[a] = p of the kept
 * positions (the caller's scratch), each output
 * row's div positions sorted ascending by one thread, then one thread per
 * output element adds its rows in that order: the CPU's sum, no atomics.
 * bf16 unpack sums in f32 in that order and rounds once: bitwise the f32
 * sum of the widened values, rounded.
 */
#include "cuda_common.cuh"
#include "cuda_float.cuh"

extern "C" {
#include "dispatch.h"
}

__global__ void histogram_kernel(unsigned long long *hist, const int64_t *idx, int64_t n,
                                 int64_t E, int64_t tile)
{
    ML_CUDA_FOR(a, n)
        atomicAdd(hist + (a / tile) * E + idx[a], 1ull);
}

/* One thread per expert e, tiles in order: rank[b, e] (the tile's count on
 * entry) becomes the number of e-assignments in tiles before b; counts[e]
 * the kept total; drops[b] gains the tile's e-assignments past the
 * expert's capacity (caps[e], or cap when caps is NULL). */
__global__ void expert_scan_kernel(int64_t *counts, int64_t *rank, unsigned long long *drops,
                                   int64_t B, int64_t E, int64_t cap0, const int64_t *caps)
{
    ML_CUDA_FOR(e, E) {
        int64_t cap = caps ? caps[e] : cap0;
        int64_t run = 0;
        for (int64_t b = 0; b < B; b++) {
            int64_t c = rank[b * E + e];
            rank[b * E + e] = run;
            if (cap >= 0) {
                int64_t before = run < cap ? run : cap, after = run + c < cap ? run + c : cap;
                int64_t d = c - (after - before);
                if (d)
                    atomicAdd(drops + b, (unsigned long long)d);
            }
            run += c;
        }
        counts[e] = cap >= 0 && run > cap ? cap : run;
    }
}

/* One thread, O(E + B): offsets from the kept counts in expert order; each
 * tile's drop count becomes its first slot in order[] (the dropped region
 * starts at offsets[E], tiles in order). */
__global__ void offsets_kernel(int64_t *offsets, int64_t *drop_base, const int64_t *counts,
                               int64_t B, int64_t E)
{
    offsets[0] = 0;
    for (int64_t e = 0; e < E; e++)
        offsets[e + 1] = offsets[e] + counts[e];
    int64_t run = offsets[E];
    for (int64_t b = 0; b < B; b++) {
        int64_t d = drop_base[b];
        drop_base[b] = run;
        run += d;
    }
}

/* Block b (one warp) places the assignments of tile b; rank[b, .] are its
 * cursors, touched by this warp only. */
__global__ void scatter_kernel(int64_t *order, uint8_t *dropped, int64_t *rank,
                               const int64_t *offsets, const int64_t *drop_base,
                               const int64_t *idx, int64_t n, int64_t E, int64_t tile)
{
    const unsigned full = 0xffffffffu;
    int lane = threadIdx.x;
    unsigned lt = (1u << lane) - 1u;
    int64_t b = blockIdx.x;
    int64_t *cur = rank + b * E;
    int64_t nd = drop_base[b];
    int64_t end = (b + 1) * tile < n ? (b + 1) * tile : n;
    for (int64_t base = b * tile; base < end; base += 32) {
        int64_t a = base + lane;
        int active = a < end;
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
            order[nd + __popc(dm & lt)] = a;
            dropped[a] = 1;
        }
        if (active && lane == leader)
            cur[e] = start + __popc(peers);
        nd += __popc(dm);
        __syncwarp();   /* the cursor writes are seen by the next step's leaders */
    }
}

/* The four kernels on st; rank is [B, E] then drops [B], zeroed here. */
static ml_status sort(int64_t *offsets, int64_t *order, int64_t *counts, uint8_t *dropped,
                      const int64_t *idx, int64_t n, int64_t E, int64_t cap, const int64_t *caps,
                      int64_t tile, int64_t B, int64_t *rank, cudaStream_t st)
{
    /* n = 0: no tiles, and the scratch (0 bytes) may be NULL */
    int64_t *drops = B > 0 ? rank + B * E : NULL;
    ml_status s = B > 0 ? ml_cuda_status(cudaMemsetAsync(rank, 0, (size_t)(B * E + B) * sizeof *rank, st))
                        : ML_OK;
    if (s != ML_OK)
        return s;
    if (n > 0) {
        histogram_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            (unsigned long long *)rank, idx, n, E, tile);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    if (E > 0) {
        expert_scan_kernel<<<ml_cuda_blocks(E, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            counts, rank, (unsigned long long *)drops, B, E, cap, caps);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    offsets_kernel<<<1, 1, 0, st>>>(offsets, drops, counts, B, E);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    if (B > 0) {
        scatter_kernel<<<(unsigned)B, 32, 0, st>>>(order, dropped, rank, offsets, drops, idx, n, E,
                                                   tile);
        s = ml_cuda_launched();
    }
    return s;
}

extern "C" ml_status ml_dispatch_cuda(int64_t *offsets, int64_t *order, int64_t *counts,
                                      uint8_t *dropped, int64_t *ndropped, const int64_t *idx,
                                      int64_t n, int64_t E, int64_t cap, const int64_t *caps,
                                      void *scratch, const ml_kctx *ctx)
{
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t tile = ml_dispatch_cuda_tile(n, E);
    int64_t B = (n + tile - 1) / tile;
    ml_status s = sort(offsets, order, counts, dropped, idx, n, E, cap, caps, tile, B,
                       (int64_t *)scratch, st);
    if (s != ML_OK)
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

/* ---- pack and unpack ------------------------------------------------------ */

template <typename U>
__global__ void pack_kernel(U *out, const U *in, const int64_t *order, int64_t n, int64_t cols,
                            int64_t div)
{
    ML_CUDA_FOR(i, n * cols) {
        int64_t p = i / cols, c = i % cols;
        out[i] = in[(order[p] / div) * cols + c];
    }
}

template <typename U>
static ml_status pack(void *out, const void *in, const int64_t *order, int64_t n, int64_t cols,
                      int64_t div, cudaStream_t st)
{
    pack_kernel<U><<<ml_cuda_blocks(n * cols, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (U *)out, (const U *)in, order, n, cols, div);
    return ml_cuda_launched();
}

extern "C" ml_status ml_dispatch_pack_cuda(ml_dtype dt, void *out, const void *in,
                                           const int64_t *order, int64_t n, int64_t cols,
                                           int64_t div, const ml_kctx *ctx)
{
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    if (n == 0 || cols == 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (ml_dtype_size(dt)) {
    case 1: return pack<uint8_t>(out, in, order, n, cols, div, st);
    case 2: return pack<uint16_t>(out, in, order, n, cols, div, st);
    case 4: return pack<uint32_t>(out, in, order, n, cols, div, st);
    case 8: return pack<uint64_t>(out, in, order, n, cols, div, st);
    default: return ML_EUNSUPPORTED;
    }
}

__global__ void inverse_kernel(int64_t *pos, const int64_t *order, int64_t n)
{
    ML_CUDA_FOR(p, n)
        pos[order[p]] = p;
}

/* One thread per output row: its div positions ascending (insertion sort;
 * div is k, a handful). */
__global__ void sort_rows_kernel(int64_t *pos, int64_t rows, int64_t div)
{
    ML_CUDA_FOR(r, rows) {
        int64_t *q = pos + r * div;
        for (int64_t i = 1; i < div; i++) {
            int64_t v = q[i], j = i;
            for (; j > 0 && q[j - 1] > v; j--)
                q[j] = q[j - 1];
            q[j] = v;
        }
    }
}

/* out[r, c] += in[p, c] over row r's positions, ascending, summed in
 * ml_float<F>::acc (f32 for bf16) and stored once. */
template <typename F>
__global__ void unpack_kernel(F *out, const F *in, const int64_t *pos, int64_t n, int64_t cols,
                              int64_t div, int64_t rows)
{
    typedef ml_float<F> L;
    ML_CUDA_FOR(i, rows * cols) {
        int64_t r = i / cols, c = i % cols;
        typename L::acc v = L::load(out[i]);
        for (int64_t j = 0; j < div; j++) {
            int64_t p = pos[r * div + j];
            if (p >= n)
                break;
            v += L::load(in[p * cols + c]);
        }
        out[i] = L::store(v);
    }
}

template <typename F>
static ml_status unpack(void *out, const void *in, const int64_t *order, int64_t n, int64_t cols,
                        int64_t div, int64_t rows, int64_t *pos, cudaStream_t st)
{
    /* 0x7f bytes: an assignment not kept gets a position above every p < n,
     * so it sorts last and ends its row's walk */
    ml_status s = ml_cuda_status(cudaMemsetAsync(pos, 0x7f, (size_t)(rows * div) * sizeof *pos, st));
    if (s != ML_OK)
        return s;
    inverse_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(pos, order, n);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    if (div > 1) {
        sort_rows_kernel<<<ml_cuda_blocks(rows, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            pos, rows, div);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    unpack_kernel<F><<<ml_cuda_blocks(rows * cols, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (F *)out, (const F *)in, pos, n, cols, div, rows);
    return ml_cuda_launched();
}

extern "C" ml_status ml_dispatch_unpack_cuda(ml_dtype dt, void *out, const void *in,
                                             const int64_t *order, int64_t n, int64_t cols,
                                             int64_t div, int64_t rows_out, void *scratch,
                                             const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    if (n == 0 || cols == 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t *pos = (int64_t *)scratch;
    switch (dt) {
    case ML_F32: return unpack<float>(out, in, order, n, cols, div, rows_out, pos, st);
    case ML_F64: return unpack<double>(out, in, order, n, cols, div, rows_out, pos, st);
    default: return unpack<ml_bf16>(out, in, order, n, cols, div, rows_out, pos, st);
    }
}

/* ---- validation ------------------------------------------------------------ */

/* The result slots of one validation call, in the caller's scratch. */
typedef struct {
    unsigned long long first;   /* first bad position, ~0: none */
    long long offsets_bad;      /* check_plan: -1, or -2 - e */
} check_slots;
static_assert(sizeof(check_slots) == 2 * sizeof(int64_t),
              "ml_dispatch_scratch_bytes_cuda(n, E, 1) sizes the slots");

__global__ void find_bad_kernel(check_slots *r, const int64_t *idx, int64_t n, int64_t E)
{
    ML_CUDA_FOR(a, n)
        if (idx[a] < 0 || idx[a] >= E)
            atomicMin(&r->first, (unsigned long long)a);
}

/* One thread: the offsets, in the CPU's order. */
__global__ void check_offsets_kernel(check_slots *r, const int64_t *offsets, int64_t n, int64_t E)
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
    r->offsets_bad = bad;
}

/* Every kept position p: order[p] in [0, n) and routed to the expert whose
 * range holds p (the last e with offsets[e] <= p, by binary search). */
__global__ void check_positions_kernel(check_slots *r, const int64_t *offsets, const int64_t *order,
                                       const int64_t *idx, int64_t n, int64_t E)
{
    if (r->offsets_bad != -1)
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
            atomicMin(&r->first, (unsigned long long)p);
    }
}

/* Run find_bad (offsets NULL) or check_plan on st and read the verdict
 * back (synchronising st). */
static ml_status run_check(check_slots *r, check_slots *out, const int64_t *offsets,
                           const int64_t *order, const int64_t *idx, int64_t n, int64_t E,
                           cudaStream_t st)
{
    ml_status s = ml_cuda_status(cudaMemsetAsync(&r->first, 0xff, sizeof r->first, st));
    if (s != ML_OK)
        return s;
    if (!offsets) {
        find_bad_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(r, idx, n, E);
        s = ml_cuda_launched();
    } else {
        check_offsets_kernel<<<1, 1, 0, st>>>(r, offsets, n, E);
        s = ml_cuda_launched();
        if (s == ML_OK && n > 0) {
            check_positions_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
                r, offsets, order, idx, n, E);
            s = ml_cuda_launched();
        }
    }
    if (s == ML_OK)
        s = ml_cuda_status(cudaMemcpyAsync(out, r, sizeof *out, cudaMemcpyDeviceToHost, st));
    if (s == ML_OK)
        s = ml_cuda_status(cudaStreamSynchronize(st));
    return s;
}

static int64_t check(const int64_t *offsets, const int64_t *order, const int64_t *idx,
                     int64_t n, int64_t E, check_slots *r, const ml_kctx *ctx)
{
    check_slots out;
    ml_status s = run_check(r, &out, offsets, order, idx, n, E, ml_cuda_stream(ctx));
    if (s != ML_OK)
        return ML_DISPATCH_EDEVICE;
    if (offsets && out.offsets_bad != -1)
        return (int64_t)out.offsets_bad;
    return out.first == ~0ull ? -1 : (int64_t)out.first;
}

extern "C" int64_t ml_dispatch_find_bad_cuda(const int64_t *idx, int64_t n, int64_t E,
                                             void *scratch, const ml_kctx *ctx)
{
    if (n <= 0)
        return -1;
    return check(NULL, NULL, idx, n, E, (check_slots *)scratch, ctx);
}

extern "C" int64_t ml_dispatch_check_plan_cuda(const int64_t *offsets, const int64_t *order,
                                               const int64_t *idx, int64_t n, int64_t E,
                                               void *scratch, const ml_kctx *ctx)
{
    return check(offsets, order, idx, n, E, (check_slots *)scratch, ctx);
}
