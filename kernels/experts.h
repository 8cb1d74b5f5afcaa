/*
 * kernels/experts.h - SwiGLU experts over a dispatch plan, forward and
 * backward, in fixed-size row tiles (DESIGN.md: Pools, Parameters: flat
 * units, One training step).
 *
 * Expert e computes y = w2(silu(w1 x) * w3 x) with its weights stored as
 *   gate_up[e] [2F, D]   rows 0..F-1 are w1, rows F..2F-1 are w3
 *   down[e]    [D, F]    w2
 * (Linear weights are [out, in].) The kernels take the experts as tables
 * of per-expert pointers (ml_experts_weights), not as [E, 2F, D] blocks,
 * so the experts may lie anywhere and in any order: a rank or a cache slot
 * holds any subset (DESIGN.md, expert parallelism and the expert store).
 * The tables are host arrays on every backend (CUDA reads them on the host
 * to point its grouped cuBLAS calls at them); the pointers in them are on
 * the kernel's device.
 *
 * Subsets: an expert whose gate_up entry is NULL is skipped, rows or not:
 * none of its positions is read or written (no y rows added, no h saved
 * or read, no dw entry, no touched flag, no gradient). So one layer may
 * run its experts in several calls, a subset per call (the expert store's
 * cache slots), with cfg.accumulate = 0 for the first call and 1 for the
 * rest: results are bitwise one call's over all experts, because every
 * token's sum still runs over its experts in ascending order and every
 * tile (never spanning two experts) has the same rows, GEMM shapes and
 * saved-or-recomputed choice whatever else runs (on CUDA the waves of
 * an expert's tiles, and so its cuBLAS calls, depend only on its own
 * rows: experts.cu). For bitwise y and dx the
 * calls go in ascending expert order (each call's experts after the
 * previous call's): those sums are ordered; the weights' gradients, dw and
 * touched are per expert and do not depend on the order of the calls.
 *
 * The plan comes from kernels/dispatch.h: the kept assignments of expert e
 * are order[offsets[e] .. offsets[e+1]), a = t·k + j, token t = a / k. The
 * kernels walk experts in index order and each expert's range in tiles of R
 * rows (the last one shorter); a "position" p is an index into order. Per
 * tile (r <= R rows, positions p0 .. p0+r):
 *   xt  [r, D]  = x rows of the tile's tokens (gathered again in backward)
 *   h   [r, 2F] = xt · gate_up[e]ᵀ             one GEMM (g = h[:, :F], u = h[:, F:])
 *   act [r, F]  = silu(g) * u
 *   out [r, D]  = act · down[e]ᵀ                one GEMM
 *   y[t] += w[a] · out[row of a]
 * Scratch is tile-sized (ml_experts_scratch_bytes; CUDA's wave-sized),
 * so no buffer size depends on how tokens were routed; experts with no
 * rows run nothing.
 *
 * Determinism: y is zeroed (unless accumulating), then every tile adds its
 * rows in tile order (experts ascending, positions ascending), each row in
 * turn, and dgate_up[e] / ddown[e] add their tiles in the same order;
 * threads never split a sum. So a token's sum is over its experts in
 * ascending expert index, fixed by the plan alone. On the CPU each tile's
 * GEMMs are whole serial calls of kernels/gemm.h (the threads share out
 * tiles, not columns), whose results depend only on the shapes, so results
 * are bitwise the same for every thread count (DESIGN.md, Tensors).
 *
 * Saving (the memory-time tradeoff): the caller passes h_saved [S, 2F] for
 * the first S dispatch positions. A tile with p0 + r <= S keeps its h there
 * in forward and backward reads it back; every other tile (at most one
 * straddling S, and all after it) recomputes h from a fresh gather of x
 * with the same GEMM shape, so the recomputed h is bitwise the saved one
 * and gradients do not depend on S. S = T·k saves everything ("save"),
 * S = 0 nothing ("recompute"); the binding maps partial_recompute = f to
 * S = floor((1 - f)·T·k), a buffer size fixed by T and k.
 *
 * Routing-weight gradient without saved outputs: for a row with act a and
 * weight w, dw = <dy_t, W2·a> = <W2ᵀ·dy_t, a>, and W2ᵀ·dy_t is the
 * unscaled hidden gradient the down-projection backward computes anyway.
 *
 * Kernels never allocate and never raise; the interrupt flag is polled
 * between tiles (CUDA: between waves). dtypes dt: f32, f64 (x, w,
 * weights, outputs and scratch all in one dtype); on CUDA also bf16
 * (mixed precision, DESIGN.md Numerics): x, w, the weights, y, dx, dw and
 * h_saved in bf16, the weights' gradients (dwt) in f32
 * (ml_grad_dtype(dt)), the math in f32 (dw's dot in f64 as ever). CPU: experts.c; CUDA: experts.cu (same arguments,
 * suffix _cuda, every pointer on the device but the cfg and the tables
 * themselves; grouped GEMMs through cuBLAS, the combine in the same row
 * order and with the same roundings as tile by tile, so results agree with
 * the CPU normwise).
 */
#ifndef ML_KERNELS_EXPERTS_H
#define ML_KERNELS_EXPERTS_H

#include "core.h"

typedef struct {
    int64_t T, k;       /* tokens and slots per token: n = T·k assignments */
    int64_t D, F, E;    /* model dim, expert hidden dim, experts */
    int64_t tile;       /* R, rows per tile, >= 1 */
    int64_t nsaved;     /* S, dispatch positions whose h is kept, 0 .. T·k */
    int accumulate;     /* 0: this call starts the layer's outputs (forward zeroes y,
                         * backward zeroes dw and touched first); 1: it continues
                         * earlier calls over other experts (y, dw and touched keep
                         * what they wrote) */
} ml_experts_cfg;

/* The experts' weights: [E] host arrays, expert e's gate_up [2F, D] and
 * down [D, F], each contiguous, read only; gate_up[e] NULL: expert e is
 * skipped (down[e] is then not read either). */
typedef struct {
    const void *const *gate_up;
    const void *const *down;
} ml_experts_weights;

/* Their gradients: [E] host arrays of contiguous [2F, D] and [D, F]
 * accumulators (+=) of dtype ml_grad_dtype(dt); only experts run with rows
 * are written (the entries of skipped experts are not read: NULL
 * allowed). */
typedef struct {
    void *const *gate_up;
    void *const *down;
} ml_experts_wgrads;

/* CUDA runs the walk's tiles in waves of up to ML_EXPERTS_WAVE consecutive
 * tiles of one expert (experts.cu): a launch per step covers a whole wave, the wave's
 * rows lie one after another in the scratch, at most
 * ml_experts_wave_rows(c) = min(WAVE·R, T·k) of them. */
#define ML_EXPERTS_WAVE 8

static inline int64_t ml_experts_wave_rows(const ml_experts_cfg *c)
{
    int64_t n = c->T * c->k;
    return c->tile > n / ML_EXPERTS_WAVE ? n : ML_EXPERTS_WAVE * c->tile;
}

/* Scratch bytes of a forward (backward = 0) or backward call. The CPU runs
 * a tile per thread (nthreads lanes, the kernel context's thread count) of
 * R·(D + 3F) elements of dt forward and R·(3D + 4F) backward. CUDA runs a
 * wave at a time (nthreads unused): W = ml_experts_wave_rows(c) rows of
 * D + 3F elements forward and 2D + 4F backward, of which D and, backward,
 * D + F are f32 when dt is bf16, plus W int64 (the rows' assignment ids)
 * and 3·WAVE device pointers per GEMM step (2 forward, 5 backward: the
 * grouped GEMMs' arrays); experts.c says which buffer is which. SIZE_MAX
 * when the size overflows (the caller refuses the tile). Plain C
 * (experts.c), so a plan of a CUDA run books it without a GPU. */
size_t ml_experts_scratch_bytes(ml_dtype dt, const ml_experts_cfg *c, int backward, int nthreads);
size_t ml_experts_scratch_bytes_cuda(ml_dtype dt, const ml_experts_cfg *c, int backward,
                                     int nthreads);

/* Forward.
 *   y        [T, D]     out (=): every token's sum over its kept assignments
 *                       to the experts run; 0 for a token whose assignments
 *                       were all dropped. cfg.accumulate: (+=), not zeroed
 *   h_saved  [S, 2F]    out (=): h of the run experts' positions in tiles
 *                       lying below S (NULL allowed when S = 0)
 *   scratch  ml_experts_scratch_bytes(dt, c, 0, ctx->nthreads) bytes
 *   x        [T, D]
 *   w        [T, k]     combine weights
 *   order    [T·k], offsets [E+1]: a plan (ml_dispatch_check_plan_cpu)
 *   wt       the E experts' weights */
ml_status ml_experts_forward_cpu(ml_dtype dt, void *y, void *h_saved, void *scratch,
                                 const void *x, const void *w, const int64_t *order,
                                 const int64_t *offsets, const ml_experts_weights *wt,
                                 const ml_experts_cfg *c, const ml_kctx *ctx);

/* Backward, with dy [T, D] the gradient of y.
 *   dx        [T, D]     accumulates (+=)
 *   dwt       the weights' gradients (ml_grad_dtype(dt)): accumulate (+=),
 *             tile by tile in order; experts without rows or skipped are
 *             not written at all
 *   dw        [T, k]     out (=) for the run experts' assignments; zeroed
 *                        first unless cfg.accumulate (so dropped ones are 0)
 *   touched   [E]        out (=) for the run experts: 1 where expert e had
 *                        rows (got a gradient), else 0; zeroed first unless
 *                        cfg.accumulate
 *   scratch   ml_experts_scratch_bytes(dt, c, 1, ctx->nthreads) bytes
 *   h_saved   [S, 2F]    what forward saved with the same cfg, tile and S (NULL
 *                        when S = 0); only the run experts' positions are read
 *   dy [T, D], x, w, order, offsets, wt: as in forward */
ml_status ml_experts_backward_cpu(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                                  uint8_t *touched, void *scratch, const void *h_saved,
                                  const void *dy, const void *x, const void *w,
                                  const int64_t *order, const int64_t *offsets,
                                  const ml_experts_weights *wt, const ml_experts_cfg *c,
                                  const ml_kctx *ctx);

/* The CUDA twins (experts.cu; `make CUDA=1` builds only). */
ml_status ml_experts_forward_cuda(ml_dtype dt, void *y, void *h_saved, void *scratch,
                                  const void *x, const void *w, const int64_t *order,
                                  const int64_t *offsets, const ml_experts_weights *wt,
                                  const ml_experts_cfg *c, const ml_kctx *ctx);
ml_status ml_experts_backward_cuda(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                                   uint8_t *touched, void *scratch, const void *h_saved,
                                   const void *dy, const void *x, const void *w,
                                   const int64_t *order, const int64_t *offsets,
                                   const ml_experts_weights *wt, const ml_experts_cfg *c,
                                   const ml_kctx *ctx);

#endif
