/*
 * host/runtime/ops_optim.c - the optimizer and gradient-norm ops
 * (host/runtime/ops_optim.h).
 */
#include "ops_optim.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* Experts per kernel call of the lazy update and of the per-slice clip:
 * their state pointers, mask bytes, norms and factors live on the stack,
 * so no call allocates. Slices are independent (elementwise updates), so
 * the split changes no bit. */
#define CHUNK 64

static const char *const KIND_NAMES[] = {"adamw", "lazy_adamw", "sgd"};

static int64_t min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* ---- argument checks -------------------------------------------------------- */

static ml_status check_count(const ml_tensor *t, const char *name, int64_t n, ml_err *e)
{
    if (ml_numel(t) == n)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s has %lld elements but must have %lld", name,
                      (long long)ml_numel(t), (long long)n);
}

/* A flat buffer: live, on dev, f32 or f64, contiguous, any shape. */
static ml_status check_flat(const ml_tensor *t, const char *name, ml_device dev, ml_err *e)
{
    return ml_check_input(t, name, dev, ML_DT_FLOAT, t->ndim, 1, e);
}

/* A flat buffer of ref's dtype with n elements. */
static ml_status check_like(const ml_tensor *t, const char *name, ml_device dev,
                            const ml_tensor *ref, const char *ref_name, int64_t n, ml_err *e)
{
    ML_TRY(check_flat(t, name, dev, e));
    ML_TRY(ml_check_same_dtype(t, name, ref_name, ref->dtype, e));
    return check_count(t, name, n, e);
}

/* A contiguous dt tensor of n elements (masks, counts). */
static ml_status check_small(const ml_tensor *t, const char *name, ml_device dev, ml_dtype dt,
                             int64_t n, ml_err *e)
{
    ML_TRY(ml_check_input(t, name, dev, ML_DT(dt), t->ndim, 1, e));
    return check_count(t, name, n, e);
}

/* E >= 1 slices of x's elements. */
static ml_status check_slices(const ml_tensor *x, const char *name, int64_t E, ml_err *e)
{
    if (E < 1)
        return ml_err_set(e, ML_EINVAL, "E must be >= 1, got %lld", (long long)E);
    if (ml_numel(x) % E != 0)
        return ml_err_set(e, ML_EINVAL, "E = %lld does not divide the %lld elements of %s",
                          (long long)E, (long long)ml_numel(x), name);
    return ML_OK;
}

static ml_status check_nonneg(double v, const char *name, ml_err *e)
{
    if (v >= 0 && isfinite(v))
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s must be finite and >= 0, got %g", name, v);
}

/* v in [0, 1) (closed: [0, 1]). */
static ml_status check_unit(double v, const char *name, int closed, ml_err *e)
{
    if (v >= 0 && (closed ? v <= 1 : v < 1))
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s must be in [0, 1%s, got %g", name, closed ? "]" : ")", v);
}

static ml_status check_adamw_hp(const ml_adamw_hp *hp, ml_err *e)
{
    ML_TRY(check_nonneg(hp->lr, "lr", e));
    ML_TRY(check_unit(hp->beta1, "beta1", 0, e));
    ML_TRY(check_unit(hp->beta2, "beta2", 0, e));
    ML_TRY(check_nonneg(hp->eps, "eps", e));
    return check_nonneg(hp->weight_decay, "weight_decay", e);
}

static ml_status check_sgd_hp(const ml_sgd_hp *hp, ml_err *e)
{
    ML_TRY(check_nonneg(hp->lr, "lr", e));
    ML_TRY(check_nonneg(hp->momentum, "momentum", e));
    ML_TRY(check_unit(hp->dampening, "dampening", 1, e));
    ML_TRY(check_nonneg(hp->weight_decay, "weight_decay", e));
    if (hp->nesterov && (hp->momentum <= 0 || hp->dampening != 0))
        return ml_err_set(e, ML_EINVAL, "nesterov needs momentum > 0 and dampening = 0 (got "
                          "momentum %g, dampening %g)", hp->momentum, hp->dampening);
    return ML_OK;
}

/* The per-expert states s[0..E) (name[e], 1-based in messages): each
 * present one of params' dtype with n/E elements. */
static ml_status check_states(ml_tensor *const *s, const char *name, ml_device dev,
                              const ml_tensor *p, int64_t E, ml_err *e)
{
    char what[48];
    for (int64_t x = 0; x < E; x++) {
        snprintf(what, sizeof what, "%s[%lld]", name, (long long)x + 1);
        if (s[x])
            ML_TRY(check_like(s[x], what, dev, p, "params", ml_numel(p) / E, e));
    }
    return ML_OK;
}

/* Every active expert has both states. Reads the mask back, so not in a
 * plan (where the kernel is skipped anyway). */
static ml_status check_active_states(ml_host *h, const ml_optim_job *j, ml_err *e)
{
    if (h->planning)
        return ML_OK;
    uint8_t a[CHUNK];
    for (int64_t e0 = 0; e0 < j->experts; e0 += CHUNK) {
        int64_t k = min64(CHUNK, j->experts - e0);
        ML_TRY(ml_read_back(h, j->active, e0, k, a, e));
        for (int64_t i = 0; i < k; i++) {
            int64_t x = e0 + i;
            if (a[i] && (!j->expert_avg[x] || !j->expert_avg_sq[x]))
                return ml_err_set(e, ML_EINVAL, "%s[%lld]: expert %lld is active but has no state",
                                  j->expert_avg[x] ? "exp_avg_sq" : "exp_avg", (long long)x + 1,
                                  (long long)x + 1);
        }
    }
    return ML_OK;
}

static ml_status check_lazy(ml_host *h, ml_device dev, const ml_optim_job *j, ml_err *e)
{
    int64_t E = j->experts;
    ML_TRY(check_slices(j->params, "params", E, e));
    /* host counters on every device: the kernels read them on the host
     * (kernels/optim.h) and launch once per active expert */
    ML_TRY(check_small(j->active, "active", ML_CPU, ML_U8, E, e));
    ML_TRY(check_small(j->steps, "steps", ML_CPU, ML_I64, E, e));
    ML_TRY(check_states(j->expert_avg, "exp_avg", dev, j->params, E, e));
    ML_TRY(check_states(j->expert_avg_sq, "exp_avg_sq", dev, j->params, E, e));
    ML_TRY(check_adamw_hp(&j->adamw, e));
    return check_active_states(h, j, e);
}

static ml_status check_step(int64_t step, ml_err *e)
{
    if (step >= 0)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "step must be >= 0 (completed steps), got %lld",
                      (long long)step);
}

/* Everything a job's update reads, on dev. */
static ml_status check_job(ml_host *h, ml_device dev, const ml_optim_job *j, ml_err *e)
{
    ML_TRY(check_flat(j->params, "params", dev, e));
    int64_t n = ml_numel(j->params);
    ML_TRY(check_like(j->grads, "grads", dev, j->params, "params", n, e));
    switch (j->kind) {
    case ML_OPTIM_ADAMW:
        ML_TRY(check_like(j->exp_avg, "exp_avg", dev, j->params, "params", n, e));
        ML_TRY(check_like(j->exp_avg_sq, "exp_avg_sq", dev, j->params, "params", n, e));
        ML_TRY(check_adamw_hp(&j->adamw, e));
        return check_step(j->step, e);
    case ML_OPTIM_LAZY_ADAMW:
        return check_lazy(h, dev, j, e);
    case ML_OPTIM_SGD:
        ML_TRY(check_sgd_hp(&j->sgd, e));
        if (j->sgd.momentum != 0 && !j->momentum_buffer)
            return ml_err_set(e, ML_EINVAL, "momentum %g needs a momentum_buffer, got none",
                              j->sgd.momentum);
        if (j->momentum_buffer)
            ML_TRY(check_like(j->momentum_buffer, "momentum_buffer", dev, j->params, "params", n,
                              e));
        return check_step(j->step, e);
    }
    return ml_err_set(e, ML_EINVAL, "unknown optimizer kind %d", (int)j->kind);
}

/* ---- updates ------------------------------------------------------------------ */

/* The lazy update, CHUNK experts per kernel call; *nactive: experts updated. */
static ml_status run_lazy(ml_host *h, ml_device dev, const ml_optim_job *j, int64_t *nactive,
                          const ml_kctx *c)
{
    int64_t E = j->experts, S = ml_numel(j->params) / E;
    size_t es = ml_dtype_size(j->params->dtype);
    char *p = ml_data(j->params);
    const char *g = ml_data(j->grads);
    const uint8_t *active = ml_data(j->active);
    int64_t *steps = ml_data(j->steps);
    void *m[CHUNK], *v[CHUNK];
    *nactive = 0;
    for (int64_t e0 = 0; e0 < E; e0 += CHUNK) {
        int64_t k = min64(CHUNK, E - e0), nk = 0;
        for (int64_t i = 0; i < k; i++) {
            m[i] = j->expert_avg[e0 + i] ? ml_data(j->expert_avg[e0 + i]) : NULL;
            v[i] = j->expert_avg_sq[e0 + i] ? ml_data(j->expert_avg_sq[e0 + i]) : NULL;
        }
        size_t at = (size_t)(e0 * S) * es;
        ML_TRY(ML_KCALL(h, dev, lazy_adamw, j->params->dtype, p + at, m, v, steps + e0, g + at,
                        active + e0, k * S, k, &j->adamw, &nk, c));
        *nactive += nk;
    }
    return ML_OK;
}

/* One checked job's update with t = step + 1; a kernel status. */
static ml_status run_job(ml_host *h, ml_device dev, const ml_optim_job *j, int64_t *nactive,
                         const ml_kctx *c)
{
    ml_dtype dt = j->params->dtype;
    int64_t n = ml_numel(j->params);
    *nactive = 0;
    switch (j->kind) {
    case ML_OPTIM_ADAMW: {
        ml_adamw_hp hp = j->adamw;
        hp.step = j->step + 1;
        return ML_KCALL(h, dev, adamw, dt, ml_data(j->params), ml_data(j->exp_avg),
                        ml_data(j->exp_avg_sq), ml_data(j->grads), n, &hp, c);
    }
    case ML_OPTIM_LAZY_ADAMW:
        return run_lazy(h, dev, j, nactive, c);
    case ML_OPTIM_SGD: {
        ml_sgd_hp hp = j->sgd;
        hp.first = j->step == 0;
        void *buf = hp.momentum != 0 ? ml_data(j->momentum_buffer) : NULL;
        return ML_KCALL(h, dev, sgd, dt, ml_data(j->params), buf, ml_data(j->grads), n, &hp, c);
    }
    }
    return ML_EUNSUPPORTED;   /* check_job refused it */
}

/* A single-job op: check, run, report. */
static ml_status run_one(ml_host *h, const ml_optim_job *j, int64_t *nactive, ml_err *e)
{
    ml_device dev = ml_tensor_device(j->params);
    ML_TRY(check_job(h, dev, j, e));
    ml_kctx c = ml_host_kctx(h);
    int64_t k;
    ml_status s = run_job(h, dev, j, &k, &c);
    if (nactive)
        *nactive = k;
    return ml_kernel_status(s, e);
}

ml_status ml_op_adamw_step(ml_host *h, ml_tensor *p, const ml_tensor *g, ml_tensor *m,
                           ml_tensor *v, const ml_adamw_hp *hp, ml_err *e)
{
    if (hp->step < 1)
        return ml_err_set(e, ML_EINVAL, "step must be >= 1 (1-based), got %lld",
                          (long long)hp->step);
    ml_optim_job j = {.kind = ML_OPTIM_ADAMW, .params = p, .grads = g, .exp_avg = m,
                      .exp_avg_sq = v, .adamw = *hp, .step = hp->step - 1};
    return run_one(h, &j, NULL, e);
}

ml_status ml_op_lazy_adamw_step(ml_host *h, ml_tensor *p, const ml_tensor *g,
                                ml_tensor *const *m, ml_tensor *const *v,
                                const ml_tensor *active, ml_tensor *steps, int64_t E,
                                const ml_adamw_hp *hp, int64_t *nactive, ml_err *e)
{
    ml_optim_job j = {.kind = ML_OPTIM_LAZY_ADAMW, .params = p, .grads = g, .expert_avg = m,
                      .expert_avg_sq = v, .active = active, .steps = steps, .experts = E,
                      .adamw = *hp};
    return run_one(h, &j, nactive, e);
}

ml_status ml_op_sgd_step(ml_host *h, ml_tensor *p, const ml_tensor *g, ml_tensor *buf,
                         const ml_sgd_hp *hp, int64_t step, ml_err *e)
{
    if (step < 1)
        return ml_err_set(e, ML_EINVAL, "step must be >= 1 (1-based), got %lld", (long long)step);
    ml_optim_job j = {.kind = ML_OPTIM_SGD, .params = p, .grads = g, .momentum_buffer = buf,
                      .sgd = *hp, .step = step - 1};
    return run_one(h, &j, NULL, e);
}

ml_status ml_op_lazy_adamw_unstated(ml_host *h, const ml_tensor *active, ml_tensor *const *m,
                                    int64_t E, int64_t *out, int64_t *k, ml_err *e)
{
    *k = 0;
    ml_device dev = ml_tensor_device(active);
    ML_TRY(check_small(active, "active", dev, ML_U8, E, e));
    uint8_t a[CHUNK];
    for (int64_t e0 = 0; e0 < E; e0 += CHUNK) {
        int64_t n = min64(CHUNK, E - e0);
        if (h->planning)
            memset(a, 1, sizeof a);   /* the mask was never computed: every expert */
        else
            ML_TRY(ml_read_back(h, active, e0, n, a, e));
        for (int64_t i = 0; i < n; i++)
            if (a[i] && !m[e0 + i])
                out[(*k)++] = e0 + i;
    }
    return ML_OK;
}

/* Prepend "job i (kind): " to e's message. */
static ml_status job_error(ml_err *e, ml_status s, int64_t i, ml_optim_kind kind)
{
    char pre[64];
    size_t len = (size_t)snprintf(pre, sizeof pre, "job %lld (%s): ", (long long)i + 1,
                                  KIND_NAMES[kind]);
    size_t have = strnlen(e->msg, sizeof e->msg - 1);
    if (len + have >= sizeof e->msg)
        have = sizeof e->msg - len - 1;
    memmove(e->msg + len, e->msg, have);
    memcpy(e->msg, pre, len);
    e->msg[len + have] = 0;
    return s;
}

ml_status ml_op_optim_step_all(ml_host *h, ml_optim_job *jobs, int64_t n, int64_t *skipped,
                               ml_err *e)
{
    if (skipped)
        *skipped = 0;
    ml_device dev = n > 0 ? ml_tensor_device(jobs[0].params) : ML_CPU;
    for (int64_t i = 0; i < n; i++) {   /* 1. check everything: a refusal changes nothing */
        if ((unsigned)jobs[i].kind > ML_OPTIM_SGD)
            return ml_err_set(e, ML_EINVAL, "job %lld: unknown optimizer kind %d",
                              (long long)i + 1, (int)jobs[i].kind);
        ml_status s = check_job(h, dev, &jobs[i], e);
        if (s != ML_OK)
            return job_error(e, s, i, jobs[i].kind);
    }
    ml_kctx c = ml_host_kctx(h);       /* 2. every update, nothing in between */
    ml_status bad = ML_OK;
    int64_t idle = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t k;
        ml_status s = run_job(h, dev, &jobs[i], &k, &c);
        if (jobs[i].kind == ML_OPTIM_LAZY_ADAMW)
            idle += jobs[i].experts - k;
        if (s != ML_OK && bad == ML_OK)
            bad = s;
    }
    for (int64_t i = 0; i < n; i++)     /* 3. the counts (lazy jobs advanced their own) */
        if (jobs[i].kind != ML_OPTIM_LAZY_ADAMW)
            jobs[i].step++;
    if (skipped)
        *skipped = idle;
    return ml_kernel_status(bad, e);
}

/* ---- norms and clipping --------------------------------------------------------- */

ml_status ml_op_grad_sumsq(ml_host *h, const ml_tensor *const *t, int64_t n, double *sumsq,
                           ml_err *e)
{
    *sumsq = 0;
    ml_device dev = n > 0 ? ml_tensor_device(t[0]) : ML_CPU;
    char name[32];
    for (int64_t i = 0; i < n; i++) {   /* check all before computing any */
        snprintf(name, sizeof name, "tensor %lld", (long long)i + 1);
        ML_TRY(check_flat(t[i], name, dev, e));
    }
    int64_t most = 0;                   /* one scratch, sized for the largest */
    for (int64_t i = 0; i < n; i++)
        if (ml_numel(t[i]) > most)
            most = ml_numel(t[i]);
    ml_tensor scr = {0};
    ML_TRY(ml_kernel_scratch(h, &scr, dev, ML_KSCRATCH(h, dev, sumsq, most), e));
    ml_kctx c = ml_host_kctx(h);
    double total = 0;
    ml_status s = ML_OK;
    for (int64_t i = 0; i < n && s == ML_OK; i++) {
        double ss = 0;                  /* stays 0 in a plan */
        s = ML_KCALL(h, dev, sumsq, t[i]->dtype, &ss, ml_data(t[i]), ml_numel(t[i]),
                     scr.st ? ml_data(&scr) : NULL, &c);
        total += ss;
    }
    ml_tensor_drop(&scr);
    if (s == ML_OK)
        *sumsq = total;
    return ml_kernel_status(s, e);
}

ml_status ml_op_grad_norm(ml_host *h, const ml_tensor *const *t, int64_t n, double *norm,
                          ml_err *e)
{
    ML_TRY(ml_op_grad_sumsq(h, t, n, norm, e));
    *norm = sqrt(*norm);
    return ML_OK;
}

/* x *= f, f rounded to x's dtype once (one slice). */
static ml_status scale(ml_host *h, ml_tensor *x, double f, const ml_kctx *c, ml_err *e)
{
    return ml_kernel_status(ML_KCALL(h, x->st->device, scale_slices, x->dtype, ml_data(x), &f,
                                     ml_numel(x), 1, c), e);
}

ml_status ml_op_clip_grad_norm(ml_host *h, ml_tensor *const *t, int64_t n, double max_norm,
                               double *norm, ml_err *e)
{
    *norm = 0;
    if (!(max_norm >= 0))
        return ml_err_set(e, ML_EINVAL, "max_norm must be >= 0, got %g", max_norm);
    ML_TRY(ml_op_grad_norm(h, (const ml_tensor *const *)t, n, norm, e));
    double coef = max_norm / (*norm + ML_CLIP_EPS);
    if (!isfinite(*norm) || !(coef < 1))
        return ML_OK;
    ml_kctx c = ml_host_kctx(h);
    for (int64_t i = 0; i < n; i++)
        ML_TRY(scale(h, t[i], coef, &c, e));
    return ML_OK;
}

ml_status ml_op_slice_norms(ml_host *h, ml_tensor *norms, const ml_tensor *x, int64_t E,
                            ml_err *e)
{
    ml_device dev = ml_tensor_device(x);
    ML_TRY(check_flat(x, "grads", dev, e));
    ML_TRY(check_slices(x, "grads", E, e));
    ML_TRY(ml_prepare_output(h, norms, "out", dev, ML_F64, 1, &E, e));
    ml_tensor scr = {0};
    ML_TRY(ml_kernel_scratch(h, &scr, dev, ML_KSCRATCH(h, dev, slice_norms, ml_numel(x), E), e));
    ml_kctx c = ml_host_kctx(h);
    ml_status s = ML_KCALL(h, dev, slice_norms, x->dtype, ml_data(norms), ml_data(x),
                           ml_numel(x), E, scr.st ? ml_data(&scr) : NULL, &c);
    ml_tensor_drop(&scr);
    return ml_kernel_status(s, e);
}

ml_status ml_op_scale(ml_host *h, ml_tensor *x, double factor, ml_err *e)
{
    ML_TRY(check_flat(x, "x", ml_tensor_device(x), e));
    if (!isfinite(factor))
        return ml_err_set(e, ML_EINVAL, "factor must be finite, got %g", factor);
    ml_kctx c = ml_host_kctx(h);
    return scale(h, x, factor, &c, e);
}

ml_status ml_op_clip_slices(ml_host *h, ml_tensor *x, int64_t E, const double *bounds,
                            ml_tensor *norms, ml_err *e)
{
    ml_device dev = ml_tensor_device(x);
    ML_TRY(check_flat(x, "grads", dev, e));
    ML_TRY(check_slices(x, "grads", E, e));
    for (int64_t i = 0; i < E; i++)
        if (!(bounds[i] >= 0) || isinf(bounds[i]))
            return ml_err_set(e, ML_EINVAL, "bounds[%lld] must be finite and >= 0, got %g",
                              (long long)i + 1, bounds[i]);
    ML_TRY(ml_op_slice_norms(h, norms, x, E, e));
    if (h->planning)
        return ML_OK;                   /* no norms to read */
    int64_t S = ml_numel(x) / E;
    size_t es = ml_dtype_size(x->dtype);
    double nrm[CHUNK], f[CHUNK];
    ml_kctx c = ml_host_kctx(h);
    for (int64_t e0 = 0; e0 < E; e0 += CHUNK) {
        int64_t k = min64(CHUNK, E - e0);
        ML_TRY(ml_read_back(h, norms, e0, k, nrm, e));
        for (int64_t i = 0; i < k; i++) {
            double q = bounds[e0 + i] / (nrm[i] + ML_CLIP_EPS);
            f[i] = isfinite(nrm[i]) && q < 1.0 ? q : 1.0;   /* a non-finite norm: the caller's */
        }
        char *at = (char *)ml_data(x) + (size_t)(e0 * S) * es;
        ML_TRY(ml_kernel_status(ML_KCALL(h, dev, scale_slices, x->dtype, at, f, k * S, k, &c), e));
    }
    return ML_OK;
}
