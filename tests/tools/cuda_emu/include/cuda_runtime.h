/*
 * tests/tools/cuda_emu/include/cuda_runtime.h - stands in for the CUDA
 * runtime header when a kernels .cu file is compiled as plain C++ by the
 * emulator (see emu.h for what is emulated and what is not). Everything
 * lives in host memory; a launch runs every block in turn, each block's
 * threads as fibers of one OS thread.
 */
#ifndef EMU_CUDA_RUNTIME_H
#define EMU_CUDA_RUNTIME_H

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <functional>
#include <vector>
#include <math.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
/* Static shared arrays go to one section, refilled with 0xff (NaN, -1)
 * before every block: a read before a write shows up as garbage. Blocks
 * run one at a time, so one copy is enough. */
#define __shared__ static __attribute__((section("emu_shared")))

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef struct emu_stream *cudaStream_t;
typedef enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
} cudaError_t;
typedef enum {
    cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
    cudaMemcpyDeviceToDevice, cudaMemcpyDefault
} cudaMemcpyKind;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

/* ---- the emulator's state (one kernel, one block at a time) ------------ */

inline dim3 threadIdx, blockIdx, gridDim, blockDim;
/* The block's dynamic shared memory (the launch's smem bytes, refilled with
 * 0xff before every block): launch.lua rewrites `extern __shared__ T name[];`
 * into `T *name = (T *)emu_dyn_shared;`. */
inline unsigned char *emu_dyn_shared = nullptr;

void emu_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void emu_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The calling CUDA thread waits (its fiber yields) until every live
 * thread of the block reached a __syncthreads at the same line; returns
 * the sum of their v (for __syncthreads_count). */
long long emu_block_sync(int line, long long v);
/* The calling lane waits until every live lane of mask is here (same
 * line); val[] of its warp holds what each lane put there. */
struct emu_warp_x {
    uint64_t val[32];
    uint32_t in[32];    /* per lane: the lanes taking part with it */
};
emu_warp_x *emu_warp_meet(unsigned mask, int line, uint64_t v);
void emu_warp_done(unsigned mask, int line);

static inline unsigned emu_tid() { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }

#define __syncthreads() ((void)emu_block_sync(__LINE__, 0))
#define __syncthreads_count(p) ((int)emu_block_sync(__LINE__, (p) ? 1 : 0))

/* ---- warp primitives: the lanes of mask meet, exchange through val[],
 * and meet again before val[] is reused -------------------------------- */

template <typename T> static inline uint64_t emu_bits(T v)
{
    static_assert(sizeof(T) <= 8, "warp value wider than 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <typename T> static inline T emu_unbits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}
template <typename T> static inline T emu_shfl(unsigned mask, T v, int src, int line)
{
    emu_warp_x *w = emu_warp_meet(mask, line, emu_bits(v));
    uint64_t r = w->val[src];
    if (!(w->in[emu_tid() % 32] >> src & 1)) {
        emu_warn("line %d: lane %u reads lane %d, which is not in the shuffle", line, emu_tid() % 32, src);
        r = ~0ull;
    }
    emu_warp_done(mask, line);
    return emu_unbits<T>(r);
}
static inline int emu_seg(int lane, int width) { return lane & ~(width - 1); }
#define __shfl_sync(mask, v, src, ...) emu_shfl_idx(mask, v, src, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_xor_sync(mask, v, x, ...) emu_shfl_xor(mask, v, x, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_down_sync(mask, v, d, ...) emu_shfl_down(mask, v, d, __LINE__ __VA_OPT__(,) __VA_ARGS__)
#define __shfl_up_sync(mask, v, d, ...) emu_shfl_up(mask, v, d, __LINE__ __VA_OPT__(,) __VA_ARGS__)
template <typename T> static inline T emu_shfl_idx(unsigned mask, T v, int src, int line, int width = 32)
{
    int lane = emu_tid() % 32;
    return emu_shfl(mask, v, emu_seg(lane, width) + (src & (width - 1)), line);
}
template <typename T> static inline T emu_shfl_xor(unsigned mask, T v, int x, int line, int width = 32)
{
    int lane = emu_tid() % 32, s = lane ^ x;
    return emu_shfl(mask, v, s >= emu_seg(lane, width) + width ? lane : s, line);
}
template <typename T> static inline T emu_shfl_down(unsigned mask, T v, unsigned d, int line, int width = 32)
{
    int lane = emu_tid() % 32;
    int s = (lane & (width - 1)) + (int)d >= width ? lane : lane + (int)d;
    return emu_shfl(mask, v, s, line);
}
template <typename T> static inline T emu_shfl_up(unsigned mask, T v, unsigned d, int line, int width = 32)
{
    int lane = emu_tid() % 32;
    int s = (lane & (width - 1)) < (int)d ? lane : lane - (int)d;
    return emu_shfl(mask, v, s, line);
}
static inline unsigned emu_ballot(unsigned mask, int pred, int line)
{
    emu_warp_x *w = emu_warp_meet(mask, line, pred != 0);
    unsigned r = 0;
    for (int i = 0; i < 32; i++)
        if ((w->in[emu_tid() % 32] >> i & 1) && w->val[i])
            r |= 1u << i;
    emu_warp_done(mask, line);
    return r;
}
template <typename T> static inline unsigned emu_match_any(unsigned mask, T v, int line)
{
    uint64_t me = emu_bits(v);
    emu_warp_x *w = emu_warp_meet(mask, line, me);
    unsigned r = 0;
    for (int i = 0; i < 32; i++)
        if ((w->in[emu_tid() % 32] >> i & 1) && w->val[i] == me)
            r |= 1u << i;
    emu_warp_done(mask, line);
    return r;
}
#define __ballot_sync(mask, p) emu_ballot(mask, p, __LINE__)
#define __match_any_sync(mask, v) emu_match_any(mask, v, __LINE__)
#define __syncwarp(...) emu_syncwarp(__LINE__ __VA_OPT__(,) __VA_ARGS__)
static inline void emu_syncwarp(int line, unsigned mask = 0xffffffffu)
{
    emu_warp_meet(mask, line, 0);
    emu_warp_done(mask, line);
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }

/* ---- atomics: the fibers of a block share one OS thread and switch only
 * at barriers, so a plain read-modify-write is atomic ------------------- */

template <typename T> static inline T atomicAdd(T *p, T v)
{ T o = *p; *p = o + v; return o; }
template <typename T> static inline T atomicSub(T *p, T v)
{ T o = *p; *p = o - v; return o; }
template <typename T> static inline T atomicMin(T *p, T v)
{ T o = *p; *p = v < o ? v : o; return o; }
template <typename T> static inline T atomicMax(T *p, T v)
{ T o = *p; *p = v > o ? v : o; return o; }
template <typename T> static inline T atomicExch(T *p, T v)
{ T o = *p; *p = v; return o; }
template <typename T> static inline T atomicCAS(T *p, T c, T v)
{ T o = *p; if (o == c) *p = v; return o; }
template <typename T> static inline T atomicOr(T *p, T v)
{ T o = *p; *p = o | v; return o; }

/* ---- the runtime API: host memory, one implicit stream ----------------- */

inline cudaError_t emu_last_error = cudaSuccess;
inline long emu_live_temps = 0;
static inline cudaError_t cudaGetLastError(void) { cudaError_t e = emu_last_error; emu_last_error = cudaSuccess; return e; }
static inline cudaError_t cudaPeekAtLastError(void) { return emu_last_error; }
static inline const char *cudaGetErrorName(cudaError_t e) { return e == cudaSuccess ? "cudaSuccess" : "cudaErrorEmulated"; }
static inline const char *cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
static inline cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
static inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
static inline cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
static inline cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int) { *v = 4; return cudaSuccess; }
template <typename F> static inline cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
static inline cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t)
{
    *p = malloc(n);
    if (!*p)
        return cudaErrorMemoryAllocation;
    memset(*p, 0xa5, n);   /* garbage, as cudaMalloc gives */
    emu_live_temps++;
    return cudaSuccess;
}
static inline cudaError_t cudaFreeAsync(void *p, cudaStream_t) { free(p); emu_live_temps--; return cudaSuccess; }
static inline cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind, cudaStream_t = 0)
{ memmove(d, s, n); return cudaSuccess; }
static inline cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t = 0)
{ memset(d, v, n); return cudaSuccess; }

/* k<<<g, b, s, st>>>(args) is rewritten (launch.lua) into
 * emu_launch([=] { k(args); }, g, b, s, st). */
void emu_run(const std::function<void()> &body, dim3 g, dim3 b, size_t smem, int line);
template <typename F>
static inline void emu_launch_at(int line, F body, dim3 g, dim3 b, size_t smem = 0, cudaStream_t = 0)
{
    emu_run(std::function<void()>(body), g, b, smem, line);
}
#define emu_launch(...) emu_launch_at(__LINE__, __VA_ARGS__)

#endif
