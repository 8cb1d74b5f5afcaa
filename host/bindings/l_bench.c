/*
 * host/bindings/l_bench.c - the Lua library `moelua.bench`: a monotonic clock and the
 * baselines benchmarks compare against, timed in C so that the baseline
 * pays no Lua overhead.
 *
 *   bench.now([device])                  seconds, CLOCK_MONOTONIC; with a device
 *                                        ("cuda"), after its queued work is done
 *                                        (kernels run asynchronously there: a clock
 *                                        read without it measures launches)
 *   bench.synchronize([device])          wait for the device's queued work
 *   bench.raw_sgemm(c, a, b, calls [, library])
 *                                        seconds per call of `calls` back-to-back
 *                                        sgemm on the tensors' buffers, by the
 *                                        library itself on its own threads:
 *                                        "openblas" (default) or "onednn"
 *   bench.gemm_libraries()               the line naming the GEMM libraries, their
 *                                        versions and kernel paths (kernels/gemm.h)
 */
#include "l_util.h"
#include "../../kernels/gemm.h"

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>
#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wait for the work queued on the device named at idx (none or "cpu": nothing to wait for). */
static void sync_device(lua_State *L, int idx, const char *fn)
{
    if (lua_isnoneornil(L, idx))
        return;
    int d = ml_device_from_name(luaL_checkstring(L, idx));
    if (d < 0)
        ml_error(L, fn, "argument #%d: unknown device '%s' (cpu, cuda)", idx, lua_tostring(L, idx));
    ml_check_device(L, fn, (ml_device)d);
    const ml_memory *mem = ml_host_of(L)->mem[d];
    if (mem)
        ml_check_status(L, fn, mem->synchronize(NULL));
}

static int l_bench_now(lua_State *L)
{
    ml_args(L, 1, "moelua.bench.now");
    sync_device(L, 1, "moelua.bench.now");
    lua_pushnumber(L, now_s());
    return 1;
}

static int l_bench_synchronize(lua_State *L)
{
    ml_args(L, 1, "moelua.bench.synchronize");
    sync_device(L, 1, "moelua.bench.synchronize");
    return 0;
}

/* c [m,n] = a [m,k] * b [k,n], all contiguous f32 on the CPU. */
static int l_bench_raw_sgemm(lua_State *L)
{
    static const char fn[] = "moelua.bench.raw_sgemm";
    ml_args(L, 5, fn);
    ml_tensor *c = ml_checkcontig(L, 1, fn, ML_F32);
    ml_tensor *a = ml_checkcontig(L, 2, fn, ML_F32);
    ml_tensor *b = ml_checkcontig(L, 3, fn, ML_F32);
    lua_Integer calls = ml_checkinteger_named(L, 4, fn, "argument #4 (calls)");
    if (calls < 1)
        ml_error(L, fn, "argument #4: calls must be >= 1");
    static const char *const libraries[] = {"openblas", "onednn", NULL};
    int onednn = luaL_checkoption(L, 5, "openblas", libraries);
    if (a->st->device != ML_CPU || b->st->device != ML_CPU || c->st->device != ML_CPU)
        ml_error(L, fn, "CPU tensors only");
    if (a->ndim != 2 || b->ndim != 2 || c->ndim != 2 || a->shape[1] != b->shape[0] ||
        c->shape[0] != a->shape[0] || c->shape[1] != b->shape[1])
        ml_error(L, fn, "expected c [m,n], a [m,k], b [k,n]");
    blasint m = (blasint)a->shape[0], k = (blasint)a->shape[1], n = (blasint)b->shape[1];
    double t0 = now_s();
    for (lua_Integer i = 0; i < calls && !ml_host_of(L)->planning; i++) {
        if (onednn)
            dnnl_sgemm('N', 'N', m, n, k, 1.0f, ml_data(a), k, ml_data(b), n, 0.0f, ml_data(c), n);
        else
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.0f, ml_data(a), k,
                        ml_data(b), n, 0.0f, ml_data(c), n);
    }
    lua_pushnumber(L, (now_s() - t0) / (double)calls);
    return 1;
}

static int l_bench_gemm_libraries(lua_State *L)
{
    ml_args(L, 0, "moelua.bench.gemm_libraries");
    lua_pushstring(L, ml_gemm_describe());
    return 1;
}

static const luaL_Reg bench_functions[] = {
    {"now", l_bench_now},
    {"synchronize", l_bench_synchronize},
    {"raw_sgemm", l_bench_raw_sgemm},
    {"gemm_libraries", l_bench_gemm_libraries},
    {NULL, NULL}
};

int luaopen_moelua_bench(lua_State *L)
{
    ml_host_of(L);
    luaL_newlib(L, bench_functions);
    return 1;
}
