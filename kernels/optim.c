/*
 * kernels/optim.c - AdamW, lazy AdamW, SGD, squared norms and scaling on
 * flat CPU buffers (kernels/optim.h). Each update is written twice, for
 * float and double, so every operation rounds in the buffers' dtype as
 * PyTorch's CPU kernels do.
 *
 * The interrupt flag is deliberately cleared from the context handed to
 * ml_parallel_tiles: an optimizer step is never stopped midway.
 */
#include "optim.h"
#include "parallel.h"
#include "reduce.h"

#include <math.h>

#define TILE 4096

/* The caller's threads without its interrupt flag (DESIGN.md: the
 * optimizer step cannot be interrupted). */
static ml_kctx uninterruptible(const ml_kctx *ctx)
{
    ml_kctx c = {.nthreads = 1};
    if (ctx) {
        c = *ctx;
        c.interrupt = NULL;
    }
    return c;
}

/* ---- AdamW ---------------------------------------------------------------- */

static void adam_f32(float *p, float *m, float *v, const float *g, int64_t lo, int64_t hi,
                     const ml_adamw_coef *c)
{
    const float decay = (float)c->decay, w = (float)c->w, w1 = 1.0f - w, b2 = (float)c->b2;
    const float c2 = (float)c->c2, bs = (float)c->bc2_sqrt, eps = (float)c->eps;
    const float ns = (float)c->neg_step;
    for (int64_t i = lo; i < hi; i++) {
        float pi = p[i] * decay, gi = g[i], mi = m[i];
        mi = c->low ? mi + w * (gi - mi) : gi - (gi - mi) * w1;
        float vi = v[i] * b2;
        vi = vi + c2 * gi * gi;
        float den = sqrtf(vi) / bs + eps;
        p[i] = pi + ns * mi / den;
        m[i] = mi;
        v[i] = vi;
    }
}

static void adam_f64(double *p, double *m, double *v, const double *g, int64_t lo, int64_t hi,
                     const ml_adamw_coef *c)
{
    const double decay = c->decay, w = c->w, w1 = 1.0 - w, b2 = c->b2;
    const double c2 = c->c2, bs = c->bc2_sqrt, eps = c->eps, ns = c->neg_step;
    for (int64_t i = lo; i < hi; i++) {
        double pi = p[i] * decay, gi = g[i], mi = m[i];
        mi = c->low ? mi + w * (gi - mi) : gi - (gi - mi) * w1;
        double vi = v[i] * b2;
        vi = vi + c2 * gi * gi;
        double den = sqrt(vi) / bs + eps;
        p[i] = pi + ns * mi / den;
        m[i] = mi;
        v[i] = vi;
    }
}

static void adam_range(ml_dtype dt, void *p, void *m, void *v, const void *g, int64_t lo,
                       int64_t hi, const ml_adamw_coef *c)
{
    if (dt == ML_F32)
        adam_f32(p, m, v, g, lo, hi, c);
    else
        adam_f64(p, m, v, g, lo, hi, c);
}

typedef struct {
    ml_dtype dt;
    void *p, *m, *v;
    const void *g;
    ml_adamw_coef c;
} adam_arg;

static void adam_tile(void *arg, int64_t lo, int64_t hi)
{
    const adam_arg *a = arg;
    adam_range(a->dt, a->p, a->m, a->v, a->g, lo, hi, &a->c);
}

ml_status ml_adamw_cpu(ml_dtype dt, void *p, void *m, void *v, const void *g, int64_t n,
                       const ml_adamw_hp *hp, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    adam_arg a = {dt, p, m, v, g, ml_adamw_coef_of(hp, hp->step)};
    ml_kctx c = uninterruptible(ctx);
    return ml_parallel_tiles(n, TILE, 8, &c, adam_tile, &a);
}

/* ---- lazy AdamW: per-expert states ------------------------------------------ */

typedef struct {
    ml_dtype dt;
    char *p;                    /* [E * S] */
    const char *g;              /* [E * S] */
    void *const *m, *const *v;  /* [E] pointers to [S] (NULL: no states) */
    const ml_adamw_hp *hp;
    const int64_t *steps;       /* [E] counts before this step */
    const uint8_t *active;      /* [E] */
    int64_t slice;              /* S */
    size_t es;                  /* element size */
} lazy_arg;

/* A tile may span several experts: each part is updated with its expert's
 * own count and states (j: the part's offset inside the expert). */
static void lazy_tile(void *arg, int64_t lo, int64_t hi)
{
    const lazy_arg *a = arg;
    while (lo < hi) {
        int64_t e = lo / a->slice;
        int64_t end = (e + 1) * a->slice < hi ? (e + 1) * a->slice : hi;
        if (a->active[e]) {
            size_t j = (size_t)(lo - e * a->slice) * a->es, at = (size_t)lo * a->es;
            ml_adamw_coef c = ml_adamw_coef_of(a->hp, a->steps[e] + 1);
            adam_range(a->dt, a->p + at, (char *)a->m[e] + j, (char *)a->v[e] + j, a->g + at, 0,
                       end - lo, &c);
        }
        lo = end;
    }
}

ml_status ml_lazy_adamw_cpu(ml_dtype dt, void *p, void *const *m, void *const *v,
                            int64_t *steps, const void *g, const uint8_t *active, int64_t n,
                            int64_t E, const ml_adamw_hp *hp, int64_t *nactive,
                            const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E < 1 || n % E != 0 || !ml_lazy_states_present(m, v, active, E))
        return ML_EUNSUPPORTED;
    lazy_arg a = {dt, p, g, m, v, hp, steps, active, n / E, ml_dtype_size(dt)};
    ml_kctx c = uninterruptible(ctx);
    ml_status s = a.slice > 0 ? ml_parallel_tiles(n, TILE, 8, &c, lazy_tile, &a) : ML_OK;
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

typedef struct {
    ml_dtype dt;
    void *p, *buf;
    const void *g;
    const ml_sgd_hp *hp;
} sgd_arg;

static void sgd_tile(void *arg, int64_t lo, int64_t hi)
{
    const sgd_arg *a = arg;
    const ml_sgd_hp *h = a->hp;
    int wd = h->weight_decay != 0, first = h->first, nest = h->nesterov;
    if (a->dt == ML_F32) {
        float *p = a->p, *b = a->buf;
        const float *g = a->g;
        const float lam = (float)h->weight_decay, mom = (float)h->momentum;
        const float damp1 = (float)(1.0 - h->dampening), nlr = (float)-h->lr;
        for (int64_t i = lo; i < hi; i++) {
            float d = g[i];
            if (wd)
                d = d + lam * p[i];
            if (b) {
                float bi = first ? d : b[i] * mom + damp1 * d;
                b[i] = bi;
                d = nest ? d + mom * bi : bi;
            }
            p[i] = p[i] + nlr * d;
        }
    } else {
        double *p = a->p, *b = a->buf;
        const double *g = a->g;
        const double lam = h->weight_decay, mom = h->momentum;
        const double damp1 = 1.0 - h->dampening, nlr = -h->lr;
        for (int64_t i = lo; i < hi; i++) {
            double d = g[i];
            if (wd)
                d = d + lam * p[i];
            if (b) {
                double bi = first ? d : b[i] * mom + damp1 * d;
                b[i] = bi;
                d = nest ? d + mom * bi : bi;
            }
            p[i] = p[i] + nlr * d;
        }
    }
}

ml_status ml_sgd_cpu(ml_dtype dt, void *p, void *buf, const void *g, int64_t n,
                     const ml_sgd_hp *hp, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    sgd_arg a = {dt, p, hp->momentum != 0 ? buf : NULL, g, hp};
    ml_kctx c = uninterruptible(ctx);
    return ml_parallel_tiles(n, TILE, 4, &c, sgd_tile, &a);
}

/* ---- norms and scaling ---------------------------------------------------- */

ml_status ml_sumsq_cpu(ml_dtype dt, double *out, const void *x, int64_t n, void *scratch,
                       const ml_kctx *ctx)
{
    ml_kctx c = uninterruptible(ctx);
    return ml_block_sum_cpu(dt, out, x, n, 1, &c);   /* reduce.c's fixed blocks */
}

ml_status ml_slice_norms_cpu(ml_dtype dt, double *norms, const void *x, int64_t n, int64_t E,
                             void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E < 1 || n % E != 0)
        return ML_EUNSUPPORTED;
    int64_t S = n / E;
    size_t es = ml_dtype_size(dt);
    for (int64_t e = 0; e < E; e++) {
        double ss;
        ml_status s = ml_sumsq_cpu(dt, &ss, (const char *)x + (size_t)(e * S) * es, S, NULL, ctx);
        if (s != ML_OK)
            return s;
        norms[e] = sqrt(ss);
    }
    return ML_OK;
}

/* optim.cu's layout: slice e's super partials at e * nsup (+ 1 for sumsq,
 * whose total comes first). */
size_t ml_slice_norms_scratch_bytes_cuda(int64_t n, int64_t E)
{
    if (E < 1 || n % E != 0)
        return 0;
    int64_t super_elems = (int64_t)ML_OPTIM_SUPER * ML_OPTIM_BLOCK;
    int64_t nsup = (n / E + super_elems - 1) / super_elems;
    return (size_t)(E * nsup) * sizeof(double);
}

size_t ml_sumsq_scratch_bytes_cuda(int64_t n)
{
    return sizeof(double) + ml_slice_norms_scratch_bytes_cuda(n, 1);
}

typedef struct {
    ml_dtype dt;
    void *x;
    const double *f;
    int64_t slice;
} scale_arg;

static void scale_tile(void *arg, int64_t lo, int64_t hi)
{
    const scale_arg *a = arg;
    while (lo < hi) {
        int64_t e = lo / a->slice;
        int64_t end = (e + 1) * a->slice < hi ? (e + 1) * a->slice : hi;
        if (a->dt == ML_F32) {
            float *x = a->x, f = (float)a->f[e];
            for (int64_t i = lo; i < end; i++)
                x[i] = x[i] * f;
        } else {
            double *x = a->x, f = a->f[e];
            for (int64_t i = lo; i < end; i++)
                x[i] = x[i] * f;
        }
        lo = end;
    }
}

ml_status ml_scale_slices_cpu(ml_dtype dt, void *x, const double *factors, int64_t n,
                              int64_t E, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E < 1 || n % E != 0)
        return ML_EUNSUPPORTED;
    if (n == 0)
        return ML_OK;
    scale_arg a = {dt, x, factors, n / E};
    ml_kctx c = uninterruptible(ctx);
    return ml_parallel_tiles(n, TILE, 1, &c, scale_tile, &a);
}
