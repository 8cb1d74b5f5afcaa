/*
 * kernels/dispatch.h - token dispatch for MoE layers: a stable counting sort
 * of the T·k routing assignments by expert, with an optional per-expert
 * capacity (DESIGN.md, One training step: "counting sort by expert").
 *
 * An assignment is a = t·k + j: slot j of token t, routed to expert
 * idx[a] (idx is the router's [T, k] int64 output, row-major). The sort is
 * stable: within an expert, assignments keep their (t, j) order, so the
 * result depends only on idx and never on thread count or chunking.
 *
 * Capacity (cap >= 0, policy "drop"): expert e keeps its first cap
 * assignments in (t, j) order; the rest are dropped and counted. cap < 0 is
 * dropless (every assignment kept). The caller computes cap, e.g.
 * ceil(cf·T·k/E). Per-expert capacities (caps [E], each >= 0, on the
 * device; NULL: the scalar cap) keep expert e's first caps[e] instead:
 * expert parallelism drops by the global count, so each rank's local
 * budget differs per expert.
 *
 * Pack and unpack move the rows of a plan, in plan order: pack gathers
 * row order[p] / div of a [rows, cols] matrix into row p (div = k: one row
 * per token; div = 1: one per assignment), unpack adds row p back into
 * row order[p] / div. What expert parallelism sends to the rank owning an
 * expert, and sums at the origin. Unpack adds a row's contributions in
 * ascending p, i.e. ascending expert: the experts combine's order, so a
 * token's sum is bitwise the one-process y (no float atomics).
 *
 * CPU: dispatch.c; CUDA: dispatch.cu (same arguments, suffix _cuda, every
 * array on the device, bitwise the CPU's results; ndropped is a host
 * scalar on both backends, so the CUDA sort synchronises its stream). The
 * CUDA find_bad / check_plan run on ctx's stream (so they see what earlier
 * kernels on it wrote), read their verdict back synchronising that stream,
 * and return ML_DISPATCH_EDEVICE when the device reported an error
 * (ml_cuda_error_string says which).
 *
 * Scratch: the CUDA twins need device scratch (the sort's per-tile ranks,
 * the validators' result slots, unpack's inverse map), passed in like
 * every output, so the ledger counts it; ml_dispatch_scratch_bytes_<device>
 * and ml_dispatch_unpack_scratch_bytes_<device> say how much. The CPU's
 * need none (they take the argument and ignore it).
 *
 * Not here: routing (kernels/router.*), the expert computation
 * (kernels/experts.*), allocation: every output and the scratch are passed
 * in.
 */
#ifndef ML_KERNELS_DISPATCH_H
#define ML_KERNELS_DISPATCH_H

#include "core.h"

/* Sort the n = T·k assignments of idx by expert. All outputs are
 * overwritten (=):
 *   offsets  [E+1]  kept assignments of expert e are order[offsets[e] ..
 *                   offsets[e+1]); offsets[0] = 0, offsets[E] = kept total
 *   order    [n]    assignment ids a: kept ones grouped by expert (stable),
 *                   then the dropped ones in (t, j) order
 *   counts   [E]    kept assignments per expert
 *   dropped  [n]    1 where assignment a was dropped, else 0
 *   ndropped [1]    number of dropped assignments
 * Input: idx [n] expert ids, each in [0, E) (check with
 * ml_dispatch_find_bad_cpu first: an id outside that range is undefined
 * behaviour here). Sequential O(n + E); cap < 0: dropless; caps [E] (each
 * >= 0) or NULL: expert e keeps caps[e] (cap is then ignored). */
ml_status ml_dispatch_cpu(int64_t *offsets, int64_t *order, int64_t *counts, uint8_t *dropped,
                          int64_t *ndropped, const int64_t *idx, int64_t n, int64_t E,
                          int64_t cap, const int64_t *caps, void *scratch, const ml_kctx *ctx);

/* The first position a of idx [n] whose id is outside [0, E), or -1. */
int64_t ml_dispatch_find_bad_cpu(const int64_t *idx, int64_t n, int64_t E, void *scratch,
                                 const ml_kctx *ctx);

/* Checks that a plan (offsets [E+1], order [n]) is one ml_dispatch could
 * have produced for idx [n]: offsets start at 0, never decrease and end at
 * most at n; every kept position p < offsets[E] holds an assignment id in
 * [0, n) routed (by idx) to the expert whose range holds p, strictly
 * increasing within each expert's range (so no assignment appears twice:
 * kernels write dw[a] from one thread per assignment). Returns -1 when
 * consistent; otherwise the first bad offset index e (as -2 - e) or the
 * first bad position p (as p >= 0). Kernels that read a plan rely on it. */
int64_t ml_dispatch_check_plan_cpu(const int64_t *offsets, const int64_t *order,
                                   const int64_t *idx, int64_t n, int64_t E, void *scratch,
                                   const ml_kctx *ctx);

/* out [n, cols] (=): row p is row order[p] / div of in [rows, cols], for
 * the first n positions of a plan (the kept ones). Any dtype (the element
 * size is what counts). order[p] / div must be a row of in (the op checks
 * order against T·k). */
ml_status ml_dispatch_pack_cpu(ml_dtype dt, void *out, const void *in, const int64_t *order,
                               int64_t n, int64_t cols, int64_t div, const ml_kctx *ctx);

/* out [rows_out, cols] (+=): row order[p] / div gains row p of in
 * [n, cols], for p = 0, 1, ..., n-1 in that order for every output
 * element (a thread owns whole columns, never part of a sum). f32, f64;
 * CUDA also bf16 (each element summed in f32 in that order, rounded once);
 * order[0 .. n) distinct, each < rows_out·div. */
ml_status ml_dispatch_unpack_cpu(ml_dtype dt, void *out, const void *in, const int64_t *order,
                                 int64_t n, int64_t cols, int64_t div, int64_t rows_out,
                                 void *scratch, const ml_kctx *ctx);

/* What the CUDA find_bad / check_plan return on a device error. */
#define ML_DISPATCH_EDEVICE INT64_MIN

/* Bytes of 8-aligned device scratch the CUDA twins need for n assignments
 * and E experts: the sort's (check = 0) or a validator's (check = 1).
 * Plain C (dispatch.c, every build), so a plan of a CUDA run books it on a
 * machine without CUDA. The CPU kernels need none. */
size_t ml_dispatch_scratch_bytes_cuda(int64_t n, int64_t E, int check);
/* The CUDA sort's tile length (consecutive assignments per tile): the
 * sizing above and dispatch.cu agree through it. */
int64_t ml_dispatch_cuda_tile(int64_t n, int64_t E);

/* Bytes of 8-aligned device scratch the CUDA unpack needs: the position
 * of each of the rows_out·div assignments (plain C, as above). */
size_t ml_dispatch_unpack_scratch_bytes_cuda(int64_t rows_out, int64_t div);

/* The CUDA twins (dispatch.cu; `make CUDA=1` builds only), with a scratch
 * of ml_dispatch_scratch_bytes_cuda(n, E, 0) bytes (sort) or (n, E, 1)
 * (validators), ml_dispatch_unpack_scratch_bytes_cuda(rows_out, div)
 * (unpack). */
ml_status ml_dispatch_cuda(int64_t *offsets, int64_t *order, int64_t *counts, uint8_t *dropped,
                           int64_t *ndropped, const int64_t *idx, int64_t n, int64_t E,
                           int64_t cap, const int64_t *caps, void *scratch, const ml_kctx *ctx);
ml_status ml_dispatch_pack_cuda(ml_dtype dt, void *out, const void *in, const int64_t *order,
                                int64_t n, int64_t cols, int64_t div, const ml_kctx *ctx);
ml_status ml_dispatch_unpack_cuda(ml_dtype dt, void *out, const void *in, const int64_t *order,
                                  int64_t n, int64_t cols, int64_t div, int64_t rows_out,
                                  void *scratch, const ml_kctx *ctx);
int64_t ml_dispatch_find_bad_cuda(const int64_t *idx, int64_t n, int64_t E, void *scratch,
                                  const ml_kctx *ctx);
int64_t ml_dispatch_check_plan_cuda(const int64_t *offsets, const int64_t *order,
                                    const int64_t *idx, int64_t n, int64_t E, void *scratch,
                                    const ml_kctx *ctx);

#endif
