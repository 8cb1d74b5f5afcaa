/*
 * host/runtime/comm.c - collectives over MPI and NCCL (host/runtime/comm.h):
 * every operation is a request (started with an MPI_I* call, or an NCCL
 * group on the communicator's stream ending in a completion event; waited
 * for by polling MPI_Test or the event up to the timeout) that holds its
 * buffers; blocking calls wait for theirs, and a request whose wait timed
 * out is handed to the communicator, which keeps its buffers until it
 * completes. NCCL is reached through a table (host/runtime/comm_nccl.h),
 * which a CPU build lacks.
 */
#include "comm.h"
#include "comm_nccl.h"

#include <limits.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* MPI is process-wide: whether this process initialized / finalized it. */
static int mpi_up, mpi_down;

/* The buffers of operations that never completed, held until MPI is
 * finalized (it may still write them): then ml_comm_finalize returns them
 * to their books, so the exit's ledger check sees no leak. */
static ml_storage **abandoned;
static size_t nabandoned, cap_abandoned;

static void abandon(ml_storage *st)
{
    if (nabandoned == cap_abandoned) {
        size_t cap = cap_abandoned ? 2 * cap_abandoned : 16;
        ml_storage **a = realloc(abandoned, cap * sizeof *a);
        if (!a)
            return;   /* kept for the process's life: the exit check reports it */
        abandoned = a;
        cap_abandoned = cap;
    }
    abandoned[nabandoned++] = st;
}

#ifdef ML_WITH_CUDA
static const ml_nccl_api *const nx = &ml_nccl_cuda;
#else
static int no_nccl(char *why, size_t len)
{
    snprintf(why, len, "this build has no CUDA (make CUDA=1)");
    return -1;
}

/* never asked for more: c->nccl stays NULL */
static const ml_nccl_api no_nccl_api = {.usable = no_nccl};
static const ml_nccl_api *const nx = &no_nccl_api;
#endif

typedef enum {
    OP_SETUP, OP_ALL_GATHER, OP_REDUCE_SCATTER, OP_ALL_REDUCE, OP_NUMBERS, OP_BROADCAST,
    OP_ALL_TO_ALL_V, OP_BARRIER, OP_SPLIT, NOPS
} comm_opcode;

static const char *const op_names[NOPS] = {
    "communicator setup", "all-gather", "reduce-scatter", "all-reduce", "numbers all-reduce",
    "broadcast", "all-to-all-v", "barrier", "communicator split"
};
static const char *const reduce_names[] = {"sum", "max", "min"};

#define WHAT_LEN 128     /* `what` kept for messages */
#define FP_WHAT_LEN 48   /* `what` carried in a fingerprint */
#define CONTEXT_LEN 64
#define GROUP_LEN 64     /* a group's name: "ep(color 1)" */
#define DESC_LEN 512     /* a described collective */
#define MAX_HELD 4
#define WHY_LEN 512      /* an NCCL or CUDA error's text */

/* One collective as messages and fingerprints name it. */
typedef struct {
    comm_opcode op;
    ml_dtype dtype;
    int64_t count;      /* elements (all-to-all-v: of one row) */
    int64_t arg;        /* a broadcast's root, a numbers all-reduce's ml_comm_op */
    uint64_t seq;       /* this rank's collective number, from 1 */
    char what[WHAT_LEN];
    char context[CONTEXT_LEN];
} coll_desc;

/* What the ranks compare in debug mode; fixed size, no padding. */
typedef struct {
    int32_t op, dtype;
    int64_t count, arg;
    uint64_t hash, seq;
    char what[FP_WHAT_LEN];
} fingerprint;

struct ml_comm_req {
    ml_comm *c;                 /* NULL once complete (or given up by ml_comm_free) */
    MPI_Request mpi;
    void *done;                 /* an NCCL operation's completion event (MPI: NULL) */
    ml_storage *held[MAX_HELD]; /* buffers retained until completion */
    int nheld;
    int orphan;                 /* its caller gave up on it: c frees it on completion */
    coll_desc d;
    ml_comm_req *next;          /* in c->pending */
};

struct ml_comm {
    ml_host *h;
    int rank, world;
    int world_rank;             /* this process's rank in the world communicator */
    MPI_Comm mc;                /* a duplicate of MPI_COMM_WORLD, a split of the parent's, or
                                   MPI_COMM_NULL */
    ml_comm *parent;            /* a group's: the communicator it was split from (held) */
    ml_comm *children;          /* groups split from this one, linked by `sibling` */
    ml_comm *sibling;
    int refs;                   /* the owner's, plus one per group split from it */
    char group[GROUP_LEN];      /* a group's name in messages; "" for the world */
    double timeout;
    int debug;
    uint64_t seq;
    char context[CONTEXT_LEN];
    char broken[1024];          /* non-empty: the error that made c unusable */
    ml_comm_req *pending;
    ml_nccl *nccl;              /* CUDA tensors' communicator, or NULL */
    char no_nccl[256];          /* why nccl is NULL, when world > 1 */
    int planned;                /* a planned world's (ml_comm_init_planned): no MPI */
};

/* ---- time, messages ---------------------------------------------------------- */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Sleeps of 50 us, doubling up to 1 ms: quick answers for short waits,
 * little CPU taken from the rank we wait for (2 cores, 4 ranks). */
static void nap(long *ns)
{
    nanosleep(&(struct timespec){0, *ns}, NULL);
    *ns = *ns * 2 < 1000000 ? *ns * 2 : 1000000;
}

/* "all-gather of unit X (step 3, collective #17 of rank 2)"; in a group,
 * "all-gather of unit X (group ep(color 1), step 3, collective #17 of rank
 * 1, world rank 3)" (the number and rank are the group's). */
static void describe(const ml_comm *c, const coll_desc *d, char *buf, size_t len)
{
    char group[GROUP_LEN + 8] = "", world[32] = "";
    if (c->parent) {
        snprintf(group, sizeof group, "group %s, ", c->group);
        snprintf(world, sizeof world, ", world rank %d", c->world_rank);
    }
    snprintf(buf, len, "%s%s%s (%s%s%scollective #%llu of rank %d%s)", op_names[d->op],
             d->what[0] ? " of " : "", d->what, group, d->context, d->context[0] ? ", " : "",
             (unsigned long long)d->seq, c->rank, world);
}

static ml_status fail_broken(const ml_comm *c, ml_err *e)
{
    return ml_err_set(e, ML_EIO, "%s", c->broken);
}

/* c becomes unusable with this message, returned in e. */
static ml_status break_comm(ml_comm *c, ml_err *e, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static ml_status break_comm(ml_comm *c, ml_err *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->broken, sizeof c->broken, fmt, ap);
    va_end(ap);
    if (c->nccl)
        nx->abort(c->nccl);   /* NCCL kernels that wait for a peer stop */
    return fail_broken(c, e);
}

static ml_status mpi_failed(ml_comm *c, const coll_desc *d, const char *call, int rc, ml_err *e)
{
    char s[MPI_MAX_ERROR_STRING], what[DESC_LEN];
    int n;
    if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS)
        snprintf(s, sizeof s, "error %d", rc);
    describe(c, d, what, sizeof what);
    return break_comm(c, e, "%s: %s failed: %s", what, call, s);
}

/* The timeout message of every wait; `prefix` ("fingerprint exchange
 * before ") starts it. */
static ml_status timed_out(ml_comm *c, const coll_desc *d, const char *prefix, ml_err *e)
{
    char what[DESC_LEN];
    describe(c, d, what, sizeof what);
    return break_comm(c, e, "%s%s did not complete within %g s: a rank stopped, died or called a "
                      "different collective", prefix, what, c->timeout);
}

static ml_status nccl_failed(ml_comm *c, const coll_desc *d, ml_nccl_status ns, const char *why,
                             ml_err *e)
{
    char what[DESC_LEN];
    if (ns == ML_NCCL_TIMEOUT)
        return timed_out(c, d, "", e);
    describe(c, d, what, sizeof what);
    return break_comm(c, e, "%s: %s", what, why);
}

/* ---- requests ----------------------------------------------------------------- */

/* A new request, complete until req_start. */
static ml_status req_new(const coll_desc *d, ml_comm_req **out, ml_err *e)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return ml_err_set(e, ML_EALLOC, "out of memory for a request");
    (*out)->mpi = MPI_REQUEST_NULL;
    (*out)->d = *d;
    return ML_OK;
}

static void req_hold(ml_comm_req *r, const ml_tensor *t)
{
    ml_storage_retain(t->st);
    r->held[r->nheld++] = t->st;
}

static void req_release(ml_comm_req *r)
{
    for (int i = 0; i < r->nheld; i++)
        ml_storage_release(r->held[i]);
    r->nheld = 0;
}

/* r, not started, is released and freed. */
static void req_drop(ml_comm_req *r)
{
    req_release(r);
    free(r);
}

static void req_pending(ml_comm *c, ml_comm_req *r)
{
    r->c = c;
    r->next = c->pending;
    c->pending = r;
}

/* The MPI_I* call that started r returned rc: r is pending on c, or
 * (refused) released and freed. */
static ml_status req_start(ml_comm *c, ml_comm_req *r, const char *call, int rc, ml_err *e)
{
    if (rc != MPI_SUCCESS) {
        coll_desc d = r->d;
        req_drop(r);
        return mpi_failed(c, &d, call, rc, e);
    }
    req_pending(c, r);
    return ML_OK;
}

/* An NCCL operation of r being queued: the status of its calls so far. */
typedef struct {
    ml_nccl_status s;
    int began;
    char why[WHY_LEN];
} nccl_op;

static void op_begin(ml_comm *c, nccl_op *o)
{
    o->s = nx->begin(c->nccl, o->why, sizeof o->why);
    o->began = o->s == ML_NCCL_OK;
}

static void op_send(ml_comm *c, nccl_op *o, const void *buf, size_t bytes, int peer)
{
    if (o->s == ML_NCCL_OK && bytes > 0)
        o->s = nx->send(c->nccl, buf, bytes, peer, o->why, sizeof o->why);
}

static void op_recv(ml_comm *c, nccl_op *o, void *buf, size_t bytes, int peer)
{
    if (o->s == ML_NCCL_OK && bytes > 0)
        o->s = nx->recv(c->nccl, buf, bytes, peer, o->why, sizeof o->why);
}

/* The group of o ends: r is pending on c with its completion event, or
 * (failed) released and freed, c broken. */
static ml_status op_start(ml_comm *c, ml_comm_req *r, nccl_op *o, ml_err *e)
{
    if (o->began) {
        char why[WHY_LEN];
        ml_nccl_status s = nx->end(c->nccl, c->timeout, &r->done, why, sizeof why);
        if (o->s == ML_NCCL_OK && s != ML_NCCL_OK) {
            o->s = s;
            memcpy(o->why, why, sizeof why);
        }
    }
    if (o->s != ML_NCCL_OK) {
        if (r->done)
            nx->done(r->done);
        coll_desc d = r->d;
        req_drop(r);
        return nccl_failed(c, &d, o->s, o->why, e);
    }
    req_pending(c, r);
    return ML_OK;
}

/* r has completed: its buffers go back; an orphan is freed. */
static void req_complete(ml_comm_req *r)
{
    for (ml_comm_req **p = &r->c->pending; *p; p = &(*p)->next) {
        if (*p == r) {
            *p = r->next;
            break;
        }
    }
    req_release(r);
    r->c = NULL;
    if (r->orphan)
        free(r);
}

/* One test of the pending r (MPI_Test, or a query of its NCCL event):
 * *done = 1 when it completed (r may be freed). An error breaks c. */
static ml_status req_poll(ml_comm_req *r, int *done, ml_err *e)
{
    ml_comm *c = r->c;
    *done = 0;
    if (r->done) {
        char why[WHY_LEN];
        int q = nx->query(c->nccl, r->done, why, sizeof why);
        if (q < 0)
            return nccl_failed(c, &r->d, ML_NCCL_ERROR, why, e);
        if (q == 0)
            return ML_OK;
        nx->done(r->done);   /* the compute stream waits for the operation */
        r->done = NULL;
    } else {
        int flag = 0, rc = MPI_Test(&r->mpi, &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_failed(c, &r->d, "MPI_Test", rc, e);
        if (!flag)
            return ML_OK;
    }
    req_complete(r);
    *done = 1;
    return ML_OK;
}

/* Wait for r until the timeout; `prefix` ("fingerprint exchange before ")
 * starts the timeout message. */
static ml_status req_wait(ml_comm_req *r, const char *prefix, ml_err *e)
{
    ml_comm *c = r->c;
    if (!c)
        return ML_OK;
    if (c->broken[0])
        return fail_broken(c, e);
    double deadline = now() + c->timeout;
    long ns = 50000;
    for (;;) {
        int done;
        ML_TRY(req_poll(r, &done, e));
        if (done)
            return ML_OK;
        if (now() >= deadline)
            return timed_out(c, &r->d, prefix, e);
        nap(&ns);
    }
}

/* A blocking call's wait: r is freed, or handed to c when it is still
 * pending (a timeout): c keeps its buffers. */
static ml_status req_finish(ml_comm_req *r, const char *prefix, ml_err *e)
{
    ml_status s = req_wait(r, prefix, e);
    if (r->c)
        r->orphan = 1;
    else
        free(r);
    return s;
}

ml_status ml_comm_wait(ml_comm *c, ml_comm_req *req, ml_err *e)
{
    return req_wait(req, "", e);
}

ml_status ml_comm_test(ml_comm *c, ml_comm_req *req, int *done, ml_err *e)
{
    *done = 1;
    if (!req->c)
        return ML_OK;
    if (req->c->broken[0])
        return fail_broken(req->c, e);
    return req_poll(req, done, e);
}

void ml_comm_req_free(ml_comm_req *req)
{
    ml_err e;
    if (!req)
        return;
    if (req->c && req_wait(req, "", &e) != ML_OK && req->c) {
        req->orphan = 1;
        return;
    }
    free(req);
}

void ml_comm_progress(ml_comm *c)
{
    for (ml_comm_req *r = c->pending, *next; r; r = next) {
        next = r->next;
        int done;
        ml_err e;
        req_poll(r, &done, &e);   /* an error broke c: the next call reports it */
    }
    for (ml_comm *g = c->children; g; g = g->sibling)
        ml_comm_progress(g);
}

/* ---- setup -------------------------------------------------------------------- */

int ml_comm_launched(void)
{
    return getenv("PMI_SIZE") != NULL;
}

static ml_status init_mpi(ml_err *e)
{
    if (mpi_down)
        return ml_err_set(e, ML_EIO, "MPI was finalized: no communicator can be made any more");
    if (mpi_up)
        return ML_OK;
    int provided = MPI_THREAD_SINGLE;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return ml_err_set(e, ML_EIO, "MPI_Init_thread failed");
    mpi_up = 1;
    if (provided < MPI_THREAD_FUNNELED)
        return ml_err_set(e, ML_EIO, "MPI provides thread level %d, moelua needs "
                          "MPI_THREAD_FUNNELED (%d)", provided, MPI_THREAD_FUNNELED);
    return ML_OK;
}

/* c->mc = a duplicate of MPI_COMM_WORLD (non-blocking, so a rank that never
 * comes is a timeout). On a timeout c stays allocated: MPI still owns
 * &c->mc. */
static ml_status dup_world(ml_comm *c, ml_err *e)
{
    coll_desc d = {.op = OP_SETUP};
    ml_comm_req *r;
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    ML_TRY(req_new(&d, &r, e));
    ML_TRY(req_start(c, r, "MPI_Comm_idup", MPI_Comm_idup(MPI_COMM_WORLD, &c->mc, &r->mpi), e));
    ML_TRY(req_finish(r, "", e));
    MPI_Comm_set_errhandler(c->mc, MPI_ERRORS_RETURN);
    MPI_Comm_size(c->mc, &c->world);
    c->world_rank = c->rank;
    return ML_OK;
}

/* A scratch tensor on dev in the ledger category `comm`. */
static ml_status comm_scratch(ml_comm *c, ml_tensor *t, ml_device dev, ml_dtype dt, int ndim,
                              const int64_t *dims, ml_err *e)
{
    ml_category saved = c->h->category;
    c->h->category = ML_CAT_COMM;
    ml_status s = ml_tensor_alloc(c->h, t, dev, dt, ndim, dims, e);
    c->h->category = saved;
    return s;
}

/* Can NCCL run on this rank (a CUDA device, libnccl.so.2)? 0 yes, -1
 * with the reason in c->no_nccl. */
static int nccl_usable_here(ml_comm *c)
{
    ml_host *h = c->h;
    if (!h->device_mem[ML_CUDA] || !h->device_mem[ML_CUDA]->available()) {
        snprintf(c->no_nccl, sizeof c->no_nccl, "no CUDA device: %s",
                 ml_device_unavailable_reason(h, ML_CUDA));
        return -1;
    }
    return nx->usable(c->no_nccl, sizeof c->no_nccl);
}

/* flags (comm scratch, held while MPI may write it: a timed-out exchange
 * keeps it) gets every rank's answer to nccl_usable_here in [0, world),
 * gathered over MPI with the timeout; when all are yes, rank 0's flag
 * "made an id" at [world] and the unique id after it, broadcast, and
 * *local = this rank's rank on its node. */
static ml_status nccl_bootstrap(ml_comm *c, ml_tensor *flags, int *local, ml_err *e)
{
    unsigned char *f = ml_data(flags);
    coll_desc d = {.op = OP_SETUP};
    snprintf(d.what, sizeof d.what, "NCCL bootstrap");
    ml_comm_req *r;
    ML_TRY(req_new(&d, &r, e));
    req_hold(r, flags);
    ML_TRY(req_start(c, r, "MPI_Iallgather", MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, f, 1,
                                                            MPI_BYTE, c->mc, &r->mpi), e));
    ML_TRY(req_finish(r, "", e));
    for (int q = 0; q < c->world; q++) {
        if (f[q])
            continue;
        if (q != c->rank)
            snprintf(c->no_nccl, sizeof c->no_nccl, "rank %d cannot use NCCL", q);
        return ML_OK;   /* every rank saw the same flags: no NCCL anywhere */
    }
    MPI_Comm node;   /* the node-local rank chooses the GPU (MPI_LOCALRANKID is only a hint) */
    if (MPI_Comm_split_type(c->mc, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node) !=
        MPI_SUCCESS)
        return break_comm(c, e, "NCCL bootstrap: MPI_Comm_split_type failed");
    MPI_Comm_rank(node, local);
    MPI_Comm_free(&node);
    if (c->rank == 0)
        f[c->world] = nx->unique_id(f + c->world + 1, c->no_nccl, sizeof c->no_nccl) == ML_NCCL_OK;
    ML_TRY(req_new(&d, &r, e));
    req_hold(r, flags);
    ML_TRY(req_start(c, r, "MPI_Ibcast", MPI_Ibcast(f + c->world, 1 + ML_NCCL_ID_BYTES, MPI_BYTE,
                                                    0, c->mc, &r->mpi), e));
    ML_TRY(req_finish(r, "", e));
    if (!f[c->world] && c->rank != 0)
        snprintf(c->no_nccl, sizeof c->no_nccl, "rank 0 could not make an NCCL unique id");
    return ML_OK;
}

/* c->nccl for CUDA tensors, when every rank can use NCCL and world > 1 or
 * `forced` (then an error when it cannot be had). */
static ml_status nccl_setup(ml_comm *c, int forced, ml_err *e)
{
    if (c->world == 1 && !forced)
        return ML_OK;
    ml_tensor flags = {0};
    int64_t bytes = c->world + 1 + ML_NCCL_ID_BYTES;
    ML_TRY(comm_scratch(c, &flags, ML_CPU, ML_U8, 1, &bytes, e));
    unsigned char *f = ml_data(&flags);
    f[c->rank] = nccl_usable_here(c) == 0;
    f[c->world] = 0;
    int local = 0;
    ml_status s = ML_OK;
    if (c->world > 1)
        s = nccl_bootstrap(c, &flags, &local, e);
    else if (f[0])
        f[1] = nx->unique_id(f + 2, c->no_nccl, sizeof c->no_nccl) == ML_NCCL_OK;
    if (s == ML_OK && f[c->world]) {
        char why[WHY_LEN];
        ml_nccl_status ns = nx->open(&c->nccl, f + c->world + 1, c->world, c->rank, local,
                                     c->timeout, why, sizeof why);
        if (ns != ML_NCCL_OK)
            s = break_comm(c, e, "NCCL communicator init on rank %d: %s", c->rank, why);
    } else if (s == ML_OK && forced) {
        s = ml_err_set(e, ML_EINVAL, "option nccl: NCCL cannot be used: %s", c->no_nccl);
    }
    ml_tensor_drop(&flags);
    return s;
}

static ml_status comm_make(ml_host *h, double timeout_s, int debug, int nccl, ml_comm **out,
                           ml_err *e)
{
    *out = NULL;
    if (!(timeout_s > 0) || !isfinite(timeout_s))
        return ml_err_set(e, ML_EINVAL, "timeout must be a finite number of seconds > 0, got %g",
                          timeout_s);
    ml_comm *c = calloc(1, sizeof *c);
    if (!c)
        return ml_err_set(e, ML_EALLOC, "out of memory for a communicator");
    *c = (ml_comm){.h = h, .rank = 0, .world = 1, .mc = MPI_COMM_NULL, .timeout = timeout_s,
                   .debug = debug, .refs = 1};
    if (ml_comm_launched()) {
        ml_status s = init_mpi(e);
        if (s == ML_OK)
            s = dup_world(c, e);
        if (s != ML_OK) {
            if (!c->pending)
                free(c);
            return s;
        }
    }
    ml_status s = nccl_setup(c, nccl, e);
    if (s != ML_OK) {
        ml_comm_free(c);
        return s;
    }
    *out = c;
    return ML_OK;
}

ml_status ml_comm_init(ml_host *h, double timeout_s, int debug, ml_comm **out, ml_err *e)
{
    return comm_make(h, timeout_s, debug, 0, out, e);
}

ml_status ml_comm_init_nccl(ml_host *h, double timeout_s, int debug, ml_comm **out, ml_err *e)
{
    return comm_make(h, timeout_s, debug, 1, out, e);
}

ml_status ml_comm_init_planned(ml_host *h, int rank, int world, double timeout_s, ml_comm **out,
                               ml_err *e)
{
    *out = NULL;
    if (world < 1 || rank < 0 || rank >= world)
        return ml_err_set(e, ML_EINVAL, "a planned world needs 0 <= rank < world, got rank %d of %d",
                          rank, world);
    if (ml_comm_launched())
        return ml_err_set(e, ML_EINVAL, "a planned world is for a process alone, not one under mpiexec");
    ml_comm *c = calloc(1, sizeof *c);
    if (!c)
        return ml_err_set(e, ML_EALLOC, "out of memory for a communicator");
    *c = (ml_comm){.h = h, .rank = rank, .world = world, .world_rank = rank, .mc = MPI_COMM_NULL,
                   .timeout = timeout_s, .refs = 1, .planned = 1};
    snprintf(c->no_nccl, sizeof c->no_nccl, "a planned world carries no data");
    *out = c;
    return ML_OK;
}

int ml_comm_planned(const ml_comm *c)
{
    return c->planned;
}

int ml_comm_nccl(const ml_comm *c)
{
    return c->nccl != NULL;
}

int ml_comm_rank(const ml_comm *c)
{
    return c->rank;
}

int ml_comm_world(const ml_comm *c)
{
    return c->world;
}

double ml_comm_timeout(const ml_comm *c)
{
    return c->timeout;
}

int ml_comm_debug(const ml_comm *c)
{
    return c->debug;
}

void ml_comm_set_context(ml_comm *c, const char *context)
{
    snprintf(c->context, sizeof c->context, "%s", context ? context : "");
}

/* g leaves its parent's list of groups and releases its hold on it. */
static void unlink_group(ml_comm *g)
{
    for (ml_comm **p = &g->parent->children; *p; p = &(*p)->sibling) {
        if (*p == g) {
            *p = g->sibling;
            break;
        }
    }
    ml_comm_free(g->parent);
}

void ml_comm_free(ml_comm *c)
{
    if (!c || --c->refs > 0)
        return;
    double deadline = now() + c->timeout;
    long ns = 50000;
    for (ml_comm_progress(c); c->pending && now() < deadline; ml_comm_progress(c))
        nap(&ns);
    int leaked = c->pending != NULL;
    while (c->pending) {   /* never completed: their buffers stay (MPI may still write) */
        ml_comm_req *r = c->pending;
        c->pending = r->next;
        for (int i = 0; i < r->nheld; i++)
            abandon(r->held[i]);
        r->nheld = 0;
        r->c = NULL;
        if (r->orphan)
            free(r);
    }
    if (c->nccl)   /* aborted when an operation is stuck: its kernels stop */
        nx->close(c->nccl, leaked || c->broken[0], c->timeout);
    if (c->mc != MPI_COMM_NULL && !leaked && !mpi_down)
        MPI_Comm_free(&c->mc);
    if (c->parent)
        unlink_group(c);
    free(c);
}

void ml_comm_finalize(void)
{
    if (mpi_up && !mpi_down) {
        MPI_Finalize();
        mpi_down = 1;
    }
    while (nabandoned)   /* nothing writes them now (NCCL's were aborted) */
        ml_storage_release(abandoned[--nabandoned]);
    free(abandoned);
    abandoned = NULL;
    cap_abandoned = 0;
}

int ml_comm_world_rank(void)
{
    int rank = 0;
    if (mpi_up && !mpi_down)
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return rank;
}

void ml_comm_abort(const char *msg)
{
    const char *size = getenv("PMI_SIZE");
    if (!size || atoi(size) <= 1 || mpi_down)
        return;
    ml_err e;
    if (init_mpi(&e) != ML_OK && !mpi_up)
        return;
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    /* An error every rank meets (a bad option, a mismatch the debug mode
     * found) is said once: rank 0's abort ends the others in this pause. */
    if (rank > 0)
        nanosleep(&(struct timespec){1, 0}, NULL);
    fprintf(stderr, "rank %d: %s\n", rank, msg);
    fflush(stderr);
    /* mpiexec forwards our stderr asynchronously and MPI_Abort kills every
     * rank at once: give the message 0.2 s to get out */
    nanosleep(&(struct timespec){0, 200000000}, NULL);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* ---- the start of every collective ------------------------------------------------ */

static uint64_t hash_text(const char *s)
{
    uint64_t x = 1469598103934665603ULL;   /* FNV-1a */
    for (; *s; s++)
        x = (x ^ (unsigned char)*s) * 1099511628211ULL;
    return x;
}

static fingerprint fingerprint_of(const coll_desc *d)
{
    fingerprint f = {.op = (int32_t)d->op, .dtype = (int32_t)d->dtype, .count = d->count,
                     .arg = d->arg, .hash = hash_text(d->what), .seq = d->seq};
    size_t n = strlen(d->what);
    memcpy(f.what, d->what, n < sizeof f.what ? n : sizeof f.what);   /* NUL-padded, maybe unterminated */
    return f;
}

static int same_call(const fingerprint *a, const fingerprint *b)
{
    return a->op == b->op && a->dtype == b->dtype && a->count == b->count && a->arg == b->arg &&
           a->hash == b->hash && a->seq == b->seq;
}

/* "all-gather of unit X (4096 elements of f32)" ("barrier of X"), then
 * " as #18" when its sequence number is not ref's. */
static void describe_fingerprint(const fingerprint *f, const fingerprint *ref, char *buf, size_t len)
{
    int op = f->op >= 0 && f->op < NOPS ? f->op : OP_SETUP;
    const char *dt = f->dtype >= 0 && f->dtype < ML_NDTYPES ? ml_dtype_names[f->dtype] : "?";
    int counted = op != OP_BARRIER && op != OP_SPLIT;
    size_t at = (size_t)snprintf(buf, len, "%s%s%.*s", op_names[op], f->what[0] ? " of " : "",
                                 FP_WHAT_LEN, f->what);
    if (at < len && counted)
        at += (size_t)snprintf(buf + at, len - at, " (%lld elements of %s", (long long)f->count, dt);
    if (at < len && op == OP_BROADCAST)
        at += (size_t)snprintf(buf + at, len - at, ", root %lld", (long long)f->arg);
    if (at < len && op == OP_NUMBERS && f->arg >= 0 && f->arg <= ML_COMM_MIN)
        at += (size_t)snprintf(buf + at, len - at, ", %s", reduce_names[f->arg]);
    if (at < len && counted)
        at += (size_t)snprintf(buf + at, len - at, ")");
    if (at < len && f->seq != ref->seq)
        snprintf(buf + at, len - at, " as #%llu", (unsigned long long)f->seq);
}

/* Debug mode: every rank's fingerprint of this collective, compared with
 * rank 0's; the first rank that differs is named on every rank. */
static ml_status check_fingerprint(ml_comm *c, const coll_desc *d, ml_err *e)
{
    ml_tensor all = {0};
    int64_t bytes = (int64_t)c->world * (int64_t)sizeof(fingerprint);
    ML_TRY(comm_scratch(c, &all, ML_CPU, ML_U8, 1, &bytes, e));
    fingerprint *fp = ml_data(&all);
    fp[c->rank] = fingerprint_of(d);
    ml_comm_req *r;
    ml_status s = req_new(d, &r, e);
    if (s == ML_OK) {
        req_hold(r, &all);
        s = req_start(c, r, "MPI_Iallgather",
                      MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, fp, (int)sizeof *fp, MPI_BYTE, c->mc,
                                     &r->mpi), e);
        if (s == ML_OK)
            s = req_finish(r, "fingerprint exchange before ", e);
    }
    for (int q = 1; s == ML_OK && q < c->world; q++) {
        if (same_call(&fp[0], &fp[q]))
            continue;
        char a[256], b[256];
        describe_fingerprint(&fp[0], &fp[0], a, sizeof a);
        describe_fingerprint(&fp[q], &fp[0], b, sizeof b);
        s = break_comm(c, e, "%s%s%scollective mismatch at #%llu: rank 0 calls %s, rank %d calls %s",
                       c->parent ? "group " : "", c->group, c->parent ? ": " : "",
                       (unsigned long long)fp[0].seq, a, q, b);
    }
    ml_tensor_drop(&all);
    return s;
}

/* Fail fast when c is broken; number the collective; compare fingerprints
 * in debug mode. */
static ml_status begin(ml_comm *c, coll_desc *d, comm_opcode op, ml_dtype dt, int64_t count,
                       int64_t arg, const char *what, ml_err *e)
{
    if (c->broken[0])
        return fail_broken(c, e);
    if (c->planned)
        return ml_err_set(e, ML_EINVAL, "%s: a planned world of %d ranks (moelua plan --world) runs "
                          "collectives only inside a memory plan", what && what[0] ? what : "collective",
                          c->world);
    *d = (coll_desc){.op = op, .dtype = dt, .count = count, .arg = arg, .seq = ++c->seq};
    snprintf(d->what, sizeof d->what, "%s", what ? what : "");
    const ml_comm *k = c;   /* a group without a context of its own shows its parent's */
    while (!k->context[0] && k->parent)
        k = k->parent;
    memcpy(d->context, k->context, sizeof d->context);
    return c->debug && c->world > 1 ? check_fingerprint(c, d, e) : ML_OK;
}

/* ---- argument checks, devices -------------------------------------------------------- */

/* t is live, contiguous, on dev (the first tensor's), of a dtype in dtypes. */
static ml_status check_buffer(const ml_tensor *t, const char *name, ml_device dev, unsigned dtypes,
                              ml_err *e)
{
    return ml_check_input(t, name, dev, dtypes, t->ndim, 1, e);
}

/* n elements (rows) in one MPI count. */
static ml_status check_count(int64_t n, const char *name, ml_err *e)
{
    if (n <= INT_MAX)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s: %lld elements (rows) in one message, more than MPI's "
                      "int count %d", name, (long long)n, INT_MAX);
}

/* full has parts * n elements. */
static ml_status check_parts(const ml_tensor *full, const char *name, int64_t n, int parts,
                             const char *of, ml_err *e)
{
    if (ml_numel(full) == n * parts)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s has %lld elements but must have world (%d) x %s (%lld) = "
                      "%lld", name, (long long)ml_numel(full), parts, of, (long long)n,
                      (long long)(n * parts));
}

/* Is shard exactly full's slice [rank*n, (rank+1)*n)? Else it must not
 * overlap full. */
static ml_status own_slice(const ml_tensor *shard, const ml_tensor *full, int rank, int *in_place,
                           ml_err *e)
{
    int64_t n = ml_numel(shard);
    *in_place = n > 0 && shard->st == full->st && shard->offset == full->offset + rank * n;
    if (*in_place || !ml_tensors_overlap(shard, full))
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "shard overlaps full but is not its slice [rank*n, (rank+1)*n) "
                      "(rank %d)", rank);
}

/* How tensors on dev travel: *nccl = over NCCL (CUDA tensors when c has
 * it); otherwise over MPI (CPU tensors), or not at all in world 1 (local
 * copies and sums on the tensors' device). CUDA tensors in a larger world
 * without NCCL are refused (a plan, which exchanges nothing, goes on). */
static ml_status route(const ml_comm *c, ml_device dev, int *nccl, ml_err *e)
{
    *nccl = dev != ML_CPU && c->nccl;
    if (dev == ML_CPU || *nccl || c->world == 1 || c->h->planning)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "CUDA tensors need NCCL, which this communicator does not "
                      "have: %s", c->no_nccl);
}

/* An MPI type of `bytes` contiguous bytes (one element or one row). */
static int contiguous_type(int64_t bytes, MPI_Datatype *t)
{
    int rc = MPI_Type_contiguous((int)bytes, MPI_BYTE, t);
    return rc == MPI_SUCCESS ? MPI_Type_commit(t) : rc;
}

/* n elements of dt from src to dst on dev, ordered on the compute stream. */
static ml_status copy_elems(ml_comm *c, ml_device dev, void *dst, const void *src, int64_t n,
                            ml_dtype dt, ml_err *e)
{
    if (n <= 0 || dst == src)
        return ML_OK;
    ml_status s = c->h->mem[dev]->memcpy(dst, src, (size_t)n * ml_dtype_size(dt),
                                         dev == ML_CPU ? ML_COPY_H2H : ML_COPY_D2D, NULL);
    return s == ML_OK ? ML_OK : ml_kernel_status(s, e);
}

/* ---- all-gather ------------------------------------------------------------------- */

/* Start the all-gather of d (checked, numbered) in r. */
static ml_status gather_start(ml_comm *c, const coll_desc *d, const ml_tensor *shard,
                              ml_tensor *full, int in_place, int nccl, ml_comm_req **out,
                              ml_err *e)
{
    int64_t n = ml_numel(shard);
    size_t es = ml_dtype_size(shard->dtype);
    ML_TRY(req_new(d, out, e));
    ml_comm_req *r = *out;
    if (!nccl && c->world == 1) {
        ml_status s = in_place ? ML_OK : copy_elems(c, ml_tensor_device(full), ml_data(full),
                                                    ml_data(shard), n, shard->dtype, e);
        if (s != ML_OK) {
            req_drop(r);
            *out = NULL;
        }
        return s;
    }
    req_hold(r, shard);
    req_hold(r, full);
    ml_status s;
    if (nccl) {   /* in place, shard is full's slice: NCCL's own in-place form */
        nccl_op o;
        op_begin(c, &o);
        if (o.s == ML_NCCL_OK && n > 0)
            o.s = nx->all_gather(c->nccl, ml_data(shard), ml_data(full), (size_t)n * es, o.why,
                                 sizeof o.why);
        s = op_start(c, r, &o, e);
    } else {
        MPI_Datatype ty;
        int rc = contiguous_type((int64_t)es, &ty);
        if (rc == MPI_SUCCESS) {
            rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : ml_data(shard), (int)n, ty,
                                ml_data(full), (int)n, ty, c->mc, &r->mpi);
            MPI_Type_free(&ty);   /* a pending operation keeps the type it uses */
        }
        s = req_start(c, r, "MPI_Iallgather", rc, e);
    }
    if (s != ML_OK)
        *out = NULL;
    return s;
}

/* The checks of a shard/full pair (all-gather: shard in, full out;
 * reduce-scatter: full in, shard out): both on the input's device, of
 * `dtypes` and the input's dtype; full holds world shards; *n = the
 * shard's elements, *in_place = shard is full's own slice, *nccl = the
 * route. */
static ml_status check_shard_full(ml_comm *c, const ml_tensor *shard, const ml_tensor *full,
                                  int gather, unsigned dtypes, int64_t *n, int *in_place, int *nccl,
                                  ml_err *e)
{
    const ml_tensor *in = gather ? shard : full, *out = gather ? full : shard;
    const char *in_name = gather ? "shard" : "full", *out_name = gather ? "full" : "shard";
    ml_device dev = ml_tensor_device(in);
    ML_TRY(check_buffer(in, in_name, dev, dtypes, e));
    ML_TRY(check_buffer(out, out_name, dev, dtypes, e));
    ML_TRY(ml_check_same_dtype(out, out_name, in_name, in->dtype, e));
    *n = ml_numel(shard);
    ML_TRY(check_parts(full, "full", *n, c->world, "shard's numel", e));
    ML_TRY(check_count(*n, "shard", e));
    ML_TRY(own_slice(shard, full, c->rank, in_place, e));
    return route(c, dev, nccl, e);
}

ml_status ml_comm_all_gather(ml_comm *c, const ml_tensor *shard, ml_tensor *full, const char *what,
                             ml_comm_req **req, ml_err *e)
{
    if (req)
        *req = NULL;
    int64_t n;
    int in_place, nccl;
    ML_TRY(check_shard_full(c, shard, full, 1, ML_DT_ANY, &n, &in_place, &nccl, e));
    coll_desc d = {0};
    ml_comm_req *r;
    if (c->h->planning)
        return req ? req_new(&d, req, e) : ML_OK;
    ML_TRY(begin(c, &d, OP_ALL_GATHER, shard->dtype, n, 0, what, e));
    ML_TRY(gather_start(c, &d, shard, full, in_place, nccl, &r, e));
    if (req) {
        *req = r;
        return ML_OK;
    }
    return req_finish(r, "", e);
}

/* ---- reduce-scatter and all-reduce ------------------------------------------------- */

/* out (n elements) = (accumulate ? out : nothing) + rows[0] + rows[1] + ...
 * (rows: [nrows, n], contiguous, not overlapping out unless nrows is 1),
 * one elementwise add per row in rank order, in the dtype's own arithmetic,
 * on out's device (the compute stream): the same result on every rank,
 * every device and over MPI or NCCL. */
static ml_status rank_sum(ml_comm *c, const ml_tensor *rows, int nrows, ml_tensor *out, int64_t n,
                          int accumulate, ml_err *e)
{
    ml_device dev = ml_tensor_device(out);
    ml_kctx k = ml_host_kctx(c->h);
    const char *row = ml_data(rows);
    size_t bytes = (size_t)n * ml_dtype_size(out->dtype);
    void *o = ml_data(out);
    if (n == 0)
        return ML_OK;
    if (!accumulate && nrows == 1)
        return copy_elems(c, dev, o, row, n, out->dtype, e);
    ml_status s = ML_OK;
    int r = 0;
    if (!accumulate) {
        s = ML_KCALL(c->h, dev, binary, ML_ADD, out->dtype, o, row, row + bytes, n, n, n, &k);
        r = 2;
    }
    for (; s == ML_OK && r < nrows; r++)
        s = ML_KCALL(c->h, dev, binary, ML_ADD, out->dtype, o, o, row + r * bytes, n, n, n, &k);
    return s == ML_OK ? ML_OK : ml_kernel_status(s, e);
}

/* Start the exchange of pieces in r: piece q of full (n elements) goes to
 * rank q, rank q's piece `rank` lands in pieces' row q. */
static ml_status pieces_start(ml_comm *c, ml_comm_req *r, const ml_tensor *full, ml_tensor *pieces,
                              int64_t n, int nccl, ml_err *e)
{
    size_t es = ml_dtype_size(full->dtype), bytes = (size_t)n * es;
    req_hold(r, full);
    req_hold(r, pieces);
    if (nccl) {   /* an all-to-all: every rank's send and receive, one group */
        const char *src = ml_data(full);
        char *dst = ml_data(pieces);
        nccl_op o;
        op_begin(c, &o);
        for (int q = 0; q < c->world; q++) {
            op_send(c, &o, src + (size_t)q * bytes, bytes, q);
            op_recv(c, &o, dst + (size_t)q * bytes, bytes, q);
        }
        return op_start(c, r, &o, e);
    }
    MPI_Datatype ty;
    int rc = contiguous_type((int64_t)es, &ty);
    if (rc == MPI_SUCCESS) {
        rc = MPI_Ialltoall(ml_data(full), (int)n, ty, ml_data(pieces), (int)n, ty, c->mc, &r->mpi);
        MPI_Type_free(&ty);
    }
    return req_start(c, r, "MPI_Ialltoall", rc, e);
}

/* out (n elements) = (accumulate ? out : nothing) + the rank-order sum of
 * every rank's piece `rank` of full (world * n elements): pieces exchanged
 * (MPI_Ialltoall, or NCCL sends and receives) into a [world, n] scratch on
 * full's device. out may be inside full. */
static ml_status scatter_sum(ml_comm *c, const coll_desc *d, const ml_tensor *full, ml_tensor *out,
                             int64_t n, int accumulate, int nccl, ml_err *e)
{
    if (!nccl && c->world == 1)
        return rank_sum(c, full, 1, out, n, accumulate, e);
    ml_tensor pieces = {0};
    int64_t dims[2] = {c->world, n};
    ML_TRY(comm_scratch(c, &pieces, ml_tensor_device(full), full->dtype, 2, dims, e));
    ml_comm_req *r;
    ml_status s = req_new(d, &r, e);
    if (s == ML_OK)
        s = pieces_start(c, r, full, &pieces, n, nccl, e);
    if (s == ML_OK)
        s = req_finish(r, "", e);
    if (s == ML_OK)
        s = rank_sum(c, &pieces, c->world, out, n, accumulate, e);
    ml_tensor_drop(&pieces);   /* CUDA: the sum is queued before any later use of the block */
    return s;
}

ml_status ml_comm_reduce_scatter(ml_comm *c, const ml_tensor *full, ml_tensor *shard,
                                 int accumulate, const char *what, ml_err *e)
{
    int64_t n;
    int in_place, nccl;
    ML_TRY(check_shard_full(c, shard, full, 0, ML_DT_FLOAT, &n, &in_place, &nccl, e));
    if (c->h->planning) {
        ml_tensor pieces = {0};
        int64_t dims[2] = {c->world, n};
        ML_TRY(comm_scratch(c, &pieces, ml_tensor_device(full), full->dtype, 2, dims, e));
        ml_tensor_drop(&pieces);
        return ML_OK;
    }
    coll_desc d;
    ML_TRY(begin(c, &d, OP_REDUCE_SCATTER, full->dtype, n, 0, what, e));
    return scatter_sum(c, &d, full, shard, n, accumulate, nccl, e);
}

/* The slice [i0, i0 + n) of the contiguous t, as a 1-dim view that holds
 * no reference (valid while t is). */
static ml_tensor slice_of(const ml_tensor *t, int64_t i0, int64_t n)
{
    ml_tensor v = *t;
    v.offset += i0;
    v.ndim = 1;
    v.shape[0] = n;
    v.stride[0] = 1;
    return v;
}

/* pad (all elements) = t (total elements), then zeros. */
static ml_status pad_copy(ml_comm *c, ml_tensor *pad, const ml_tensor *t, int64_t total,
                          int64_t all, ml_err *e)
{
    ml_device dev = ml_tensor_device(t);
    ML_TRY(copy_elems(c, dev, ml_data(pad), ml_data(t), total, t->dtype, e));
    ml_kctx k = ml_host_kctx(c->h);
    ml_status s = ML_KCALL(c->h, dev, fill, t->dtype,
                           (char *)ml_data(pad) + (size_t)total * ml_dtype_size(t->dtype), 0.0,
                           all - total, &k);
    return s == ML_OK ? ML_OK : ml_kernel_status(s, e);
}

ml_status ml_comm_all_reduce(ml_comm *c, ml_tensor *t, const char *what, ml_err *e)
{
    ml_device dev = ml_tensor_device(t);
    ML_TRY(check_buffer(t, "t", dev, ML_DT_FLOAT, e));
    int64_t total = ml_numel(t), m = (total + c->world - 1) / c->world;
    ML_TRY(check_count(m, "t", e));
    int nccl;
    ML_TRY(route(c, dev, &nccl, e));
    int padded = m * c->world != total;
    ml_tensor pad = {0}, pieces = {0};
    int64_t dims[2] = {c->world, m}, all = m * c->world;
    if (c->h->planning) {
        ml_status s = padded ? comm_scratch(c, &pad, dev, t->dtype, 1, &all, e) : ML_OK;
        if (s == ML_OK && (c->world > 1 || nccl))
            s = comm_scratch(c, &pieces, dev, t->dtype, 2, dims, e);
        ml_tensor_drop(&pieces);
        ml_tensor_drop(&pad);
        return s;
    }
    coll_desc d;
    ML_TRY(begin(c, &d, OP_ALL_REDUCE, t->dtype, total, 0, what, e));
    if (!nccl && c->world == 1)
        return ML_OK;
    ml_status s = ML_OK;
    if (padded) {
        ML_TRY(comm_scratch(c, &pad, dev, t->dtype, 1, &all, e));
        s = pad_copy(c, &pad, t, total, all, e);
    }
    ml_tensor *full = padded ? &pad : t;
    ml_tensor mine = slice_of(full, c->rank * m, m);
    ml_comm_req *r;
    if (s == ML_OK)
        s = scatter_sum(c, &d, full, &mine, m, 0, nccl, e);
    if (s == ML_OK)
        s = gather_start(c, &d, &mine, full, 1, nccl, &r, e);
    if (s == ML_OK)
        s = req_finish(r, "", e);
    if (s == ML_OK && padded)
        s = copy_elems(c, dev, ml_data(t), ml_data(&pad), total, t->dtype, e);
    ml_tensor_drop(&pad);
    return s;
}

ml_status ml_comm_all_reduce_f64(ml_comm *c, double *v, int n, ml_comm_op op, const char *what,
                                 ml_err *e)
{
    if (n < 0 || (n > 0 && !v))
        return ml_err_set(e, ML_EINVAL, "numbers: %d values at %p", n, (void *)v);
    if (op < ML_COMM_SUM || op > ML_COMM_MIN)
        return ml_err_set(e, ML_EINVAL, "op must be ML_COMM_SUM, ML_COMM_MAX or ML_COMM_MIN, got %d",
                          (int)op);
    if (c->h->planning)
        return ML_OK;
    coll_desc d;
    ML_TRY(begin(c, &d, OP_NUMBERS, ML_F64, n, op, what, e));
    if (c->world == 1 || n == 0)
        return ML_OK;
    /* every rank's values in one scratch (v itself never reaches MPI: a
     * timed-out exchange keeps its buffers, v is the caller's) */
    ml_tensor all = {0};
    int64_t dims[2] = {c->world, n};
    ML_TRY(comm_scratch(c, &all, ML_CPU, ML_F64, 2, dims, e));
    double *a = ml_data(&all);
    memcpy(a + (int64_t)c->rank * n, v, (size_t)n * sizeof *v);
    ml_comm_req *r;
    ml_status s = req_new(&d, &r, e);
    if (s == ML_OK) {
        req_hold(r, &all);
        s = req_start(c, r, "MPI_Iallgather", MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DOUBLE, a, n,
                                                             MPI_DOUBLE, c->mc, &r->mpi), e);
    }
    if (s == ML_OK)
        s = req_finish(r, "", e);
    for (int i = 0; s == ML_OK && i < n; i++) {
        double x = a[i];
        for (int q = 1; q < c->world; q++) {
            double y = a[(int64_t)q * n + i];
            if (op == ML_COMM_SUM)
                x += y;
            else if (isnan(y) || (op == ML_COMM_MAX ? y > x : y < x))
                x = y;   /* a NaN once in x stays: no comparison with it is true */
        }
        v[i] = x;
    }
    ml_tensor_drop(&all);
    return s;
}

/* ---- broadcast, all-to-all-v, barrier ----------------------------------------------- */

ml_status ml_comm_broadcast(ml_comm *c, ml_tensor *t, int root, const char *what, ml_err *e)
{
    ml_device dev = ml_tensor_device(t);
    ML_TRY(check_buffer(t, "t", dev, ML_DT_ANY, e));
    if (root < 0 || root >= c->world)
        return ml_err_set(e, ML_EINVAL, "root must be a rank in [0, %d), got %d", c->world, root);
    int64_t n = ml_numel(t);
    ML_TRY(check_count(n, "t", e));
    int nccl;
    ML_TRY(route(c, dev, &nccl, e));
    if (c->h->planning)
        return ML_OK;
    coll_desc d;
    ML_TRY(begin(c, &d, OP_BROADCAST, t->dtype, n, root, what, e));
    if (!nccl && c->world == 1)
        return ML_OK;
    ml_comm_req *r;
    ML_TRY(req_new(&d, &r, e));
    req_hold(r, t);
    size_t es = ml_dtype_size(t->dtype);
    if (nccl) {
        nccl_op o;
        op_begin(c, &o);
        if (o.s == ML_NCCL_OK && n > 0)
            o.s = nx->broadcast(c->nccl, ml_data(t), (size_t)n * es, root, o.why, sizeof o.why);
        ML_TRY(op_start(c, r, &o, e));
    } else {
        MPI_Datatype ty;
        int rc = contiguous_type((int64_t)es, &ty);
        if (rc == MPI_SUCCESS) {
            rc = MPI_Ibcast(ml_data(t), (int)n, ty, root, c->mc, &r->mpi);
            MPI_Type_free(&ty);
        }
        ML_TRY(req_start(c, r, "MPI_Ibcast", rc, e));
    }
    return req_finish(r, "", e);
}

/* Elements of one row of t (dim 0 indexes rows). */
static int64_t row_numel(const ml_tensor *t)
{
    return ml_shape_numel(t->ndim - 1, t->shape + 1);
}

/* rows[0..world) >= 0 with a sum that fits t's rows and an int. */
static ml_status check_rows(const ml_comm *c, const int64_t *rows, const ml_tensor *t,
                            const char *name, const char *tname, ml_err *e)
{
    int64_t sum = 0;
    for (int q = 0; q < c->world; q++) {
        if (rows[q] < 0)
            return ml_err_set(e, ML_EINVAL, "%s for rank %d is %lld (rows must be >= 0)", name, q,
                              (long long)rows[q]);
        sum += rows[q];
        if (sum > t->shape[0])
            return ml_err_set(e, ML_EINVAL, "%s add up to more than the %lld rows of %s", name,
                              (long long)t->shape[0], tname);
    }
    return check_count(sum, name, e);
}

/* counts (rows per rank) and their displacements, in an i32 scratch of
 * [4, world] held by the request: MPI reads them until it completes. */
static ml_status alltoallv_counts(ml_comm *c, const int64_t *send_rows, const int64_t *recv_rows,
                                  ml_tensor *t, ml_err *e)
{
    int64_t dims[2] = {4, c->world};
    ML_TRY(comm_scratch(c, t, ML_CPU, ML_I32, 2, dims, e));
    int *sc = ml_data(t), *sd = sc + c->world, *rc = sd + c->world, *rd = rc + c->world;
    for (int q = 0, s = 0, r = 0; q < c->world; q++) {
        sc[q] = (int)send_rows[q];
        rc[q] = (int)recv_rows[q];
        sd[q] = s;
        rd[q] = r;
        s += sc[q];
        r += rc[q];
    }
    return ML_OK;
}

/* Debug mode: every rank's send_rows and recv_rows, gathered, so that every
 * rank finds a pair that disagrees (rows sent that the peer does not
 * expect are lost, rows it expects and is not sent keep what recv held:
 * MPI and NCCL say nothing). */
static ml_status check_row_counts(ml_comm *c, const coll_desc *d, const int64_t *send_rows,
                                  const int64_t *recv_rows, ml_err *e)
{
    int w = c->world;
    ml_tensor all = {0};
    int64_t dims[2] = {w, 2 * w};
    ML_TRY(comm_scratch(c, &all, ML_CPU, ML_I64, 2, dims, e));
    int64_t *k = ml_data(&all);   /* row q: rank q's send_rows, then its recv_rows */
    memcpy(k + (size_t)c->rank * 2 * w, send_rows, (size_t)w * sizeof *k);
    memcpy(k + (size_t)c->rank * 2 * w + w, recv_rows, (size_t)w * sizeof *k);
    ml_comm_req *r;
    ml_status s = req_new(d, &r, e);
    if (s == ML_OK) {
        req_hold(r, &all);
        s = req_start(c, r, "MPI_Iallgather",
                      MPI_Iallgather(MPI_IN_PLACE, 0, MPI_BYTE, k, 2 * w * (int)sizeof *k, MPI_BYTE, c->mc,
                                     &r->mpi), e);
        if (s == ML_OK)
            s = req_finish(r, "row count exchange before ", e);
    }
    for (int a = 0; s == ML_OK && a < w; a++)
        for (int b = 0; s == ML_OK && b < w; b++) {
            int64_t sent = k[(size_t)a * 2 * w + b], expected = k[(size_t)b * 2 * w + w + a];
            if (sent == expected)
                continue;
            char what[DESC_LEN];
            describe(c, d, what, sizeof what);
            s = break_comm(c, e, "%s: rank %d sends %lld rows to rank %d, which expects %lld (send_rows and "
                           "recv_rows disagree)", what, a, (long long)sent, b, (long long)expected);
        }
    ml_tensor_drop(&all);
    return s;
}

/* all-to-all-v of d over NCCL: one group of a send and a receive of rows
 * per rank (none for 0 rows), then a wait. */
static ml_status rows_nccl(ml_comm *c, const coll_desc *d, const ml_tensor *send,
                           const int64_t *send_rows, ml_tensor *recv, const int64_t *recv_rows,
                           size_t row_bytes, ml_err *e)
{
    ml_comm_req *r;
    ML_TRY(req_new(d, &r, e));
    req_hold(r, send);
    req_hold(r, recv);
    const char *src = ml_data(send);
    char *dst = ml_data(recv);
    nccl_op o;
    op_begin(c, &o);
    for (int q = 0; q < c->world; q++) {
        op_send(c, &o, src, (size_t)send_rows[q] * row_bytes, q);
        op_recv(c, &o, dst, (size_t)recv_rows[q] * row_bytes, q);
        src += (size_t)send_rows[q] * row_bytes;
        dst += (size_t)recv_rows[q] * row_bytes;
    }
    ML_TRY(op_start(c, r, &o, e));
    return req_finish(r, "", e);
}

ml_status ml_comm_all_to_all_v(ml_comm *c, const ml_tensor *send, const int64_t *send_rows,
                               ml_tensor *recv, const int64_t *recv_rows, const char *what,
                               ml_err *e)
{
    ml_device dev = ml_tensor_device(send);
    ML_TRY(ml_check_input(send, "send", dev, ML_DT_ANY, -1, 1, e));
    ML_TRY(ml_check_input(recv, "recv", dev, ML_DT_ANY, -1, 1, e));
    ML_TRY(ml_check_same_dtype(recv, "recv", "send", send->dtype, e));
    int nccl;
    ML_TRY(route(c, dev, &nccl, e));
    int64_t row = row_numel(send);
    if (row_numel(recv) != row)
        return ml_err_set(e, ML_EINVAL, "recv's rows have %lld elements but send's have %lld",
                          (long long)row_numel(recv), (long long)row);
    int64_t row_bytes = row * (int64_t)ml_dtype_size(send->dtype);
    if (!nccl && row_bytes > INT_MAX)
        return ml_err_set(e, ML_EINVAL, "send's rows have %lld bytes, more than MPI's int count",
                          (long long)row_bytes);
    ML_TRY(check_rows(c, send_rows, send, "send_rows", "send", e));
    ML_TRY(check_rows(c, recv_rows, recv, "recv_rows", "recv", e));
    if (ml_tensors_overlap(send, recv))
        return ml_err_set(e, ML_EINVAL, "send and recv overlap");
    if (c->world == 1 && send_rows[0] != recv_rows[0])
        return ml_err_set(e, ML_EINVAL, "send_rows (%lld) and recv_rows (%lld) for rank 0 differ",
                          (long long)send_rows[0], (long long)recv_rows[0]);
    ml_tensor counts = {0};
    if (c->h->planning) {
        ml_status s = c->world > 1 && !nccl ? alltoallv_counts(c, send_rows, recv_rows, &counts, e)
                                            : ML_OK;
        ml_tensor_drop(&counts);
        return s;
    }
    coll_desc d;
    ML_TRY(begin(c, &d, OP_ALL_TO_ALL_V, send->dtype, row, 0, what, e));
    if (c->debug && c->world > 1)
        ML_TRY(check_row_counts(c, &d, send_rows, recv_rows, e));
    if (nccl)
        return rows_nccl(c, &d, send, send_rows, recv, recv_rows, (size_t)row_bytes, e);
    if (c->world == 1)
        return copy_elems(c, dev, ml_data(recv), ml_data(send), send_rows[0] * row, send->dtype, e);
    ML_TRY(alltoallv_counts(c, send_rows, recv_rows, &counts, e));
    int *k = ml_data(&counts), w = c->world;
    ml_comm_req *r;
    ml_status s = req_new(&d, &r, e);
    if (s == ML_OK) {
        MPI_Datatype ty;
        int rc = contiguous_type(row_bytes, &ty);
        if (rc == MPI_SUCCESS) {
            req_hold(r, send);
            req_hold(r, recv);
            req_hold(r, &counts);
            rc = MPI_Ialltoallv(ml_data(send), k, k + w, ty, ml_data(recv), k + 2 * w, k + 3 * w,
                                ty, c->mc, &r->mpi);
            MPI_Type_free(&ty);
        }
        s = req_start(c, r, "MPI_Ialltoallv", rc, e);
    }
    if (s == ML_OK)
        s = req_finish(r, "", e);
    ml_tensor_drop(&counts);
    return s;
}

ml_status ml_comm_barrier(ml_comm *c, const char *what, ml_err *e)
{
    if (c->h->planning)
        return ML_OK;
    coll_desc d;
    ML_TRY(begin(c, &d, OP_BARRIER, ML_U8, 0, 0, what, e));
    if (c->world == 1)
        return ML_OK;
    ml_comm_req *r;
    ML_TRY(req_new(&d, &r, e));
    ML_TRY(req_start(c, r, "MPI_Ibarrier", MPI_Ibarrier(c->mc, &r->mpi), e));
    return req_finish(r, "", e);
}

/* ---- groups ------------------------------------------------------------------------- */

/* g->mc = c's ranks of this color (MPI_Comm_split, ordered by key then
 * rank). MPI_Comm_split blocks and has no non-blocking form: a barrier
 * under the timeout comes first, so a rank that never comes is a timeout
 * of the split, and every rank that passes it is in the split at once. */
static ml_status split_mpi(ml_comm *c, const coll_desc *d, ml_comm *g, int color, int key,
                           ml_err *e)
{
    ml_comm_req *r;
    ML_TRY(req_new(d, &r, e));
    ML_TRY(req_start(c, r, "MPI_Ibarrier", MPI_Ibarrier(c->mc, &r->mpi), e));
    ML_TRY(req_finish(r, "", e));
    int rc = MPI_Comm_split(c->mc, color, key, &g->mc);
    if (rc != MPI_SUCCESS)
        return mpi_failed(c, d, "MPI_Comm_split", rc, e);
    MPI_Comm_set_errhandler(g->mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(g->mc, &g->rank);
    MPI_Comm_size(g->mc, &g->world);
    return ML_OK;
}

/* g, made, joins c's groups. */
static void adopt_group(ml_comm *c, ml_comm *g)
{
    g->parent = c;
    c->refs++;
    g->sibling = c->children;
    c->children = g;
}

ml_status ml_comm_planned_group(ml_comm *c, int rank, int world, const char *label, ml_comm **out,
                                ml_err *e)
{
    *out = NULL;
    if (!c->planned)
        return ml_err_set(e, ML_EINVAL, "a group of given rank and world is for a planned world only "
                          "(split a real one)");
    if (world < 1 || rank < 0 || rank >= world || world > c->world)
        return ml_err_set(e, ML_EINVAL, "a planned group needs 0 <= rank < world <= %d, got rank %d "
                          "of %d", c->world, rank, world);
    ml_comm *g = calloc(1, sizeof *g);
    if (!g)
        return ml_err_set(e, ML_EALLOC, "out of memory for a communicator");
    *g = (ml_comm){.h = c->h, .rank = rank, .world = world, .world_rank = c->world_rank,
                   .mc = MPI_COMM_NULL, .timeout = c->timeout, .refs = 1, .planned = 1};
    snprintf(g->group, sizeof g->group, "%s", label && label[0] ? label : "planned");
    snprintf(g->no_nccl, sizeof g->no_nccl, "a planned world carries no data");
    adopt_group(c, g);
    *out = g;
    return ML_OK;
}

ml_status ml_comm_split(ml_comm *c, int color, int key, const char *label, ml_comm **out,
                        ml_err *e)
{
    *out = NULL;
    if (c->planned)
        return ml_err_set(e, ML_EINVAL, "a planned world (moelua plan --world) cannot split: a split "
                          "needs every rank's color; make its groups with a given rank and world");
    if (color < 0)
        return ml_err_set(e, ML_EINVAL, "color must be an integer >= 0, got %d", color);
    if (key < 0)
        return ml_err_set(e, ML_EINVAL, "key must be an integer >= 0, got %d", key);
    coll_desc d;
    ML_TRY(begin(c, &d, OP_SPLIT, ML_U8, 0, 0, label, e));
    ml_comm *g = calloc(1, sizeof *g);
    if (!g)
        return ml_err_set(e, ML_EALLOC, "out of memory for a communicator");
    *g = (ml_comm){.h = c->h, .rank = 0, .world = 1, .world_rank = c->world_rank,
                   .mc = MPI_COMM_NULL, .timeout = c->timeout, .debug = c->debug, .refs = 1};
    snprintf(g->group, sizeof g->group, "%s%scolor %d%s", label && label[0] ? label : "",
             label && label[0] ? "(" : "", color, label && label[0] ? ")" : "");
    if (c->mc != MPI_COMM_NULL) {
        ml_status s = split_mpi(c, &d, g, color, key, e);
        if (s != ML_OK) {
            free(g);
            return s;
        }
    }
    if (g->world > 1 && c->nccl) {   /* the members open the group's own NCCL communicator */
        ml_status s = nccl_setup(g, 0, e);
        if (s != ML_OK) {
            ml_comm_free(g);   /* (not adopted yet) */
            return s;
        }
    } else if (g->world > 1) {
        snprintf(g->no_nccl, sizeof g->no_nccl, "%s", c->no_nccl);
    }
    adopt_group(c, g);
    *out = g;
    return ML_OK;
}
