/*
 * host/runtime/comm_nccl.h - private to host/runtime/comm.c: NCCL and the
 * CUDA streams and events around it, for the collectives on CUDA tensors
 * (host/runtime/comm_nccl.c, in `make CUDA=1` builds only).
 *
 * NCCL (libnccl.so.2) is opened with dlopen on first use, as cuBLAS is
 * (kernels/matmul.cu): the binary starts without it. The communicator is
 * non-blocking (config.blocking = 0): every call that answers
 * ncclInProgress is polled with ncclCommGetAsyncError until it is done or
 * the deadline passes, so a rank that never comes is a timeout, not a hang.
 *
 * Operations run on the communicator's own stream: begin orders it after
 * the compute stream (the legacy default stream, where every kernel runs),
 * end records a completion event that the caller polls (query) and hands
 * back (done: the compute stream waits on it, so what follows sees the
 * data). Counts are bytes in a size_t:
 * NCCL does no arithmetic here (comm.c sums in rank order itself).
 *
 * Not here: requests, timeouts' messages, sequence numbers, the ledger,
 * MPI (comm.c bootstraps over MPI: it broadcasts the unique id).
 */
#ifndef ML_COMM_NCCL_H
#define ML_COMM_NCCL_H

#include <stddef.h>

#define ML_NCCL_ID_BYTES 128   /* sizeof(ncclUniqueId) */

typedef struct ml_nccl ml_nccl;

/* What a call returns: ML_NCCL_OK, or an error whose text is in why. */
typedef enum { ML_NCCL_OK = 0, ML_NCCL_ERROR, ML_NCCL_TIMEOUT } ml_nccl_status;

/* The NCCL backend as a table: a CUDA build's is ml_nccl_cuda; a CPU
 * build's (comm.c) can only say why there is none. `why` takes the text
 * of an error (len bytes). */
typedef struct {
    /* Can NCCL run here: a CUDA device and libnccl.so.2 (loaded now)? 0
     * yes; -1 with the reason. */
    int (*usable)(char *why, size_t len);
    /* A new unique id (rank 0, then broadcast). */
    ml_nccl_status (*unique_id)(unsigned char id[ML_NCCL_ID_BYTES], char *why, size_t len);
    /* Select the GPU local_rank modulo the device count (NCCL refuses two
     * ranks on one GPU), then
     * make rank's communicator of world ranks (non-blocking, polled for
     * `timeout` seconds; then ncclCommAbort and ML_NCCL_TIMEOUT), its
     * stream and events. */
    ml_nccl_status (*open)(ml_nccl **out, const unsigned char id[ML_NCCL_ID_BYTES], int world,
                           int rank, int local_rank, double timeout, char *why, size_t len);
    /* Free n: the communicator is finalized (waiting at most timeout
     * seconds) and destroyed, or aborted when `abort` or when that fails. */
    void (*close)(ml_nccl *n, int abort, double timeout);
    /* ncclCommAbort now (kernels in flight stop); later operations fail.
     * The stream stays until close. */
    void (*abort)(ml_nccl *n);
    /* An operation: begin (the comm stream waits for the compute stream; a
     * group opens), the calls, then end (the group closes, polled for
     * `timeout` seconds; a completion event in *done), also after a call
     * failed. */
    ml_nccl_status (*begin)(ml_nccl *n, char *why, size_t len);
    ml_nccl_status (*all_gather)(ml_nccl *n, const void *send, void *recv, size_t bytes,
                                 char *why, size_t len);
    ml_nccl_status (*broadcast)(ml_nccl *n, void *buf, size_t bytes, int root, char *why,
                                size_t len);
    ml_nccl_status (*send)(ml_nccl *n, const void *buf, size_t bytes, int peer, char *why,
                           size_t len);
    ml_nccl_status (*recv)(ml_nccl *n, void *buf, size_t bytes, int peer, char *why, size_t len);
    ml_nccl_status (*end)(ml_nccl *n, double timeout, void **done, char *why, size_t len);
    /* Has the operation of `done` completed? 1 yes, 0 not yet, -1 an
     * error (NCCL's asynchronous error or the event's) with its text. */
    int (*query)(ml_nccl *n, void *done, char *why, size_t len);
    /* done completed: the compute stream waits on it, then it is freed. */
    void (*done)(void *done);
} ml_nccl_api;

#ifdef ML_WITH_CUDA
extern const ml_nccl_api ml_nccl_cuda;
#endif

#endif
