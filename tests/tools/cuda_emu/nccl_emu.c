/*
 * tests/tools/cuda_emu/nccl_emu.c - a stand-in libnccl.so.2 for the
 * emulated build of the whole program (moelua.sh): exactly the NCCL calls
 * host/runtime/comm_nccl.c looks up, carried by MPI point-to-point
 * messages. Under mpiexec the program has initialised MPI (funneled:
 * every call here comes from its main thread); "device" buffers are host
 * memory, so a buffer goes to MPI as it is, and streams are ignored.
 *
 * A communicator may be a subset of the world and only its members call
 * init, so nothing here is collective over MPI_COMM_WORLD:
 * ncclGetUniqueId writes its caller's world rank and a counter into the
 * id; at init each member sends (its rank, its world rank) to that
 * creator, which must be a member, with the counter as tag (on
 * MPI_COMM_WORLD, which moelua itself leaves unused: it talks on a
 * duplicate); the creator answers with the world rank of every rank, and
 * the members make their own MPI communicator of those (collective over
 * the members only). Operations are nonblocking MPI calls on it:
 * collectives on one tag (members call them in the same order, and MPI
 * keeps the order per source and tag), send/recv on another; a send to
 * itself is a copy, paired in order with the receive of the same group.
 * A communicator of one rank sends no message, so it works without MPI
 * (a process not under mpiexec). Calls inside ncclGroupStart/End are
 * posted at once and complete at the group's end, a call outside a group
 * as a group of its own. A communicator made with
 * config->blocking = 0 answers ncclInProgress until its init or
 * operations complete, checked by ncclCommGetAsyncError, as NCCL does;
 * otherwise the call waits.
 *
 * Not here: reductions (comm_nccl.c reduces on the device itself), any
 * other NCCL call, a creator outside the communicator.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>
#include <nccl.h>

#define EMU_ID_MAGIC 0x6d6c6e63u   /* "mlnc": an id made by this library */
#define EMU_TAG_COLL 1
#define EMU_TAG_P2P 2
#define EMU_MSG 256   /* bytes of an error message */
#define EMU_CHUNK ((size_t)1 << 30)   /* bytes per MPI message: counts are ints */

/* A send or receive to itself, waiting for its other half. */
typedef struct {
    void *buf;
    size_t bytes;
} emu_self;

typedef struct {
    unsigned magic;
    int root;      /* the creator's world rank */
    int tag;       /* the creator's counter */
} emu_id;

_Static_assert(sizeof(emu_id) <= sizeof(ncclUniqueId), "emu_id fits in ncclUniqueId");

/* Init: members post their hello and wait for the table; the creator
 * gathers the hellos, then sends the table. */
enum { INIT_GATHER, INIT_ANSWER, INIT_DONE };

struct ncclComm {
    int nranks, rank, blocking;
    emu_id id;
    int stage;              /* INIT_* */
    int *table;             /* [nranks] world rank of each rank */
    int *hello;             /* [2 * nranks] (rank, world rank) received or sent */
    MPI_Comm mc;            /* the members, ranked as here; MPI_COMM_NULL until INIT_DONE */
    MPI_Request *req;       /* [nreq] posted, not known complete */
    int nreq, cap;
    int in_group;           /* has operations in the open group */
    emu_self *self;         /* [nself] sends to itself (self_sends) or receives, unpaired */
    int nself, self_cap, self_sends;
    ncclResult_t error;     /* the first failure: every later call answers it */
    char last[EMU_MSG];
};

static char last_error[EMU_MSG];   /* ncclGetLastError(NULL) */
static int group_depth;
static ncclComm_t *grouped;    /* [ngrouped] communicators with operations in the group */
static int ngrouped, grouped_cap;

static ncclResult_t fail(ncclComm_t c, ncclResult_t rc, const char *fmt, ...)
{
    char *buf = c ? c->last : last_error;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, EMU_MSG, fmt, ap);
    va_end(ap);
    if (c && c->error == ncclSuccess)
        c->error = rc;
    return rc;
}

static ncclResult_t mpi_fail(ncclComm_t c, const char *call, int rc)
{
    char msg[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(rc, msg, &n);
    return fail(c, ncclSystemError, "%s: %s", call, msg);
}

static int tag_ub(void)
{
    int *ub, flag = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag);
    return flag ? *ub : 32767;
}

static int mpi_ready(void)
{
    int up = 0, down = 0;
    MPI_Initialized(&up);
    MPI_Finalized(&down);
    return up && !down;
}

/* This process's world rank: 0 without MPI. */
static int world_rank(void)
{
    int r = 0;
    if (mpi_ready())
        MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *out)
{
    static int counter;
    emu_id id = {.magic = EMU_ID_MAGIC, .root = world_rank(),
                 .tag = mpi_ready() ? counter++ % tag_ub() : 0};
    memset(out, 0, sizeof *out);
    memcpy(out->internal, &id, sizeof id);
    return ncclSuccess;
}

/* Room in the growable array *arr (n of *cap elements of `elem` bytes
 * used) for one more: doubling, from 8; 0, or -1 when out of memory. */
static int grow(void *arr, int n, int *cap, size_t elem)
{
    if (n < *cap)
        return 0;
    int more = *cap ? 2 * *cap : 8;
    void *p = realloc(*(void **)arr, (size_t)more * elem);
    if (!p)
        return -1;
    *(void **)arr = p;
    *cap = more;
    return 0;
}

static ncclResult_t track(ncclComm_t c, MPI_Request r)
{
    if (grow(&c->req, c->nreq, &c->cap, sizeof *c->req) != 0)
        return fail(c, ncclSystemError, "out of memory for MPI requests");
    c->req[c->nreq++] = r;
    return ncclSuccess;
}

/* One buffer to or from rank peer of comm (world rank of MPI_COMM_WORLD),
 * in messages of at most EMU_CHUNK bytes. */
static ncclResult_t post(ncclComm_t c, MPI_Comm comm, int send, void *buf, size_t bytes, int peer,
                         int tag)
{
    do {
        size_t n = bytes < EMU_CHUNK ? bytes : EMU_CHUNK;
        MPI_Request r;
        int rc = send ? MPI_Isend(buf, (int)n, MPI_BYTE, peer, tag, comm, &r)
                      : MPI_Irecv(buf, (int)n, MPI_BYTE, peer, tag, comm, &r);
        if (rc != MPI_SUCCESS)
            return mpi_fail(c, send ? "MPI_Isend" : "MPI_Irecv", rc);
        ncclResult_t t = track(c, r);
        if (t != ncclSuccess)
            return t;
        buf = (char *)buf + n;
        bytes -= n;
    } while (bytes > 0);
    return ncclSuccess;
}

/* Whether every posted request of c completed: those that did are
 * forgotten; a blocking communicator waits for all. */
static ncclResult_t settle(ncclComm_t c, int *done)
{
    int left = 0;
    for (int i = 0; i < c->nreq; i++) {
        int flag = 1;
        int rc = c->blocking ? MPI_Wait(&c->req[i], MPI_STATUS_IGNORE)
                             : MPI_Test(&c->req[i], &flag, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_fail(c, c->blocking ? "MPI_Wait" : "MPI_Test", rc);
        if (!flag)
            c->req[left++] = c->req[i];
    }
    c->nreq = left;
    *done = left == 0;
    return ncclSuccess;
}

/* The members' own communicator, from the table (none for one rank). */
static ncclResult_t make_comm(ncclComm_t c)
{
    c->stage = INIT_DONE;
    if (c->nranks == 1)
        return ncclSuccess;
    MPI_Group world, members;
    MPI_Comm_group(MPI_COMM_WORLD, &world);
    int rc = MPI_Group_incl(world, c->nranks, c->table, &members);
    MPI_Group_free(&world);
    if (rc != MPI_SUCCESS)
        return mpi_fail(c, "MPI_Group_incl", rc);
    rc = MPI_Comm_create_group(MPI_COMM_WORLD, members, c->id.tag, &c->mc);
    MPI_Group_free(&members);
    if (rc != MPI_SUCCESS)
        return mpi_fail(c, "MPI_Comm_create_group", rc);
    MPI_Comm_set_errhandler(c->mc, MPI_ERRORS_RETURN);
    return ncclSuccess;
}

/* The creator has every hello: the table, sent to the others. */
static ncclResult_t answer(ncclComm_t c)
{
    for (int i = 0; i < c->nranks - 1; i++) {
        int r = c->hello[2 * i], w = c->hello[2 * i + 1];
        if (r < 0 || r >= c->nranks || r == c->rank || c->table[r] >= 0)
            return fail(c, ncclInvalidUsage, "ncclCommInitRankConfig: world rank %d says it is "
                        "rank %d of %d, taken or out of range", w, r, c->nranks);
        c->table[r] = w;
    }
    for (int r = 0; r < c->nranks; r++) {
        ncclResult_t t = r == c->rank ? ncclSuccess
                                      : post(c, MPI_COMM_WORLD, 1, c->table,
                                             (size_t)c->nranks * sizeof(int), c->table[r],
                                             c->id.tag);
        if (t != ncclSuccess)
            return t;
    }
    c->stage = INIT_ANSWER;
    return ncclSuccess;
}

/* Init moves on as far as its messages allow. */
static ncclResult_t init_progress(ncclComm_t c)
{
    while (c->stage != INIT_DONE) {
        int done = 0;
        ncclResult_t t = settle(c, &done);
        if (t != ncclSuccess || !done)
            return t;
        int creator = c->table[c->rank] == c->id.root;
        t = creator && c->stage == INIT_GATHER ? answer(c) : make_comm(c);
        if (t != ncclSuccess)
            return t;
    }
    return ncclSuccess;
}

/* The first messages of init: the creator's receives, or a member's hello
 * and its receive of the table. */
static ncclResult_t init_start(ncclComm_t c)
{
    if (c->nranks > 1 && !mpi_ready())
        return fail(c, ncclInvalidUsage, "ncclCommInitRankConfig: %d ranks need MPI, which is "
                    "not initialised (run under mpiexec)", c->nranks);
    int world = world_rank();
    for (int r = 0; r < c->nranks; r++)
        c->table[r] = -1;
    c->table[c->rank] = world;
    size_t pair = 2 * sizeof(int);
    if (world == c->id.root) {
        for (int i = 0; i < c->nranks - 1; i++) {
            ncclResult_t t = post(c, MPI_COMM_WORLD, 0, c->hello + 2 * i, pair, MPI_ANY_SOURCE,
                                  c->id.tag);
            if (t != ncclSuccess)
                return t;
        }
        return ncclSuccess;
    }
    c->hello[0] = c->rank;
    c->hello[1] = world;
    ncclResult_t t = post(c, MPI_COMM_WORLD, 1, c->hello, pair, c->id.root, c->id.tag);
    if (t == ncclSuccess)
        t = post(c, MPI_COMM_WORLD, 0, c->table, (size_t)c->nranks * sizeof(int), c->id.root,
                 c->id.tag);
    return t;
}

static void comm_free(ncclComm_t c)
{
    if (mpi_ready()) {
        for (int i = 0; i < c->nreq; i++) {
            if (c->req[i] == MPI_REQUEST_NULL)   /* completed by a failed settle */
                continue;
            MPI_Cancel(&c->req[i]);
            MPI_Request_free(&c->req[i]);
        }
        if (c->mc != MPI_COMM_NULL)
            MPI_Comm_free(&c->mc);
    }
    free(c->req);
    free(c->self);
    free(c->table);
    free(c->hello);
    free(c);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *out, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config)
{
    *out = NULL;
    emu_id id;
    memcpy(&id, commId.internal, sizeof id);
    if (id.magic != EMU_ID_MAGIC)
        return fail(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: an id not made by "
                    "ncclGetUniqueId of this library");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return fail(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: rank %d of %d", rank,
                    nranks);
    ncclComm_t c = calloc(1, sizeof *c);
    if (c) {
        c->table = malloc((size_t)nranks * sizeof *c->table);
        c->hello = malloc((size_t)nranks * 2 * sizeof *c->hello);
    }
    if (!c || !c->table || !c->hello) {
        if (c)
            comm_free(c);
        return fail(NULL, ncclSystemError, "ncclCommInitRankConfig: out of memory");
    }
    c->nranks = nranks;
    c->rank = rank;
    c->blocking = !config || config->blocking != 0;   /* NCCL's default is blocking */
    c->id = id;
    c->stage = INIT_GATHER;
    c->mc = MPI_COMM_NULL;
    *out = c;
    ncclResult_t t = init_start(c);
    if (t == ncclSuccess)
        t = init_progress(c);
    if (t != ncclSuccess)
        return t;
    return c->stage == INIT_DONE ? ncclSuccess : ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *async)
{
    if (c->error == ncclSuccess) {
        int done = 1;
        if (c->stage != INIT_DONE)
            init_progress(c);
        else
            settle(c, &done);
        if (c->error == ncclSuccess) {
            *async = c->stage == INIT_DONE && done ? ncclSuccess : ncclInProgress;
            return ncclSuccess;
        }
    }
    *async = c->error;
    return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t c)
{
    ncclResult_t async;
    ncclCommGetAsyncError(c, &async);
    return async;
}

ncclResult_t ncclCommDestroy(ncclComm_t c)
{
    if (c)
        comm_free(c);
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t c)
{
    return ncclCommDestroy(c);
}

const char *ncclGetErrorString(ncclResult_t rc)
{
    switch (rc) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

const char *ncclGetLastError(ncclComm_t c)
{
    return c ? c->last : last_error;
}

ncclResult_t ncclGroupStart(void)
{
    group_depth++;
    return ncclSuccess;
}

/* Every communicator of the group completes (or, nonblocking, is under
 * way: ncclCommGetAsyncError says when it completes). */
ncclResult_t ncclGroupEnd(void)
{
    if (group_depth == 0)
        return fail(NULL, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--group_depth > 0)
        return ncclSuccess;
    ncclResult_t rc = ncclSuccess;
    for (int i = 0; i < ngrouped; i++) {
        ncclComm_t c = grouped[i];
        c->in_group = 0;
        if (c->nself > 0)
            fail(c, ncclInvalidUsage, "a %s itself without its %s in the group",
                 c->self_sends ? "send to" : "receive from", c->self_sends ? "receive" : "send");
        c->nself = 0;
        int done = 0;
        ncclResult_t t = c->error != ncclSuccess ? c->error : settle(c, &done);
        if (t != ncclSuccess && (rc == ncclSuccess || rc == ncclInProgress))
            rc = t;
        else if (!done && rc == ncclSuccess)
            rc = ncclInProgress;
    }
    ngrouped = 0;
    return rc;
}

/* An operation's calls are about to be posted on c, a usable communicator,
 * in the open group (ncclGroupStart by the caller or by op_begin). */
static ncclResult_t op_begin(ncclComm_t c, const char *call)
{
    if (!c)
        return fail(NULL, ncclInvalidArgument, "%s: a NULL communicator", call);
    if (c->error != ncclSuccess)
        return c->error;
    if (c->stage != INIT_DONE)
        return fail(NULL, ncclInvalidUsage, "%s: the communicator's init has not completed",
                    call);
    if (!c->in_group) {
        if (grow(&grouped, ngrouped, &grouped_cap, sizeof *grouped) != 0)
            return fail(c, ncclSystemError, "out of memory for the group");
        grouped[ngrouped++] = c;
        c->in_group = 1;
    }
    return ncclSuccess;
}

/* The operation's result t; outside a group, it ends its own. */
static ncclResult_t op_end(ncclResult_t t, int own_group)
{
    if (!own_group)
        return t;
    ncclResult_t g = ncclGroupEnd();
    return t != ncclSuccess ? t : g;
}

static size_t type_size(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
    }
}

/* *bytes = count elements of t; an unknown type fails. */
/* An operation's start: its *bytes (count elements of t), then, called
 * outside a group, a group of its own (*own: op_end ends it), then
 * op_begin. An unknown data type fails before any group starts. */
static ncclResult_t op_enter(ncclComm_t c, const char *call, size_t count, ncclDataType_t t,
                             size_t *bytes, int *own)
{
    *bytes = count * type_size(t);
    *own = 0;
    if (!type_size(t))
        return fail(NULL, ncclInvalidArgument, "%s: unknown data type %d", call, (int)t);
    if (group_depth == 0) {
        ncclGroupStart();
        *own = 1;
    }
    return op_begin(c, call);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t c, cudaStream_t stream)
{
    size_t n;
    int own;
    ncclResult_t t = op_enter(c, "ncclAllGather", sendcount, datatype, &n, &own);
    char *out = recvbuff;
    if (t == ncclSuccess && n > 0)
        memmove(out + (size_t)c->rank * n, sendbuff, n);   /* in place when sendbuff is there */
    for (int r = 0; t == ncclSuccess && n > 0 && r < c->nranks; r++) {
        if (r == c->rank)
            continue;
        t = post(c, c->mc, 1, out + (size_t)c->rank * n, n, r, EMU_TAG_COLL);
        if (t == ncclSuccess)
            t = post(c, c->mc, 0, out + (size_t)r * n, n, r, EMU_TAG_COLL);
    }
    return op_end(t, own);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t c, cudaStream_t stream)
{
    size_t n;
    int own;
    ncclResult_t t = op_enter(c, "ncclBroadcast", count, datatype, &n, &own);
    if (t == ncclSuccess && (root < 0 || root >= c->nranks))
        t = fail(c, ncclInvalidArgument, "ncclBroadcast: root %d of %d ranks", root, c->nranks);
    if (t == ncclSuccess && n > 0 && c->rank == root) {
        memmove(recvbuff, sendbuff, n);
        for (int r = 0; t == ncclSuccess && r < c->nranks; r++)
            if (r != root)
                t = post(c, c->mc, 1, recvbuff, n, r, EMU_TAG_COLL);
    } else if (t == ncclSuccess && n > 0) {
        t = post(c, c->mc, 0, recvbuff, n, root, EMU_TAG_COLL);
    }
    return op_end(t, own);
}

/* A send to itself or a receive from itself: the copy when its other half
 * waits (the first, in order), else it waits. */
static ncclResult_t self_post(ncclComm_t c, int send, void *buf, size_t bytes)
{
    if (c->nself > 0 && c->self_sends != send) {
        emu_self o = c->self[0];
        if (o.bytes != bytes)
            return fail(c, ncclInvalidUsage, "a send of %zu bytes to itself met a receive of %zu",
                        send ? bytes : o.bytes, send ? o.bytes : bytes);
        memcpy(send ? o.buf : buf, send ? buf : o.buf, bytes);
        memmove(c->self, c->self + 1, (size_t)--c->nself * sizeof *c->self);
        return ncclSuccess;
    }
    if (grow(&c->self, c->nself, &c->self_cap, sizeof *c->self) != 0)
        return fail(c, ncclSystemError, "out of memory for sends to itself");
    c->self[c->nself++] = (emu_self){buf, bytes};
    c->self_sends = send;
    return ncclSuccess;
}

static ncclResult_t p2p(const char *call, int send, void *buf, size_t count,
                        ncclDataType_t datatype, int peer, ncclComm_t c)
{
    size_t n;
    int own;
    ncclResult_t t = op_enter(c, call, count, datatype, &n, &own);
    if (t == ncclSuccess && (peer < 0 || peer >= c->nranks))
        t = fail(c, ncclInvalidArgument, "%s: peer %d of %d ranks", call, peer, c->nranks);
    if (t == ncclSuccess && n > 0)
        t = peer == c->rank ? self_post(c, send, buf, n)
                            : post(c, c->mc, send, buf, n, peer, EMU_TAG_P2P);
    return op_end(t, own);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t c, cudaStream_t stream)
{
    return p2p("ncclSend", 1, (void *)sendbuff, count, datatype, peer, c);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t c, cudaStream_t stream)
{
    return p2p("ncclRecv", 0, recvbuff, count, datatype, peer, c);
}
