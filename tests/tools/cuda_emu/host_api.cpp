/*
 * tests/tools/cuda_emu/host_api.cpp - the CUDA runtime calls of moelua's
 * host code (host/runtime/backend_cuda.c, comm_nccl.c), for the emulated
 * build of the whole program (moelua.sh): compiled against the real
 * cuda_runtime_api.h, so the host objects of `make CUDA=1` link to these
 * instead of cudart. One emulated device: "memory" is host memory
 * (cudaMalloc fills it with garbage, as the device gives), every call
 * completes before it returns (kernels run when launched, emu.h), so
 * streams and events are handles with nothing behind them.
 *
 * Not here: the kernels' own runtime calls (include/cuda_runtime.h) and
 * the error state they share (emu_runtime.cpp: emu_take_error).
 */
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <cuda_runtime_api.h>

extern "C" int emu_take_error(void);
extern "C" int emu_peek_error(void);

/* Bytes the emulated device has, and has handed out (cudaMemGetInfo). */
static const size_t EMU_DEVICE_BYTES = (size_t)80 << 30;
static size_t emu_device_used = 0;

/* A handle for a stream or an event: distinct, non-null, never read. */
static void *emu_handle(void)
{
    static char handles[1 << 16];
    static size_t next = 0;
    return &handles[next++ % sizeof handles];
}

struct emu_block { size_t n; };

extern "C" {

cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int d)
{
    memset(p, 0, sizeof *p);
    strcpy(p->name, "moelua CUDA emulator (tests/tools/cuda_emu)");
    p->major = 9;
    p->minor = 0;
    p->totalGlobalMem = EMU_DEVICE_BYTES;
    p->multiProcessorCount = 4;
    return d == 0 ? cudaSuccess : cudaErrorInvalidDevice;
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
    if (p) {
        emu_block *b = (emu_block *)((char *)p - 256);
        emu_device_used -= b->n;
        free(b);
    }
    return cudaSuccess;
}

/* Pinned host memory is host memory here (every copy is synchronous). */
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned int)
{
    *p = aligned_alloc(256, (n + 255) & ~(size_t)255);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void *p)
{
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, enum cudaMemcpyKind)
{
    memmove(dst, src, n);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, enum cudaMemcpyKind, cudaStream_t)
{
    memmove(dst, src, n);
    return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned int)
{
    *s = (cudaStream_t)emu_handle();
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned int)
{
    *e = (cudaEvent_t)emu_handle();
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }

/* The kernels' launch errors (emu.h) are the ones there are. */
cudaError_t cudaGetLastError(void) { return (cudaError_t)emu_take_error(); }
cudaError_t cudaPeekAtLastError(void) { return (cudaError_t)emu_peek_error(); }
const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }

}
