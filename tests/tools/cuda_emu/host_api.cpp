/*
 * tests/tools/cuda_emu/host_api.cpp - the CUDA runtime calls of moelua's
 * host code (host/runtime/backend_cuda.c, comm_nccl.c), for the emulated
 * build of the whole program (moelua.sh): compiled against the real
 * cuda_runtime_api.h, so the host objects of `make CUDA=1` link to these
 * instead of cudart. One emulated device: "memory" is host memory
 * (cudaMalloc fills it with garbage, as the device gives). Kernels run
 * when launched (emu.h) and so does everything on the legacy default
 * stream (moelua's compute stream). A created stream (the expert store's
 * copy stream) is lazy: its cudaMemcpyAsync and its waits for events run
 * only when something needs them: a wait for an event recorded after them
 * on an eager stream, a synchronize, an event query, a free (which
 * synchronizes, as cudaFree does). So a kernel that touches a slot
 * without waiting for the slot's copy sees the bytes from before the copy
 * (a missed wait fails a bitwise test instead of passing by luck), and a
 * copy that does not wait for the kernels it should (its stream's wait
 * for the compute stream's event) still sees their bytes: those kernels
 * have run, so that direction is not checked.
 *
 * Not here: the kernels' own runtime calls (include/cuda_runtime.h) and
 * the error state they share (emu_runtime.cpp: emu_take_error).
 */
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <set>

#include <cuda_runtime_api.h>

extern "C" int emu_take_error(void);
extern "C" int emu_peek_error(void);

/* Bytes the emulated device has, and has handed out (cudaMemGetInfo). */
static const size_t EMU_DEVICE_BYTES = (size_t)80 << 30;
static size_t emu_device_used = 0;

struct emu_block { size_t n; };

/* A lazy stream: ops[0..) are queued and not yet run; `queued` counts every
 * op ever queued, `done` those run. An op is a copy, or (dst null) a wait
 * for `upto` ops of stream `on`. */
struct emu_stream;
struct emu_op {
    void *dst;
    const void *src;
    size_t n;
    emu_stream *on;
    uint64_t upto;
};
struct emu_stream {
    std::deque<emu_op> ops;
    uint64_t queued = 0, done = 0;
};
/* An event: the point of the lazy stream it was last recorded on (on null:
 * recorded on an eager stream, or never: complete). */
struct emu_event {
    emu_stream *on = nullptr;
    uint64_t upto = 0;
};

static std::set<emu_stream *> emu_streams;

/* Run s's queued ops until `upto` of them have run. */
static void emu_run(emu_stream *s, uint64_t upto)
{
    while (s->done < upto) {
        emu_op op = s->ops.front();
        s->ops.pop_front();
        s->done++;
        if (op.dst)
            memmove(op.dst, op.src, op.n);
        else
            emu_run(op.on, op.upto);
    }
}

static void emu_run_all(void)
{
    for (emu_stream *s : emu_streams)
        emu_run(s, s->queued);
}

/* The lazy stream behind a handle; null: an eager one (the default
 * stream, cudaStreamLegacy, cudaStreamPerThread). */
static emu_stream *emu_lazy(cudaStream_t h)
{
    emu_stream *s = (emu_stream *)h;
    return emu_streams.count(s) ? s : nullptr;
}

static void emu_queue(emu_stream *s, emu_op op)
{
    s->ops.push_back(op);
    s->queued++;
}

extern "C" {

/* Each emulated process is its own device: a node has 8 (more than the MPI
 * specs start, so NCCL's one rank per device holds), or as many as
 * CUDA_VISIBLE_DEVICES lists, as on a real node. */
static int emu_devices(void)
{
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (!v)
        return 8;
    if (!*v)   /* set and empty: none, as CUDA has it */
        return 0;
    int n = 1;
    for (; *v; v++)
        n += *v == ',';
    return n;
}
static int emu_device;
cudaError_t cudaGetDeviceCount(int *n) { *n = emu_devices(); return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = emu_device; return cudaSuccess; }
cudaError_t cudaSetDevice(int d)
{
    if (d < 0 || d >= emu_devices())
        return cudaErrorInvalidDevice;
    emu_device = d;
    return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void)
{
    emu_run_all();
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d)
{
    memset(p, 0, sizeof *p);
    strcpy(p->name, "moelua CUDA emulator (tests/tools/cuda_emu)");
    p->major = 9;
    p->minor = 0;
    p->totalGlobalMem = EMU_DEVICE_BYTES;
    p->multiProcessorCount = 4;
    return d >= 0 && d < emu_devices() ? cudaSuccess : cudaErrorInvalidDevice;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total)
{
    *total = EMU_DEVICE_BYTES;
    *free_bytes = EMU_DEVICE_BYTES - emu_device_used;
    return cudaSuccess;
}

/* Each block remembers its size in a header, for cudaMemGetInfo. */
cudaError_t cudaMalloc(void **p, size_t n)
{
    emu_block *b = (emu_block *)aligned_alloc(256, 256 + ((n + 255) & ~(size_t)255));
    if (!b) {
        *p = nullptr;
        return cudaErrorMemoryAllocation;
    }
    b->n = n;
    emu_device_used += n;
    *p = (char *)b + 256;
    memset(*p, 0xa5, n);   /* garbage, as the device gives */
    return cudaSuccess;
}

cudaError_t cudaFree(void *p)
{
    emu_run_all();
    if (p) {
        emu_block *b = (emu_block *)((char *)p - 256);
        emu_device_used -= b->n;
        free(b);
    }
    return cudaSuccess;
}

/* Pinned host memory is host memory here. */
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int)
{
    *p = aligned_alloc(256, (n + 255) & ~(size_t)255);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void *p)
{
    emu_run_all();
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind)
{
    memmove(dst, src, n);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind, cudaStream_t h)
{
    if (emu_stream *s = emu_lazy(h))
        emu_queue(s, {dst, src, n, nullptr, 0});
    else
        memmove(dst, src, n);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int)
{
    emu_stream *st = new emu_stream;
    emu_streams.insert(st);
    *s = (cudaStream_t)st;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t h)
{
    /* its work completes first, as on a device; the struct is kept (a few
     * bytes a stream): events recorded on it may still be waited for */
    if (emu_stream *s = emu_lazy(h)) {
        emu_run(s, s->queued);
        emu_streams.erase(s);
    }
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t h)
{
    if (emu_stream *s = emu_lazy(h))
        emu_run(s, s->queued);
    return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t h, cudaEvent_t e, unsigned int)
{
    emu_event *ev = (emu_event *)e;
    if (!ev->on || ev->on->done >= ev->upto)
        return cudaSuccess;
    if (emu_stream *s = emu_lazy(h))
        emu_queue(s, {nullptr, nullptr, 0, ev->on, ev->upto});
    else
        emu_run(ev->on, ev->upto);
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int)
{
    *e = (cudaEvent_t) new emu_event;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e)
{
    delete (emu_event *)e;
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t h)
{
    emu_event *ev = (emu_event *)e;
    ev->on = emu_lazy(h);
    ev->upto = ev->on ? ev->on->queued : 0;
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e)
{
    emu_event *ev = (emu_event *)e;
    if (ev->on)
        emu_run(ev->on, ev->upto);
    return cudaSuccess;
}

/* The kernels' launch errors (emu.h) are the ones there are. */
cudaError_t cudaGetLastError(void) { return (cudaError_t)emu_take_error(); }
cudaError_t cudaPeekAtLastError(void) { return (cudaError_t)emu_peek_error(); }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }

}
