/*
 * host/runtime/comm.h - collectives over MPI (MPICH) and NCCL for sharded
 * training (DESIGN.md, Distributed): all-gather, reduce-scatter,
 * all-reduce, broadcast, all-to-all-v and barrier over contiguous CPU
 * tensors (MPI) or CUDA tensors (NCCL), over the world or a group of its
 * ranks (ml_comm_split), with a timeout on every wait and an
 * optional fingerprint check, so a stopped or mismatched rank is an error
 * naming the collective, never a hang.
 *
 * MPI is used only when the process was launched by mpiexec (PMI_SIZE set):
 * then the first ml_comm_init initializes it (MPI_THREAD_FUNNELED, checked).
 * Otherwise nothing here calls MPI: the world is one rank and every
 * collective is a local copy or sum with the same results.
 *
 * Reductions whose order matters are moelua's own: the pieces are exchanged
 * (MPI_Ialltoall, or NCCL sends and receives) into a [world, n] scratch and
 * summed in rank order by the elementwise kernels on the tensors' device
 * (f32 in f32, f64 in f64), never with MPI_Reduce_scatter or NCCL's
 * reductions, so results do not depend on MPICH's or NCCL's algorithm or
 * timing, all-reduce is bitwise the same on every rank, and CUDA's result
 * is the CPU's. Counts travel in elements (rows for
 * all-to-all-v) with an MPI contiguous datatype of one element (row), so no
 * count is an int of bytes; a count above INT_MAX is refused.
 *
 * Scratch comes from ml_tensor_alloc under the ledger category `comm` and
 * is released when its operation completes. A request retains the
 * storages of its buffers (ml_storage_retain) until it completes, so a
 * buffer is never freed under a pending MPI operation. Inside a memory plan
 * (h->planning) nothing is exchanged: the arguments are checked and the
 * scratch is allocated and released, so the plan sees it.
 *
 * Every wait polls MPI_Test with short sleeps until timeout_s has passed;
 * then the communicator is broken: the error names the operation, `what`,
 * the context (ml_comm_set_context), the collective's sequence number on
 * this rank and the timeout, and every later call fails fast with the same
 * message; the caller aborts (ml_comm_abort). With debug, before each
 * collective the ranks all-gather a fingerprint (operation, element count,
 * dtype, root, `what`, sequence number) and compare it: a mismatch is an
 * error on every rank and breaks the communicator too.
 *
 * MPICH progresses non-blocking collectives only inside MPI calls: callers
 * poke ml_comm_progress between layers (no progress thread on 2 cores).
 *
 * NCCL (host/runtime/comm_nccl.h; CUDA builds, libnccl.so.2 opened on
 * first use) carries CUDA tensors: made with the communicator when every
 * rank has a CUDA device and NCCL and the world has 2+ ranks, or on request
 * (ml_comm_init_nccl, also in world 1). Bootstrapped over MPI: the ranks
 * agree that all can, rank 0's unique id is broadcast, each rank selects
 * the GPU of its node-local rank (MPI_COMM_TYPE_SHARED) modulo the device
 * count (so call this before the first CUDA allocation), and the
 * non-blocking communicator is polled until the timeout ("NCCL
 * communicator init ..."). An operation runs on NCCL's own stream, after
 * the compute stream's work (an event); its wait polls its completion event
 * and NCCL's asynchronous error up to the timeout (then ncclCommAbort and
 * the message above), and the compute stream waits on that event, so later
 * kernels see the data. Its fingerprint and sequence number are MPI's (the
 * fingerprint exchange stays on MPI, in host memory). In world 1 without
 * NCCL, CUDA tensors are copied and summed locally; in a larger world they
 * are refused, naming why there is no NCCL. A collective's tensors are all
 * on one device (the first's). Not here: Lua (host/bindings/l_dist.c binds
 * this as moelua.dist), partitions and units (the ZeRO trainer).
 */
#ifndef ML_COMM_H
#define ML_COMM_H

#include "op.h"

typedef struct ml_comm ml_comm;
typedef struct ml_comm_req ml_comm_req;

typedef enum {
    ML_COMM_SUM,   /* in rank order */
    ML_COMM_MAX,   /* NaN wins: ranks agree on a non-finite value */
    ML_COMM_MIN
} ml_comm_op;

/* Was this process launched by mpiexec (PMI_SIZE set)? Calls no MPI. */
int ml_comm_launched(void);

/* The world communicator in *out: under mpiexec, MPI initialized on the
 * first call and MPI_COMM_WORLD duplicated (every rank calls this the same
 * number of times, in the same order); otherwise world 1 without MPI.
 * timeout_s > 0 bounds every wait; debug turns on the fingerprint check.
 * Scratch is allocated from h. ML_EIO when MPI refuses. */
ml_status ml_comm_init(ml_host *h, double timeout_s, int debug, ml_comm **out, ml_err *e);
/* The same, with NCCL also in world 1; ML_EINVAL ("option nccl: ...")
 * when it cannot be had. */
ml_status ml_comm_init_nccl(ml_host *h, double timeout_s, int debug, ml_comm **out, ml_err *e);
/* A world of `world` ranks that exists only in memory plans (moelua plan
 * --world), in which this process, alone, is rank `rank`: no MPI. Inside a
 * plan its collectives do what every planned collective does (check, book
 * their scratch, move nothing); outside one each is an error. */
ml_status ml_comm_init_planned(ml_host *h, int rank, int world, double timeout_s, ml_comm **out,
                               ml_err *e);
/* Is c (or the world it belongs to) planned? */
int ml_comm_planned(const ml_comm *c);
/* A group of a planned world in which this rank is `rank` of `world` (a
 * split needs every rank's color, which a planned world does not know: the
 * caller gives the group's shape, as moelua.zero does for its groups). */
ml_status ml_comm_planned_group(ml_comm *c, int rank, int world, const char *label, ml_comm **out,
                                ml_err *e);
/* Do c's CUDA tensors travel over NCCL? */
int ml_comm_nccl(const ml_comm *c);
int ml_comm_rank(const ml_comm *c);
int ml_comm_world(const ml_comm *c);
double ml_comm_timeout(const ml_comm *c);
int ml_comm_debug(const ml_comm *c);
/* A label for every later error message ("step 3"; copied, at most 63
 * characters; NULL or "" for none). */
void ml_comm_set_context(ml_comm *c, const char *context);
/* Waits for the pending operations (at most timeout_s more, even on a
 * broken communicator), then frees c. An operation that still has not
 * completed keeps its buffers (a leak, never memory under MPI); its request,
 * if the caller holds it, becomes complete-and-detached for
 * ml_comm_req_free. Free requests before or after, never use them with
 * another call after this. A communicator with groups (ml_comm_split)
 * stays until its last group is freed. */
void ml_comm_free(ml_comm *c);

/* A group of c's ranks in *out (MPI_Comm_split): the ranks that give the
 * same color (>= 0), ranked by key (>= 0), then by their rank in c. Every
 * rank of c calls it, as a collective of c (numbered, fingerprinted in
 * debug mode; `label` is its `what`). MPI_Comm_split blocks, so a barrier
 * under c's timeout comes first: a missing rank is a timeout of the split
 * ("communicator split of ep ..."), not a hang. World 1 without MPI: a
 * group of one rank. The group has its own rank, world and sequence
 * numbers, c's timeout and debug mode, and shows c's context while it has
 * none of its own (ml_comm_set_context). Its messages name it: "group
 * <label>(color C)" ("group color C" without a label), its rank and the
 * world rank. A group of 2+ ranks of a communicator with NCCL opens its
 * own NCCL communicator (collective over the group's members), so CUDA
 * tensors travel in it as in c; without NCCL in c, the group refuses them
 * for c's reason (a group of one rank copies locally). ml_comm_progress(c) advances c's groups too. A group holds c:
 * ml_comm_free(c) before the group's is allowed, and c goes when its last
 * group does. */
ml_status ml_comm_split(ml_comm *c, int color, int key, const char *label, ml_comm **out,
                        ml_err *e);

/* At exit, after every communicator is freed: MPI_Finalize when this
 * process initialized MPI, then the buffers of operations that never
 * completed (a timeout) go back to their books. */
void ml_comm_finalize(void);
/* This process's rank in MPI's world when MPI is up, else 0. */
int ml_comm_world_rank(void);
/* An error that ends this process: when it runs under mpiexec with more
 * than one rank, print "rank R: msg" on stderr and MPI_Abort(1) (MPI is
 * initialized first if no ml_comm_init did: the other ranks may be waiting
 * in theirs), so no rank stays blocked in a collective; never returns then.
 * Ranks other than 0 wait 1 s first: when rank 0 raised the same error,
 * its abort ends them before they print it again.
 * Otherwise returns and does nothing (the caller reports as usual). */
void ml_comm_abort(const char *msg);

/* ---- collectives: `what` names the data in messages ("unit layers.0.dense");
 * every tensor contiguous and on one device; ML_EINVAL for a refused argument
 * (nothing exchanged), ML_EIO for a timeout, a mismatch, an MPI or NCCL
 * error or a broken communicator, ML_EALLOC for scratch the ledger refused. ---- */

/* full (any shape, world * n elements, shard's dtype) gets rank r's shard
 * (n elements) at [r*n, (r+1)*n), overwritten. shard may be full's own
 * slice [rank*n, (rank+1)*n) (in place). With req: started and returned
 * in *req (complete at once in world 1), to ml_comm_wait / ml_comm_test and
 * ml_comm_req_free; without: waits. */
ml_status ml_comm_all_gather(ml_comm *c, const ml_tensor *shard, ml_tensor *full, const char *what,
                             ml_comm_req **req, ml_err *e);
/* shard (n elements) = (accumulate ? shard : nothing) + the sum over ranks
 * r = 0..world-1, in rank order, of rank r's full[rank*n, (rank+1)*n); full
 * has world * n elements. f32, f64 or i64. Accumulating into zeros gives
 * bitwise what not accumulating gives. shard may be full's own slice. */
ml_status ml_comm_reduce_scatter(ml_comm *c, const ml_tensor *full, ml_tensor *shard,
                                 int accumulate, const char *what, ml_err *e);
/* t = the sum over ranks, in place, any numel: a reduce-scatter over
 * ceil(numel / world) elements per rank (padded in comm scratch), then an
 * all-gather; bitwise the same on every rank and equal to reduce-scatter's
 * shards. f32, f64 or i64. */
ml_status ml_comm_all_reduce(ml_comm *c, ml_tensor *t, const char *what, ml_err *e);
/* v[0..n) on every rank = op over ranks, in rank order (small host arrays:
 * losses, partial sums of norms, counts). */
ml_status ml_comm_all_reduce_f64(ml_comm *c, double *v, int n, ml_comm_op op, const char *what,
                                 ml_err *e);
/* t (any dtype) on every rank = t on rank root. */
ml_status ml_comm_broadcast(ml_comm *c, ml_tensor *t, int root, const char *what, ml_err *e);
/* Rows (a row = numel / shape[0] elements; send and recv of one dtype and
 * row size): the first send_rows[r] rows of send after those for ranks < r
 * go to rank r; recv gets recv_rows[r] rows from rank r, in rank order.
 * Each rows array has world entries >= 0, summing to at most the tensor's
 * shape[0] (rows after them are untouched); they must agree pairwise across
 * ranks (MPI checks only the total). */
ml_status ml_comm_all_to_all_v(ml_comm *c, const ml_tensor *send, const int64_t *send_rows,
                               ml_tensor *recv, const int64_t *recv_rows, const char *what,
                               ml_err *e);
ml_status ml_comm_barrier(ml_comm *c, const char *what, ml_err *e);

/* ---- requests (non-blocking all-gather) ---- */

/* Wait for req (a timeout breaks the communicator, as above); complete
 * requests return at once. */
ml_status ml_comm_wait(ml_comm *c, ml_comm_req *req, ml_err *e);
/* *done = whether req has completed (one MPI_Test). */
ml_status ml_comm_test(ml_comm *c, ml_comm_req *req, int *done, ml_err *e);
/* Free req (NULL: nothing); a pending one is waited for first, errors
 * ignored; one that still cannot complete is handed to its communicator,
 * which keeps its buffers. */
void ml_comm_req_free(ml_comm_req *req);
/* One MPI_Test over every pending operation (cheap), so non-blocking
 * collectives advance between layers; completed ones release their
 * buffers. */
void ml_comm_progress(ml_comm *c);

#endif
