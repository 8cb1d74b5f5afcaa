/* kernels/crossentropy.cu under the emulator against kernels/crossentropy.c
 * (tests/spec/gpu_dense_spec.lua's tolerances); cuBLAS is stubbed with
 * ml_matmul_cpu, so only the CE kernels and their chunking are emulated */
#include "cuda_util.cu.cpp"
#include "crossentropy.cu.cpp"
#include "emu.h"

extern "C" ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                                    const ml_gemm_shape *s, const ml_kctx *ctx)
{
    return emu_cublas(dt, cdt, c, a, b, s, ctx);
}

static void run(ml_dtype dt, int64_t S, int64_t V, int64_t D, int64_t rows, int64_t vchunk, bool nan)
{
    double eps = dt == ML_F32 ? EPS32 : EPS64;
    std::vector<int64_t> tg(S);
    std::uniform_int_distribution<int64_t> u(0, V - 1);
    for (auto &t : tg)
        t = u(emu_rng);
    auto hv = randn(S * D);
    if (nan)
        hv[S * D / 2] = NAN;
    auto h = as_dt(dt, hv), W = as_dt(dt, randn(V * D, 1 / sqrt((double)D))), dW1 = as_dt(dt, randn(V * D));
    auto dW2 = dW1;
    size_t sc = ml_ce_scratch_elems(S, V, rows, vchunk) * ml_dtype_size(dt) + 8;
    std::vector<unsigned char> s1(sc), s2(sc), dh1(S * D * 8), dh2(S * D * 8, 0xff);
    std::vector<double> l1(S), l2(S, NAN);
    double loss1 = 0, loss2 = 0;
    std::string nm = std::string(dtn(dt)) + " S=" + std::to_string(S) + " V=" + std::to_string(V) + " D=" +
                     std::to_string(D) + " rows=" + std::to_string(rows) + " chunk=" + std::to_string(vchunk);
    ml_status a = ml_ce_forward_cpu(dt, &loss1, l1.data(), h.data(), W.data(), tg.data(), S, V, D, rows, vchunk,
                                    s1.data(), &emu_ctx);
    ml_status b = ml_ce_forward_cuda(dt, &loss2, l2.data(), h.data(), W.data(), tg.data(), S, V, D, rows, vchunk,
                                     s2.data(), &emu_ctx);
    check_status(nm + " forward", b, a);
    if (nan) {
        printf("%s %-52s status %d (cpu %d)\n", b == ML_ENAN ? "ok  " : "FAIL", (nm + " NaN").c_str(), b, a);
        return;
    }
    check(nm + " loss", {loss2}, {loss1}, 4 * D * eps);
    check(nm + " lse", l2, l1, 4 * D * eps);
    a = ml_ce_backward_cpu(dt, dh1.data(), dW1.data(), 1.7, h.data(), W.data(), tg.data(), l1.data(), S, V, D, rows,
                           vchunk, s1.data(), &emu_ctx);
    b = ml_ce_backward_cuda(dt, dh2.data(), dW2.data(), 1.7, h.data(), W.data(), tg.data(), l2.data(), S, V, D, rows,
                            vchunk, s2.data(), &emu_ctx);
    check_status(nm + " backward", b, a);
    double tol = 4 * (D + std::max(V, S)) * eps;
    check(nm + " dh", to_d(dt, dh2.data(), S * D), to_d(dt, dh1.data(), S * D), tol);
    check(nm + " dW (+=)", to_d(dt, dW2.data(), V * D), to_d(dt, dW1.data(), V * D), tol);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64}) {
        run(dt, 300, 1000, 64, 128, 300, false);
        run(dt, 1, 7, 3, 1, 1, false);
        run(dt, 33, 50, 16, 1024, 1000, false);
        run(dt, 8, 50, 16, 3, 7, true);
    }
    return emu_finish();
}
