/*
 * kernels/experts.c - the tiled SwiGLU experts of kernels/experts.h on the
 * CPU. The threads share out whole tiles, not the columns of one GEMM: each
 * takes the next tile of the plan's sequence (experts ascending, rows
 * ascending), runs it in its own lane of the scratch with serial GEMMs
 * (kernels/gemm.h: the libraries' own threads are held to one while the
 * kernel runs, so two thread pools never spin against each other), and
 * adds into the shared sums in sequence order whichever thread ran the
 * tile. Nothing waits but those adds: no barrier between the steps of a
 * tile.
 *
 * Per tile, forward: gather -> GEMM h -> silu·mul -> GEMM out -> (ordered)
 * add into y. Backward: gather x and dy -> h (saved or recomputed) -> GEMM
 * dact_u = dyt·down[e] -> one fused row pass (act, dw = <dact_u, act>, dh)
 * -> scale dyt by w -> GEMM dxt = dh·gate_up[e] -> three sums, each taken
 * in tile order: ddown += doutᵀ·act, dgate_up += dhᵀ·xt (GEMMs into the
 * expert's gradients) and dx += dxt. The weight-gradient GEMMs are as much
 * work as the rest of the tile, so one ordered region holding them all
 * left the threads queueing with no slack; as three chains, one thread
 * adds to ddown while the other adds to dgate_up. One exp per element in
 * each direction.
 */
#include "experts.h"
#include "gemm.h"
#include "vmath.h"
#include <omp.h>

#include <math.h>
#include <sched.h>
#include <string.h>

/* R·(cd·D + cf·F) for R = c->tile: a lane's elements (CPU) or bytes
 * (CUDA); -1 when a size is negative or the product overflows. */
static int64_t lane_size(const ml_experts_cfg *c, int64_t cd, int64_t cf)
{
    int64_t ad, bf, row, n;
    if (c->tile < 0 || c->D < 0 || c->F < 0 || __builtin_mul_overflow(cd, c->D, &ad) ||
        __builtin_mul_overflow(cf, c->F, &bf) || __builtin_add_overflow(ad, bf, &row) ||
        __builtin_mul_overflow(c->tile, row, &n))
        return -1;
    return n;
}

/* Elements of one CPU lane: tile · (D + 3F) forward, tile · (3D + 4F)
 * backward. */
static int64_t lane_elems(const ml_experts_cfg *c, int backward)
{
    return backward ? lane_size(c, 3, 4) : lane_size(c, 1, 3);
}

size_t ml_experts_scratch_bytes(ml_dtype dt, const ml_experts_cfg *c, int backward, int nthreads)
{
    int64_t n = lane_elems(c, backward);
    size_t b;
    if (n < 0 || nthreads < 1 ||
        __builtin_mul_overflow((size_t)n, ml_dtype_size(dt) * (size_t)nthreads, &b))
        return SIZE_MAX;
    return b;
}

/* experts.cu's wave, in bytes: with s the size of dt, a that of the GEMM
 * results it keeps unrounded (out, dact_u, dxt: ml_grad_dtype(dt), f32
 * for bf16) and W = ml_experts_wave_rows(c), first 3·ML_EXPERTS_WAVE
 * device pointers per GEMM step (the grouped GEMMs' A, B and C arrays; 2
 * steps forward, 5 backward) and the rows' assignment ids (W int64), then
 * forward W·(a·D + 3s·F) (out [W, D] holding the gathered xt first, h
 * [W, 2F], act [W, F]) and backward W·((s + a)·D + (3s + a)·F) (dxt [W,
 * D] holding dyt first, dact_u [W, F], xt [W, D], h [W, 2F], act [W, F]).
 */
size_t ml_experts_scratch_bytes_cuda(ml_dtype dt, const ml_experts_cfg *c, int backward, int nthreads)
{
    (void)nthreads;
    int64_t s = (int64_t)ml_dtype_size(dt), a = (int64_t)ml_dtype_size(ml_grad_dtype(dt));
    int64_t n, head, total;
    if (c->T < 0 || c->k < 0 || c->tile < 0 || __builtin_mul_overflow(c->T, c->k, &n))
        return SIZE_MAX;
    ml_experts_cfg w = *c;
    w.tile = ml_experts_wave_rows(c);
    int64_t rows = backward ? lane_size(&w, s + a, 3 * s + a) : lane_size(&w, a, 3 * s);
    head = 3 * ML_EXPERTS_WAVE * (backward ? 5 : 2) * (int64_t)sizeof(void *) +
           w.tile * (int64_t)sizeof(int64_t);
    if (rows < 0 || __builtin_add_overflow(head, rows, &total))
        return SIZE_MAX;
    return (size_t)total;
}

/* ---- elementwise steps over one tile ------------------------------------ */

typedef struct {
    ml_dtype dt;
    size_t es;              /* element size */
    int64_t D, F, k;
    const int64_t *pos;     /* order + p0: the tile's assignment ids */
    const void *w;          /* [T, k] */
    /* gather: dst [r, D] <- src rows */
    void *dst; const void *src;
    /* swiglu: h [r, 2F] -> act [r, F]; backward also dact_u [r, F] -> dh, dw */
    const void *h; void *act; const void *dact_u; void *dh; void *dw;
    /* add: acc [T, D] += scale_a · rows [r, D], rows in order */
    void *acc; const void *rows; int scaled; int64_t r;
} tile_arg;

static void gather_rows(const tile_arg *g)
{
    size_t row = (size_t)g->D * g->es;
    for (int64_t i = 0; i < g->r; i++)
        memcpy((char *)g->dst + (size_t)i * row, (const char *)g->src + (size_t)(g->pos[i] / g->k) * row,
               row);
}

/* y [n] += s · o [n] (s = 1 for plain adds: 1·o is o exactly); no FMA
 * (-std=c11 keeps contraction off), so every clone rounds alike. */
ML_CLONES
static void axpy_row_f32(float *restrict y, const float *restrict o, float s, int64_t n)
{
    #pragma omp simd
    for (int64_t c = 0; c < n; c++)
        y[c] += s * o[c];
}

ML_CLONES
static void scale_row_f32(float *d, float s, int64_t n)
{
    #pragma omp simd
    for (int64_t c = 0; c < n; c++)
        d[c] *= s;
}

/* dst rows *= w[a] in place (dout = w · dy). */
static void scale_rows(const tile_arg *g)
{
    for (int64_t i = 0; i < g->r; i++) {
        if (g->dt == ML_F32) {
            scale_row_f32((float *)g->dst + i * g->D, ((const float *)g->w)[g->pos[i]], g->D);
        } else {
            double s = ((const double *)g->w)[g->pos[i]], *d = (double *)g->dst + i * g->D;
            for (int64_t c = 0; c < g->D; c++)
                d[c] *= s;
        }
    }
}

/* act [F] = silu(g)·u of one f32 row h = [g, u] */
ML_CLONES
static void swiglu_row_f32(const float *restrict h, float *restrict a, int64_t F)
{
    #pragma omp simd
    for (int64_t f = 0; f < F; f++) {
        float x = h[f];
        a[f] = x * sigmoid_f(x) * h[F + f];
    }
}

static void swiglu_fwd(const tile_arg *g)
{
    int64_t F = g->F;
    for (int64_t i = 0; i < g->r; i++) {
        if (g->dt == ML_F32) {
            swiglu_row_f32((const float *)g->h + i * 2 * F, (float *)g->act + i * F, F);
        } else {
            const double *h = (const double *)g->h + i * 2 * F;
            double *a = (double *)g->act + i * F;
            for (int64_t f = 0; f < F; f++) {
                double x = h[f];
                a[f] = x / (1.0 + exp(-x)) * h[F + f];
            }
        }
    }
}

/* One f32 row of the backward: act = silu(g)·u (forward's values), dh =
 * [dg, du] with dact = w·dact_u, dg = dact·u·silu'(g), du = dact·silu(g)
 * (dh may be h itself: each element is read before it is written, and
 * elements never mix); returns <dact_u, act> in f64 over 8 fixed lanes,
 * combined in lane order. */
ML_CLONES
static double swiglu_bwd_row_f32(const float *h, const float *restrict dact_u, float *restrict act,
                                 float *dh, float w, int64_t F)
{
    #pragma omp simd
    for (int64_t f = 0; f < F; f++) {
        float x = h[f], u = h[F + f];
        float s = sigmoid_f(x);
        float silu = x * s;
        act[f] = silu * u;
        float d = w * dact_u[f];
        dh[f] = d * u * (s * (1.0f + x * (1.0f - s)));
        dh[F + f] = d * silu;
    }
    double part[8] = {0};
    int64_t f = 0;
    for (; f + 8 <= F; f += 8) {
        #pragma omp simd
        for (int t = 0; t < 8; t++)
            part[t] += (double)dact_u[f + t] * (double)act[f + t];
    }
    for (int t = 0; f < F; f++, t++)
        part[t] += (double)dact_u[f] * (double)act[f];
    double dot = part[0];
    for (int t = 1; t < 8; t++)
        dot += part[t];
    return dot;
}

/* One pass per row: act, dw[a] = <dact_u, act>, dh (the f64 path: one
 * sum, f ascending). */
static void swiglu_bwd(const tile_arg *g)
{
    int64_t F = g->F;
    for (int64_t i = 0; i < g->r; i++) {
        int64_t a = g->pos[i];
        if (g->dt == ML_F32) {
            ((float *)g->dw)[a] = (float)swiglu_bwd_row_f32(
                (const float *)g->h + i * 2 * F, (const float *)g->dact_u + i * F,
                (float *)g->act + i * F, (float *)g->dh + i * 2 * F, ((const float *)g->w)[a], F);
        } else {
            const double *h = (const double *)g->h + i * 2 * F;
            const double *du_ = (const double *)g->dact_u + i * F;
            double *act = (double *)g->act + i * F, *dh = (double *)g->dh + i * 2 * F;
            double w = ((const double *)g->w)[a], dot = 0;
            for (int64_t f = 0; f < F; f++) {
                double x = h[f], u = h[F + f];
                double ex = exp(-x);
                double s = 1.0 / (1.0 + ex);
                double silu = x / (1.0 + ex);
                double av = silu * u;
                act[f] = av;
                dot += du_[f] * av;
                double d = w * du_[f];
                dh[f] = d * u * (s * (1.0 + x * (1.0 - s)));
                dh[F + f] = d * silu;
            }
            ((double *)g->dw)[a] = dot;
        }
    }
}

/* acc[t_i, :] += s_i · rows[i, :], rows in order:
 * each output element's additions happen in row order whatever the thread
 * count, even when a token appears twice in a tile. */
static void add_rows(const tile_arg *g)
{
    for (int64_t i = 0; i < g->r; i++) {
        int64_t a = g->pos[i], t = a / g->k;
        if (g->dt == ML_F32) {
            float s = g->scaled ? ((const float *)g->w)[a] : 1.0f;
            axpy_row_f32((float *)g->acc + t * g->D, (const float *)g->rows + i * g->D, s, g->D);
        } else {
            double s = g->scaled ? ((const double *)g->w)[a] : 1.0;
            double *y = (double *)g->acc + t * g->D;
            const double *o = (const double *)g->rows + i * g->D;
            for (int64_t c = 0; c < g->D; c++)
                y[c] += s * o[c];
        }
    }
}

/* ---- the tile sequence ------------------------------------------------------- */

/* The plan's tiles as one sequence: experts ascending (a skipped expert has
 * none), R-row tiles of each expert's positions ascending. */
static int64_t count_tiles(const ml_experts_weights *wt, const int64_t *offsets, int64_t E, int64_t R)
{
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++)
        if (wt->gate_up[e])
            n += (offsets[e + 1] - offsets[e] + R - 1) / R;
    return n;
}

/* Tile i of the sequence: its expert, first position and rows (a walk
 * over the experts, cheap beside a tile's GEMMs). */
static void locate_tile(const ml_experts_weights *wt, const int64_t *offsets, int64_t R, int64_t i,
                        int64_t *e, int64_t *p0, int64_t *r)
{
    for (int64_t x = 0;; x++) {
        int64_t n = wt->gate_up[x] ? (offsets[x + 1] - offsets[x] + R - 1) / R : 0;
        if (i < n) {
            *e = x;
            *p0 = offsets[x] + i * R;
            *r = offsets[x + 1] - *p0 < R ? offsets[x + 1] - *p0 : R;
            return;
        }
        i -= n;
    }
}

/* Threads for n tiles: at most one per tile. */
static int team_of(const ml_kctx *ctx, int64_t ntiles)
{
    int nt = ml_kctx_threads(ctx);
    return ntiles < nt ? (int)(ntiles > 1 ? ntiles : 1) : nt;
}

/* Before a tile: the progress hook on the calling thread (it may drive MPI),
 * and the interrupt flag, which stops every tile not yet started. */
static int tile_stopped(const ml_kctx *ctx, int *stop)
{
    if (omp_get_thread_num() == 0)
        ml_kctx_progress(ctx);
    if (ml_kctx_interrupted(ctx)) {
        #pragma omp atomic write
        *stop = 1;
    }
    int s;
    #pragma omp atomic read
    s = *stop;
    return s;
}

/* ---- forward ---------------------------------------------------------------- */

ml_status ml_experts_forward_cpu(ml_dtype dt, void *y, void *h_saved, void *scratch,
                                 const void *x, const void *w, const int64_t *order,
                                 const int64_t *offsets, const ml_experts_weights *wt,
                                 const ml_experts_cfg *c, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    int64_t D = c->D, F = c->F, R = c->tile, lane = lane_elems(c, 0);
    /* y may be NULL when it holds nothing (memset(NULL, 0, 0) is UB) */
    if (!c->accumulate && c->T * D > 0)
        memset(y, 0, (size_t)(c->T * D) * es);
    int64_t ntiles = count_tiles(wt, offsets, c->E, R);
    int nt = team_of(ctx, ntiles), blas = ml_gemm_serial_begin(), stop = 0;
    #pragma omp parallel for ordered schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (int64_t i = 0; i < ntiles; i++) {
        int run = !tile_stopped(ctx, &stop);
        int64_t e, p0, r;
        locate_tile(wt, offsets, R, i, &e, &p0, &r);
        char *xt = (char *)scratch + (size_t)(omp_get_thread_num() * lane) * es;  /* [R, D], then out */
        char *hbuf = xt + (size_t)(R * D) * es;                                    /* [R, 2F] */
        char *act = hbuf + (size_t)(R * 2 * F) * es;                               /* [R, F] */
        void *h = p0 + r <= c->nsaved ? (char *)h_saved + (size_t)(p0 * 2 * F) * es : hbuf;
        tile_arg g = {.dt = dt, .es = es, .D = D, .F = F, .k = c->k, .w = w, .pos = order + p0,
                      .r = r, .dst = xt, .src = x, .h = h, .act = act, .acc = y, .rows = xt,
                      .scaled = 1};
        if (run) {
            gather_rows(&g);
            ml_gemm(dt, ML_GEMM_SERIAL, 0, 1, r, 2 * F, D, 1.0, xt, D, wt->gate_up[e], D, 0.0, h, 2 * F);
            swiglu_fwd(&g);
            ml_gemm(dt, ML_GEMM_SERIAL, 0, 1, r, D, F, 1.0, act, F, wt->down[e], F, 0.0, xt, D);
        }
        #pragma omp ordered
        if (run)
            add_rows(&g);
    }
    ml_gemm_serial_end(blas);
    return stop ? ML_EINTERRUPTED : ML_OK;
}

/* ---- backward --------------------------------------------------------------- */

/* The backward's three sums over tiles, each added to in sequence order: a
 * chain's turn is the index of the next tile that may add to it. */
enum { CHAIN_DDOWN, CHAIN_DGATE_UP, CHAIN_DX, NCHAINS };

static int64_t chain_turn(int64_t *turn)
{
    int64_t t;
    #pragma omp atomic read seq_cst
    t = *turn;
    return t;
}

ml_status ml_experts_backward_cpu(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                                  uint8_t *touched, void *scratch, const void *h_saved,
                                  const void *dy, const void *x, const void *w,
                                  const int64_t *order, const int64_t *offsets,
                                  const ml_experts_weights *wt, const ml_experts_cfg *c,
                                  const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    int64_t D = c->D, F = c->F, R = c->tile, lane = lane_elems(c, 1);
    if (!c->accumulate) {
        if (c->T * c->k > 0)   /* dw may be NULL when it holds nothing */
            memset(dw, 0, (size_t)(c->T * c->k) * es);
        memset(touched, 0, (size_t)c->E);
    }
    for (int64_t e = 0; e < c->E; e++)
        if (wt->gate_up[e])
            touched[e] = offsets[e + 1] > offsets[e];
    int64_t ntiles = count_tiles(wt, offsets, c->E, R), next = 0, turn[NCHAINS] = {0};
    int nt = team_of(ctx, ntiles), blas = ml_gemm_serial_begin(), stop = 0;
    #pragma omp parallel num_threads(nt) if (nt > 1)
    for (;;) {
        int64_t i;
        #pragma omp atomic capture
        i = next++;
        if (i >= ntiles)
            break;
        int run = !tile_stopped(ctx, &stop);
        int64_t e, p0, r;
        locate_tile(wt, offsets, R, i, &e, &p0, &r);
        const void *gu = wt->gate_up[e], *dn = wt->down[e];
        char *xt = (char *)scratch + (size_t)(omp_get_thread_num() * lane) * es;  /* [R, D] x rows */
        char *dyt = xt + (size_t)(R * D) * es;       /* [R, D] dy rows, then w·dy */
        char *dxt = dyt + (size_t)(R * D) * es;      /* [R, D] */
        char *hbuf = dxt + (size_t)(R * D) * es;     /* [R, 2F] h (recomputed), then dh */
        char *act = hbuf + (size_t)(R * 2 * F) * es; /* [R, F] */
        char *dact = act + (size_t)(R * F) * es;     /* [R, F] unscaled: dyt · down[e] */
        const void *h = p0 + r <= c->nsaved ? (const char *)h_saved + (size_t)(p0 * 2 * F) * es
                                            : hbuf;
        tile_arg g = {.dt = dt, .es = es, .D = D, .F = F, .k = c->k, .w = w, .dw = dw,
                      .pos = order + p0, .r = r, .h = h, .act = act, .dact_u = dact, .dh = hbuf,
                      .acc = dx, .rows = dxt, .scaled = 0};
        if (run) {
            g.dst = xt; g.src = x;
            gather_rows(&g);
            g.dst = dyt; g.src = dy;
            gather_rows(&g);
            if (h == hbuf)   /* recompute h [r, 2F] = xt · gate_up[e]ᵀ */
                ml_gemm(dt, ML_GEMM_SERIAL, 0, 1, r, 2 * F, D, 1.0, xt, D, gu, D, 0.0, hbuf, 2 * F);
            /* dact_u [r, F] = dyt [r, D] · down[e] [D, F] */
            ml_gemm(dt, ML_GEMM_SERIAL, 0, 0, r, F, D, 1.0, dyt, D, dn, F, 0.0, dact, F);
            swiglu_bwd(&g);
            scale_rows(&g);
            /* dxt [r, D] = dh [r, 2F] · gate_up[e] [2F, D] */
            ml_gemm(dt, ML_GEMM_SERIAL, 0, 0, r, D, 2 * F, 1.0, hbuf, 2 * F, gu, D, 0.0, dxt, D);
        }
        /* Each chain as soon as it is this tile's turn, whichever comes
         * first: while one thread adds to ddown another may add to
         * dgate_up, so the sums overlap instead of queueing as one. */
        for (unsigned pending = (1u << NCHAINS) - 1; pending;) {
            int took = 0;
            for (int ch = 0; ch < NCHAINS; ch++) {
                if (!(pending & (1u << ch)) || chain_turn(&turn[ch]) != i)
                    continue;
                if (run && ch == CHAIN_DDOWN)   /* ddown[e] [D, F] += doutᵀ [D, r] · act [r, F] */
                    ml_gemm(dt, ML_GEMM_SERIAL, 1, 0, D, F, r, 1.0, dyt, D, act, F, 1.0, dwt->down[e], F);
                else if (run && ch == CHAIN_DGATE_UP)   /* dgate_up[e] [2F, D] += dhᵀ [2F, r] · xt [r, D] */
                    ml_gemm(dt, ML_GEMM_SERIAL, 1, 0, 2 * F, D, r, 1.0, hbuf, 2 * F, xt, D, 1.0,
                            dwt->gate_up[e], D);
                else if (run)
                    add_rows(&g);
                #pragma omp atomic write seq_cst
                turn[ch] = i + 1;
                pending &= ~(1u << ch);
                took = 1;
            }
            if (!took)
                sched_yield();
        }
    }
    ml_gemm_serial_end(blas);
    return stop ? ML_EINTERRUPTED : ML_OK;
}
