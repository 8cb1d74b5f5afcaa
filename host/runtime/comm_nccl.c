/*
 * host/runtime/comm_nccl.c - NCCL for comm.c (host/runtime/comm_nccl.h):
 * libnccl.so.2 loaded with dlopen on first use, a non-blocking
 * communicator polled up to a deadline, its stream and events.
 * `make CUDA=1` builds only.
 */
#include "comm_nccl.h"

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

_Static_assert(sizeof(ncclUniqueId) == ML_NCCL_ID_BYTES, "ncclUniqueId size");

struct ml_nccl {
    ncclComm_t comm;        /* NULL once aborted or failed */
    cudaStream_t stream;    /* the communicator's stream */
    cudaEvent_t ready;      /* the compute stream's point the stream waits for */
    int in_group;
};

/* The library, opened once. */
static struct {
    int tried;
    void *lib;
    char error[256];
    __typeof__(&ncclGetUniqueId) get_unique_id;
    __typeof__(&ncclCommInitRankConfig) init_rank_config;
    __typeof__(&ncclCommGetAsyncError) async_error;
    __typeof__(&ncclCommAbort) abort;
    __typeof__(&ncclCommFinalize) finalize;
    __typeof__(&ncclCommDestroy) destroy;
    __typeof__(&ncclGetErrorString) error_string;
    __typeof__(&ncclGetLastError) last_error;
    __typeof__(&ncclAllGather) all_gather;
    __typeof__(&ncclBroadcast) broadcast;
    __typeof__(&ncclSend) send;
    __typeof__(&ncclRecv) recv;
    __typeof__(&ncclGroupStart) group_start;
    __typeof__(&ncclGroupEnd) group_end;
} nc;

static int nccl_load(void)
{
    if (nc.tried)
        return nc.lib ? 0 : -1;
    nc.tried = 1;
    nc.lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!nc.lib) {
        const char *e = dlerror();
        snprintf(nc.error, sizeof nc.error, "cannot load NCCL: %s", e ? e : "libnccl.so.2");
        return -1;
    }
#define SYM(field, name)                                                        \
    if (!(*(void **)&nc.field = dlsym(nc.lib, name))) {                         \
        snprintf(nc.error, sizeof nc.error, "NCCL (libnccl.so.2) lacks %s", name); \
        dlclose(nc.lib);                                                        \
        nc.lib = NULL;                                                          \
        return -1;                                                              \
    }
    SYM(get_unique_id, "ncclGetUniqueId")
    SYM(init_rank_config, "ncclCommInitRankConfig")
    SYM(async_error, "ncclCommGetAsyncError")
    SYM(abort, "ncclCommAbort")
    SYM(finalize, "ncclCommFinalize")
    SYM(destroy, "ncclCommDestroy")
    SYM(error_string, "ncclGetErrorString")
    SYM(last_error, "ncclGetLastError")
    SYM(all_gather, "ncclAllGather")
    SYM(broadcast, "ncclBroadcast")
    SYM(send, "ncclSend")
    SYM(recv, "ncclRecv")
    SYM(group_start, "ncclGroupStart")
    SYM(group_end, "ncclGroupEnd")
#undef SYM
    return 0;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* "ncclAllGather: unhandled system error (remote process exited)" */
static ml_nccl_status nccl_error(const ml_nccl *n, const char *call, ncclResult_t rc, char *why,
                                 size_t len)
{
    const char *last = n && n->comm ? nc.last_error(n->comm) : NULL;
    snprintf(why, len, "%s: %s%s%s", call, nc.error_string(rc), last && *last ? ": " : "",
             last && *last ? last : "");
    return ML_NCCL_ERROR;
}

static ml_nccl_status cuda_error(const char *call, cudaError_t rc, char *why, size_t len)
{
    snprintf(why, len, "%s: %s (%d): %s", call, cudaGetErrorName(rc), (int)rc,
             cudaGetErrorString(rc));
    cudaGetLastError();
    return ML_NCCL_ERROR;
}

/* A non-blocking call answered rc: poll the communicator until it is no
 * longer in progress, at most until deadline. */
static ml_nccl_status settle(ml_nccl *n, const char *call, ncclResult_t rc, double deadline,
                             char *why, size_t len)
{
    while (rc == ncclInProgress) {
        if (now() >= deadline) {
            snprintf(why, len, "%s still in progress at the deadline", call);
            return ML_NCCL_TIMEOUT;
        }
        nanosleep(&(struct timespec){0, 100000}, NULL);
        ncclResult_t q = nc.async_error(n->comm, &rc);
        if (q != ncclSuccess)
            rc = q;
    }
    return rc == ncclSuccess ? ML_NCCL_OK : nccl_error(n, call, rc, why, len);
}

static int nccl_usable(char *why, size_t len)
{
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count <= 0) {
        snprintf(why, len, "no CUDA device (%s)",
                 ce != cudaSuccess ? cudaGetErrorString(ce) : "none found");
        cudaGetLastError();
        return -1;
    }
    if (nccl_load() != 0) {
        snprintf(why, len, "%s", nc.error);
        return -1;
    }
    return 0;
}

static ml_nccl_status nccl_unique_id(unsigned char id[ML_NCCL_ID_BYTES], char *why, size_t len)
{
    ncclUniqueId u;
    ncclResult_t rc = nc.get_unique_id(&u);
    if (rc != ncclSuccess)
        return nccl_error(NULL, "ncclGetUniqueId", rc, why, len);
    memcpy(id, u.internal, ML_NCCL_ID_BYTES);
    return ML_NCCL_OK;
}

static void nccl_abort(ml_nccl *n)
{
    if (n->comm)
        nc.abort(n->comm);
    n->comm = NULL;
}

static void nccl_close(ml_nccl *n, int abort, double timeout)
{
    if (!n)
        return;
    if (n->comm && !abort) {
        char why[256];
        ncclResult_t rc = nc.finalize(n->comm);
        abort = settle(n, "ncclCommFinalize", rc, now() + timeout, why, sizeof why) != ML_NCCL_OK;
        if (!abort)
            nc.destroy(n->comm);
    }
    if (abort)
        nccl_abort(n);
    n->comm = NULL;
    if (n->ready)
        cudaEventDestroy(n->ready);
    if (n->stream)
        cudaStreamDestroy(n->stream);
    cudaGetLastError();
    free(n);
}

static ml_nccl_status nccl_open(ml_nccl **out, const unsigned char id[ML_NCCL_ID_BYTES],
                                int world, int rank, int local_rank, double timeout, char *why,
                                size_t len)
{
    *out = NULL;
    int count = 0;
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count <= 0)
        return cuda_error("cudaGetDeviceCount", ce != cudaSuccess ? ce : cudaErrorNoDevice, why,
                          len);
    /* modulo: a launcher that gives each rank one GPU of its own
     * (CUDA_VISIBLE_DEVICES per rank) leaves every rank device 0; ranks
     * that do share a GPU are refused by NCCL ("Duplicate GPU detected") */
    if ((ce = cudaSetDevice(local_rank % count)) != cudaSuccess)
        return cuda_error("cudaSetDevice", ce, why, len);
    ml_nccl *n = calloc(1, sizeof *n);
    if (!n) {
        snprintf(why, len, "out of memory for the NCCL communicator");
        return ML_NCCL_ERROR;
    }
    ml_nccl_status s = ML_NCCL_OK;
    if ((ce = cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (ce = cudaEventCreateWithFlags(&n->ready, cudaEventDisableTiming)) != cudaSuccess)
        s = cuda_error("creating the NCCL stream and event", ce, why, len);
    if (s == ML_NCCL_OK) {
        ncclUniqueId u;
        memcpy(u.internal, id, ML_NCCL_ID_BYTES);
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0;
        ncclResult_t rc = nc.init_rank_config(&n->comm, world, u, rank, &config);
        if (rc != ncclSuccess && rc != ncclInProgress) {
            s = nccl_error(NULL, "ncclCommInitRankConfig", rc, why, len);
        } else {
            s = settle(n, "ncclCommInitRankConfig", rc, now() + timeout, why, len);
            if (s == ML_NCCL_TIMEOUT)
                snprintf(why, len, "NCCL communicator init did not complete within %g s: a rank "
                         "stopped, died or never called dist.init", timeout);
        }
    }
    if (s != ML_NCCL_OK) {
        nccl_close(n, 1, 0);
        return s;
    }
    *out = n;
    return ML_NCCL_OK;
}

static ml_nccl_status nccl_begin(ml_nccl *n, char *why, size_t len)
{
    if (!n->comm) {
        snprintf(why, len, "the NCCL communicator was aborted");
        return ML_NCCL_ERROR;
    }
    cudaError_t ce = cudaEventRecord(n->ready, 0);   /* the legacy default (compute) stream */
    if (ce == cudaSuccess)
        ce = cudaStreamWaitEvent(n->stream, n->ready, 0);
    if (ce != cudaSuccess)
        return cuda_error("ordering the NCCL stream after the compute stream", ce, why, len);
    ncclResult_t rc = nc.group_start();
    if (rc != ncclSuccess)
        return nccl_error(n, "ncclGroupStart", rc, why, len);
    n->in_group = 1;
    return ML_NCCL_OK;
}

/* A call inside the group: queued, so in progress is success. */
static ml_nccl_status queued(ml_nccl *n, const char *call, ncclResult_t rc, char *why, size_t len)
{
    return rc == ncclSuccess || rc == ncclInProgress ? ML_NCCL_OK
                                                     : nccl_error(n, call, rc, why, len);
}

static ml_nccl_status nccl_all_gather(ml_nccl *n, const void *send, void *recv, size_t bytes,
                                      char *why, size_t len)
{
    return queued(n, "ncclAllGather",
                  nc.all_gather(send, recv, bytes, ncclUint8, n->comm, n->stream), why, len);
}

static ml_nccl_status nccl_broadcast(ml_nccl *n, void *buf, size_t bytes, int root, char *why,
                                     size_t len)
{
    return queued(n, "ncclBroadcast",
                  nc.broadcast(buf, buf, bytes, ncclUint8, root, n->comm, n->stream), why, len);
}

static ml_nccl_status nccl_send(ml_nccl *n, const void *buf, size_t bytes, int peer, char *why,
                                size_t len)
{
    return queued(n, "ncclSend", nc.send(buf, bytes, ncclUint8, peer, n->comm, n->stream), why,
                  len);
}

static ml_nccl_status nccl_recv(ml_nccl *n, void *buf, size_t bytes, int peer, char *why,
                                size_t len)
{
    return queued(n, "ncclRecv", nc.recv(buf, bytes, ncclUint8, peer, n->comm, n->stream), why,
                  len);
}

static ml_nccl_status nccl_end(ml_nccl *n, double timeout, void **done, char *why, size_t len)
{
    *done = NULL;
    if (!n->in_group) {
        snprintf(why, len, "ml_nccl_end without ml_nccl_begin");
        return ML_NCCL_ERROR;
    }
    n->in_group = 0;
    ml_nccl_status s = settle(n, "ncclGroupEnd", nc.group_end(), now() + timeout, why, len);
    if (s != ML_NCCL_OK)
        return s;
    cudaEvent_t ev;
    cudaError_t ce = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (ce != cudaSuccess)
        return cuda_error("cudaEventCreateWithFlags", ce, why, len);
    if ((ce = cudaEventRecord(ev, n->stream)) != cudaSuccess) {
        cudaEventDestroy(ev);
        return cuda_error("cudaEventRecord", ce, why, len);
    }
    *done = ev;
    return ML_NCCL_OK;
}

static int nccl_query(ml_nccl *n, void *done, char *why, size_t len)
{
    cudaError_t ce = cudaEventQuery((cudaEvent_t)done);
    if (ce == cudaSuccess)
        return 1;
    if (ce != cudaErrorNotReady) {
        cuda_error("cudaEventQuery", ce, why, len);
        return -1;
    }
    ncclResult_t rc = ncclSuccess;
    if (n->comm && nc.async_error(n->comm, &rc) == ncclSuccess && rc != ncclSuccess &&
        rc != ncclInProgress) {
        nccl_error(n, "NCCL", rc, why, len);
        return -1;
    }
    return 0;
}

static void nccl_done(void *done)
{
    cudaStreamWaitEvent(0, (cudaEvent_t)done, 0);
    cudaEventDestroy((cudaEvent_t)done);
    cudaGetLastError();
}

const ml_nccl_api ml_nccl_cuda = {
    .usable = nccl_usable,
    .unique_id = nccl_unique_id,
    .open = nccl_open,
    .close = nccl_close,
    .abort = nccl_abort,
    .begin = nccl_begin,
    .all_gather = nccl_all_gather,
    .broadcast = nccl_broadcast,
    .send = nccl_send,
    .recv = nccl_recv,
    .end = nccl_end,
    .query = nccl_query,
    .done = nccl_done,
};
