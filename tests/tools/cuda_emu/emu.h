/*
 * tests/tools/cuda_emu/emu.h - README of the CUDA emulator, and its runtime
 * (block scheduler, diagnostics) plus what the family tests share.
 *
 * What: runs kernels/<family>.cu on the CPU, unchanged, against the CPU
 * kernels (kernels/<family>.c) with the tolerances of the GPU specs, under
 * ASan + UBSan. A developer tool (like tests/tools/mixtral_check.sh), not
 * part of `make test`. Build and run, from the repository root:
 *     tests/tools/cuda_emu/run.sh [family ...]
 * launch.lua rewrites each `k<<<g, b, s, st>>>(args)` into emu_launch();
 * include/cuda_runtime.h stands in for the CUDA headers; test_<family>.cpp
 * includes the rewritten .cu and compares.
 *
 * Emulated: threadIdx/blockIdx/blockDim/gridDim (3-D), every block of a
 * grid in turn, each CUDA thread a fiber (its own stack, emu_ctx_switch) of
 * one OS thread that runs until it waits at a barrier; __syncthreads (and
 * _count) checked for divergence (one call site per phase) and deadlock;
 * warp primitives (__shfl*_sync, __ballot_sync, __match_any_sync,
 * __syncwarp) as a meeting of the lanes in mask, masks checked; static
 * __shared__ arrays and the launch's dynamic shared memory (extern
 * __shared__, which launch.lua rewrites into a pointer to it) refilled
 * with 0xff (NaN, -1) before every block; atomics;
 * cudaMallocAsync (garbage-filled, leaks counted), cudaFreeAsync,
 * cudaMemcpyAsync, cudaMemsetAsync, synchronisation (host memory, one
 * stream); launch limits (block <= 1024 threads, grid y/z <= 65535,
 * non-empty grid). Threads run in thread order, or reversed with
 * EMU_REVERSE=1 (run.sh runs both): a read of shared data that another
 * thread writes with no barrier between sees garbage in one of the orders.
 *
 * Not emulated: the memory model (no caching or reordering; races between
 * blocks, which run one after another, and within a warp between
 * primitives go unseen); real warp scheduling (lanes meet only at the
 * primitives); the device's libm (glibc's exp/log/pow/sin/cos, CUDA's
 * differ by 1-2 ulp); cuBLAS (crossentropy and experts link emu_cublas, the
 * CPU's GEMM, as ml_matmul_cuda, and experts emu_cublas_grouped, the same
 * per problem, as ml_matmul_grouped_cuda); the static shared-memory limit per block
 * (the dynamic one, 227 KiB, is checked); streams and events as such.
 */
#ifndef EMU_H
#define EMU_H

#include <cstdarg>
#include <memory>
#include <random>
#include <string>

extern "C" {
#include "core.h"
}

static int emu_warnings = 0, emu_failures = 0;
static long emu_launches = 0;

void emu_fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "EMU FATAL: ");
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, "\n");
    fflush(stdout);
    va_end(ap);
    abort();
}

void emu_warn(const char *fmt, ...)
{
    if (emu_warnings++ > 20)
        return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stdout, "EMU WARNING: ");
    vfprintf(stdout, fmt, ap);
    fprintf(stdout, "\n");
    va_end(ap);
}

/* the section every static __shared__ array lives in (cuda_runtime.h) */
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

__attribute__((no_sanitize("address"))) static void emu_garbage_shared(void)
{
    for (volatile char *p = __start_emu_shared; p < __stop_emu_shared; p++)
        *p = (char)0xff;
}

/* ---- the block scheduler: one fiber per CUDA thread ----------------------
 * A pass runs every runnable fiber (in thread order, or reversed with
 * EMU_REVERSE=1) until it waits at a barrier or ends. Then the warp groups
 * whose lanes are all there go on; else, once every live thread waits at
 * one __syncthreads, the block goes on; else the block is deadlocked. */

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN_START(save, bottom, size) __sanitizer_start_switch_fiber(save, bottom, size)
#define EMU_ASAN_FINISH(save, bottom, size) __sanitizer_finish_switch_fiber(save, bottom, size)
#else
#define EMU_ASAN_START(save, bottom, size) ((void)0)
#define EMU_ASAN_FINISH(save, bottom, size) ((void)0)
#endif

enum { EMU_RUN, EMU_AT_BLOCK, EMU_AT_WARP, EMU_DONE };
static const size_t EMU_STACK = 256 * 1024;

/* A fiber switch: callee-saved registers, MXCSR and the x87 control word
 * pushed on the running stack, its stack pointer stored in *from, `to`'s
 * popped. swapcontext does the same plus a sigprocmask system call per
 * switch, which on a paravirtualised machine made the emulated suites
 * about twenty times slower (1030 s against 46). Local to each file that
 * includes this header. */
extern "C" void emu_ctx_switch(void **from, void *to);
__asm__(".text\n"
        ".local emu_ctx_switch\n"
        ".type emu_ctx_switch, @function\n"
        "emu_ctx_switch:\n"
        "    pushq %rbp\n    pushq %rbx\n    pushq %r12\n"
        "    pushq %r13\n    pushq %r14\n    pushq %r15\n"
        "    subq $8, %rsp\n    stmxcsr (%rsp)\n    fnstcw 4(%rsp)\n"
        "    movq %rsp, (%rdi)\n    movq %rsi, %rsp\n"
        "    ldmxcsr (%rsp)\n    fldcw 4(%rsp)\n    addq $8, %rsp\n"
        "    popq %r15\n    popq %r14\n    popq %r13\n"
        "    popq %r12\n    popq %rbx\n    popq %rbp\n"
        "    ret\n"
        ".size emu_ctx_switch, .-emu_ctx_switch\n");

struct emu_fiber {
    void *sp = nullptr;   /* saved by emu_ctx_switch */
    char *stack = nullptr;
    void *fake = nullptr;
    int state = EMU_DONE, line = 0;
    long long v = 0;
    unsigned mask = 0;
};
static struct {
    std::vector<emu_fiber> f;
    std::vector<emu_warp_x> wx;
    std::vector<uint32_t> live;     /* per warp: lanes not yet ended */
    void *main_sp = nullptr;
    void *main_fake = nullptr;
    const void *main_bottom = nullptr;
    size_t main_size = 0;
    unsigned nt = 0, cur = 0;
    long long result = 0;
    const std::function<void()> *body = nullptr;
    int launch_line = 0, exit_warned = 0;
} S;

static void emu_yield(void)
{
    emu_fiber &f = S.f[S.cur];
    EMU_ASAN_START(f.state == EMU_DONE ? nullptr : &f.fake, S.main_bottom, S.main_size);
    emu_ctx_switch(&f.sp, S.main_sp);
    EMU_ASAN_FINISH(f.fake, &S.main_bottom, &S.main_size);
}

static void emu_entry(void)
{
    EMU_ASAN_FINISH(nullptr, &S.main_bottom, &S.main_size);
    (*S.body)();
    unsigned t = S.cur;
    S.f[t].state = EMU_DONE;
    S.live[t / 32] &= ~(1u << (t % 32));
    emu_yield();
}

static void emu_switch_to(unsigned t)
{
    S.cur = t;
    threadIdx = dim3(t % blockDim.x, t / blockDim.x % blockDim.y, t / (blockDim.x * blockDim.y));
    EMU_ASAN_START(&S.main_fake, S.f[t].stack, EMU_STACK);
    emu_ctx_switch(&S.main_sp, S.f[t].sp);
    EMU_ASAN_FINISH(S.main_fake, nullptr, nullptr);
}

long long emu_block_sync(int line, long long v)
{
    emu_fiber &f = S.f[S.cur];
    f.state = EMU_AT_BLOCK;
    f.line = line;
    f.v = v;
    emu_yield();
    return S.result;
}

emu_warp_x *emu_warp_meet(unsigned mask, int line, uint64_t v)
{
    unsigned t = S.cur, lane = t % 32;
    if (!(mask >> lane & 1))
        emu_fail("line %d: lane %u calls a warp primitive with mask %08x that excludes it", line, lane, mask);
    if (mask & ~S.live[t / 32])
        emu_warn("line %d: warp primitive mask %08x names lanes that do not exist or ended (live %08x)",
                 line, mask, S.live[t / 32]);
    emu_warp_x *w = &S.wx[t / 32];
    w->val[lane] = v;
    emu_fiber &f = S.f[t];
    f.state = EMU_AT_WARP;
    f.line = line;
    f.mask = mask;
    emu_yield();
    return w;
}

void emu_warp_done(unsigned mask, int line)
{
    emu_warp_meet(mask, line, S.wx[S.cur / 32].val[S.cur % 32]);
}

/* release the warp groups that are complete; 1 if any */
static int emu_release_warps(void)
{
    int any = 0;
    for (unsigned t = 0; t < S.nt; t++) {
        emu_fiber &f = S.f[t];
        if (f.state != EMU_AT_WARP)
            continue;
        unsigned w = t / 32, need = f.mask & S.live[w], ok = 1;
        for (unsigned l = 0; l < 32; l++) {
            if (!(need >> l & 1))
                continue;
            emu_fiber &g = S.f[w * 32 + l];
            if (g.state != EMU_AT_WARP)
                ok = 0;
            else if (g.line != f.line || g.mask != f.mask)
                emu_fail("warp primitive: lanes %u and %u of warp %u meet at line %d mask %08x and line %d "
                         "mask %08x", t % 32, l, w, f.line, f.mask, g.line, g.mask);
        }
        if (!ok)
            continue;
        for (unsigned l = 0; l < 32; l++)
            if (need >> l & 1) {
                S.f[w * 32 + l].state = EMU_RUN;
                S.wx[w].in[l] = need;
            }
        any = 1;
    }
    return any;
}

static void emu_deadlock(const char *why)
{
    for (unsigned t = 0; t < S.nt; t++)
        if (S.f[t].state != EMU_DONE)
            printf("  thread %u: %s at line %d\n", t, S.f[t].state == EMU_AT_BLOCK ? "__syncthreads" : "warp",
                   S.f[t].line);
    emu_fail("launch at line %d, block (%u,%u,%u): %s", S.launch_line, blockIdx.x, blockIdx.y, blockIdx.z, why);
}

/* A fresh fiber's stack as emu_ctx_switch leaves one: the caller's MXCSR
 * and x87 control word, six zeroed registers, then emu_entry as the return
 * address, above a never-used return slot so that emu_entry starts with
 * the stack aligned as after a call. */
static void emu_start_fiber(emu_fiber &f)
{
    uintptr_t top = ((uintptr_t)f.stack + EMU_STACK) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;
    *--sp = (void *)emu_entry;
    for (int i = 0; i < 6; i++)
        *--sp = nullptr;
    --sp;
    uint32_t csr;
    uint16_t cw;
    __asm__ volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr), "=m"(cw));
    memcpy(sp, &csr, sizeof csr);
    memcpy((char *)sp + 4, &cw, sizeof cw);
    f.sp = sp;
    f.state = EMU_RUN;
    f.fake = nullptr;
}

static void emu_run_block(int reverse)
{
    for (unsigned t = 0; t < S.nt; t++)
        emu_start_fiber(S.f[t]);
    for (unsigned w = 0; w < S.live.size(); w++) {
        unsigned n = S.nt - 32 * w < 32 ? S.nt - 32 * w : 32;
        S.live[w] = n == 32 ? 0xffffffffu : (1u << n) - 1;
    }
    for (;;) {
        for (unsigned k = 0; k < S.nt; k++) {
            unsigned t = reverse ? S.nt - 1 - k : k;
            if (S.f[t].state == EMU_RUN)
                emu_switch_to(t);
        }
        if (emu_release_warps())
            continue;
        unsigned alive = 0, at = 0;
        int line = -1;
        long long sum = 0;
        for (unsigned t = 0; t < S.nt; t++) {
            emu_fiber &f = S.f[t];
            if (f.state == EMU_DONE)
                continue;
            alive++;
            if (f.state != EMU_AT_BLOCK)
                continue;
            at++;
            if (line >= 0 && f.line != line)
                emu_deadlock("__syncthreads reached at two different lines");
            line = f.line;
            sum += f.v;
        }
        if (alive == 0)
            return;
        if (at != alive)
            emu_deadlock("deadlock: some threads wait in a warp primitive that cannot complete");
        if (alive < S.nt && !S.exit_warned) {
            S.exit_warned = 1;
            emu_warn("launch at line %d: __syncthreads at line %d after %u of %u threads ended", S.launch_line,
                     line, S.nt - alive, S.nt);
        }
        S.result = sum;
        for (unsigned t = 0; t < S.nt; t++)
            if (S.f[t].state == EMU_AT_BLOCK)
                S.f[t].state = EMU_RUN;
    }
}

void emu_run(const std::function<void()> &body, dim3 g, dim3 b, size_t smem, int line)
{
    unsigned long nt = (unsigned long)b.x * b.y * b.z;
    emu_launches++;
    if (nt == 0 || nt > 1024 || b.z > 64 || g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu
        || g.y > 65535 || g.z > 65535 || smem > 227 * 1024) {
        emu_warn("launch at line %d: invalid configuration grid (%u,%u,%u) block (%u,%u,%u) smem %zu",
                 line, g.x, g.y, g.z, b.x, b.y, b.z, smem);
        emu_failures++;
        emu_last_error = cudaErrorInvalidConfiguration;
        return;
    }
    static int reverse = getenv("EMU_REVERSE") && atoi(getenv("EMU_REVERSE"));
    gridDim = g;
    blockDim = b;
    while (S.f.size() < nt) {
        S.f.emplace_back();
        S.f.back().stack = (char *)malloc(EMU_STACK);
    }
    S.nt = (unsigned)nt;
    S.wx.assign((nt + 31) / 32, emu_warp_x());
    S.live.assign((nt + 31) / 32, 0);
    S.body = &body;
    S.launch_line = line;
    S.exit_warned = 0;
    std::vector<unsigned char> dyn(smem ? smem : 1);   /* malloc'ed: 16-byte aligned */
    emu_dyn_shared = smem ? dyn.data() : nullptr;
    for (unsigned z = 0; z < g.z; z++)
        for (unsigned y = 0; y < g.y; y++)
            for (unsigned x = 0; x < g.x; x++) {
                emu_garbage_shared();
                memset(dyn.data(), 0xff, dyn.size());
                blockIdx = dim3(x, y, z);
                emu_run_block(reverse);
            }
}

/* ---- test helpers -------------------------------------------------------- */

static std::mt19937_64 emu_rng(1234);

static inline std::vector<double> randn(size_t n, double std_ = 1.0)
{
    std::normal_distribution<double> nd(0.0, std_);
    std::vector<double> r(n);
    for (auto &x : r)
        x = nd(emu_rng);
    return r;
}

/* values as dtype dt: a byte buffer, and back to doubles */
static inline std::vector<unsigned char> as_dt(ml_dtype dt, const std::vector<double> &v)
{
    std::vector<unsigned char> b(v.size() * ml_dtype_size(dt) + 1);
    for (size_t i = 0; i < v.size(); i++)
        ml_store(dt, b.data(), i, v[i]);
    return b;
}
static inline std::vector<double> to_d(ml_dtype dt, const void *p, size_t n)
{
    std::vector<double> r(n);
    for (size_t i = 0; i < n; i++)
        r[i] = ml_load(dt, p, i);
    return r;
}
/* round through dt (so bf16 inputs are exact in the f32 reference) */
static inline std::vector<double> rounded(ml_dtype dt, const std::vector<double> &v)
{
    auto b = as_dt(dt, v);
    return to_d(dt, b.data(), v.size());
}

static double relerr(const std::vector<double> &x, const std::vector<double> &r)
{
    double n = 0, d = 0;
    if (x.size() != r.size())
        return INFINITY;
    for (size_t i = 0; i < x.size(); i++) {
        if (std::isnan(x[i]) != std::isnan(r[i]))
            return INFINITY;
        if (!std::isnan(x[i]) && x[i] != r[i]) {
            if (std::isinf(x[i]) || std::isinf(r[i]))
                return INFINITY;
            n += (x[i] - r[i]) * (x[i] - r[i]);
        }
        d += std::isfinite(r[i]) ? r[i] * r[i] : 0;
    }
    return d ? sqrt(n / d) : sqrt(n);
}

static double emu_worst = 0;
static void check(const std::string &what, const std::vector<double> &got, const std::vector<double> &ref,
                  double tol)
{
    double e = relerr(got, ref);
    bool bad = !(e <= tol);
    emu_failures += bad;
    if (tol > 0 && e / tol > emu_worst)
        emu_worst = e / tol;
    printf("%s %-52s err %.3e (tol %.1e)\n", bad ? "FAIL" : "ok  ", what.c_str(), e, tol);
    if (bad) {
        int shown = 0;
        for (size_t i = 0; i < got.size() && shown < 4; i++)
            if (!(got[i] == ref[i]) && !(std::isnan(got[i]) && std::isnan(ref[i]))) {
                printf("     [%zu] got %.17g want %.17g\n", i, got[i], ref[i]);
                shown++;
            }
    }
}
static inline void check_status(const std::string &what, ml_status got, ml_status want)
{
    bool bad = got != want;
    emu_failures += bad;
    if (bad)
        printf("FAIL %-52s status %d, want %d\n", what.c_str(), (int)got, (int)want);
}

static inline const char *dtn(ml_dtype dt)
{
    static const char *n[] = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"};
    return n[dt];
}

static int emu_finish(void)
{
    if (emu_live_temps)
        printf("FAIL %ld cudaMallocAsync temporaries never freed\n", emu_live_temps), emu_failures++;
    printf("%ld launches, %d warnings, %d failures, worst err/tol %.3g\n", emu_launches, emu_warnings,
           emu_failures, emu_worst);
    return emu_failures != 0;
}

static const double EPS32 = 1.0 / (1 << 24), EPS64 = 1.0 / 9007199254740992.0;
static const ml_kctx emu_ctx = {1, nullptr, nullptr, nullptr, nullptr};

/* cuBLAS's stand-in (crossentropy and experts link it as ml_matmul_cuda):
 * ml_matmul_cpu, with bf16 operands widened to f32 (CUBLAS_COMPUTE_32F:
 * the products of bf16 values are exact in f32) and a bf16 C widened, then
 * rounded to nearest even. Every operand's whole extent is converted. */
extern "C" {
#include "matmul.h"
}
static inline std::vector<float> emu_widen(const void *p, size_t n)
{
    std::vector<float> w(n);
    for (size_t i = 0; i < n; i++)
        w[i] = ml_bf16_to_f32(((const uint16_t *)p)[i]);
    return w;
}

static inline ml_status emu_cublas(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                                   const ml_gemm_shape *s, const ml_kctx *ctx)
{
    if (dt != ML_BF16)
        return ml_matmul_cpu(dt, cdt, c, a, b, s, ctx);
    if (cdt != ML_BF16 && cdt != ML_F32)
        return ML_EUNSUPPORTED;
    size_t na = (size_t)((s->batch - 1) * s->sa + (s->ta ? s->k : s->m) * s->lda);
    size_t nb = (size_t)((s->batch - 1) * s->sb + (s->tb ? s->n : s->k) * s->ldb);
    size_t nc = (size_t)((s->batch - 1) * s->sc + s->m * s->ldc);
    std::vector<float> wa = emu_widen(a, na), wb = emu_widen(b, nb);
    std::vector<float> wc = cdt == ML_F32 ? std::vector<float>((float *)c, (float *)c + nc) : emu_widen(c, nc);
    ml_status st = ml_matmul_cpu(ML_F32, ML_F32, wc.data(), wa.data(), wb.data(), s, ctx);
    for (size_t i = 0; i < nc; i++) {
        if (cdt == ML_F32)
            ((float *)c)[i] = wc[i];
        else
            ((uint16_t *)c)[i] = ml_f32_to_bf16(wc[i]);
    }
    return st;
}

/* cuBLAS's grouped GEMM's stand-in: emu_cublas per problem, in order (a,
 * b and c are the "device" arrays of pointers, host memory here) */
static inline ml_status emu_cublas_grouped(ml_dtype dt, ml_dtype cdt, int64_t count, const ml_gemm_shape *s,
                                           const void *const *a, const void *const *b, void *const *c,
                                           const ml_kctx *ctx)
{
    for (int64_t i = 0; i < count; i++) {
        if (s[i].m <= 0 || s[i].n <= 0)
            continue;
        ml_status st = emu_cublas(dt, cdt, c[i], a[i], b[i], &s[i], ctx);
        if (st != ML_OK)
            return st;
    }
    return ML_OK;
}

#endif
