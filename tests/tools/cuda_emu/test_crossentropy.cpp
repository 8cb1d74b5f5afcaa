/* kernels/crossentropy.cu under the emulator against kernels/crossentropy.c
 * (tests/spec/gpu_dense_spec.lua's tolerances); cuBLAS is stubbed with
 * ml_matmul_cpu and copy.cu with ml_copy_cpu, so only the CE kernels and
 * their chunking are emulated. bf16 (CUDA only) runs against the CPU's f32
 * kernel on the widened inputs (see bf16_tol) */
#include "cuda_util.cu.cpp"
#include "crossentropy.cu.cpp"
#include "emu.h"

extern "C" ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                                    const ml_gemm_shape *s, const ml_kctx *ctx)
{
    return emu_cublas(dt, cdt, c, a, b, s, ctx);
}

extern "C" ml_status ml_copy_cuda(ml_dtype dt_out, void *out, const int64_t *out_stride, ml_dtype dt_in,
                                  const void *in, const int64_t *in_stride, int ndim, const int64_t *shape,
                                  const ml_kctx *ctx)
{
    return ml_copy_cpu(dt_out, out, out_stride, dt_in, in, in_stride, ndim, shape, ctx);
}

/* bf16 against f32 on the same (bf16) values, normwise. The logits are the
 * same f32 GEMM, so loss and lse keep the f32 tolerance. The backward rounds
 * G = (softmax - onehot) dloss/S to bf16 for its GEMMs: a relative error of
 * at most 2^-8 (bf16's unit roundoff) per entry, about 0.4 * 2^-8 RMS and
 * random in sign. So dW = G^T h (f32) is off by about 0.4 * 2^-8 normwise,
 * asserted <= 2^-8; dh = G W is off by as much and is then rounded to bf16
 * once (as much again), asserted <= 2 * 2^-8. */
static const double BF16_DW = 1.0 / 256, BF16_DH = 2.0 / 256;

static void run(ml_dtype dt, int64_t S, int64_t V, int64_t D, int64_t rows, int64_t vchunk, bool nan)
{
    ml_dtype rdt = ml_grad_dtype(dt);   /* the CPU reference's dtype */
    double eps = rdt == ML_F32 ? EPS32 : EPS64;
    std::vector<int64_t> tg(S);
    std::uniform_int_distribution<int64_t> u(0, V - 1);
    for (auto &t : tg)
        t = u(emu_rng);
    auto hv = rounded(dt, randn(S * D)), Wv = rounded(dt, randn(V * D, 1 / sqrt((double)D)));
    if (nan)
        hv[S * D / 2] = NAN;
    /* dW's start, of the size of the increment, so that += is seen */
    auto dW0 = randn(V * D, dt == ML_BF16 ? 1e-3 : 1.0);
    auto h1 = as_dt(rdt, hv), W1 = as_dt(rdt, Wv), h2 = as_dt(dt, hv), W2 = as_dt(dt, Wv);
    auto dW1 = as_dt(rdt, dW0), dW2 = dW1;   /* dW: ml_grad_dtype(dt) = rdt */
    auto dWs = to_d(rdt, dW1.data(), V * D);
    size_t sc1 = ml_ce_scratch_bytes(rdt, S, V, D, rows, vchunk), sc2 = ml_ce_scratch_bytes(dt, S, V, D, rows, vchunk);
    std::vector<unsigned char> s1(sc1 + 8), s2(sc2 + 8), dh1(S * D * 8), dh2(S * D * 8, 0xff);
    std::vector<double> l1(S), l2(S, NAN);
    double loss1 = 0, loss2 = 0;
    std::string nm = std::string(dtn(dt)) + " S=" + std::to_string(S) + " V=" + std::to_string(V) + " D=" +
                     std::to_string(D) + " rows=" + std::to_string(rows) + " chunk=" + std::to_string(vchunk);
    ml_status a = ml_ce_forward_cpu(rdt, &loss1, l1.data(), h1.data(), W1.data(), tg.data(), S, V, D, rows,
                                    vchunk, s1.data(), &emu_ctx);
    ml_status b = ml_ce_forward_cuda(dt, &loss2, l2.data(), h2.data(), W2.data(), tg.data(), S, V, D, rows,
                                     vchunk, s2.data(), &emu_ctx);
    check_status(nm + " forward", b, a);
    if (nan) {
        printf("%s %-52s status %d (cpu %d)\n", b == ML_ENAN ? "ok  " : "FAIL", (nm + " NaN").c_str(), b, a);
        return;
    }
    check(nm + " loss", {loss2}, {loss1}, 4 * D * eps);
    check(nm + " lse", l2, l1, 4 * D * eps);
    a = ml_ce_backward_cpu(rdt, dh1.data(), dW1.data(), 1.7, h1.data(), W1.data(), tg.data(), l1.data(), S, V, D,
                           rows, vchunk, s1.data(), &emu_ctx);
    b = ml_ce_backward_cuda(dt, dh2.data(), dW2.data(), 1.7, h2.data(), W2.data(), tg.data(), l2.data(), S, V, D,
                            rows, vchunk, s2.data(), &emu_ctx);
    check_status(nm + " backward", b, a);
    double tol = 4 * (D + std::max(V, S)) * eps;
    check(nm + " dh", to_d(dt, dh2.data(), S * D), to_d(rdt, dh1.data(), S * D), dt == ML_BF16 ? BF16_DH : tol);
    auto inc1 = to_d(rdt, dW1.data(), V * D), inc2 = to_d(rdt, dW2.data(), V * D);
    if (dt == ML_BF16)   /* the increments (exact differences of f32 values) */
        for (int64_t i = 0; i < V * D; i++) {
            inc1[i] -= dWs[i];
            inc2[i] -= dWs[i];
        }
    check(nm + " dW (+=)", inc2, inc1, dt == ML_BF16 ? BF16_DW : tol);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16}) {
        run(dt, 300, 1000, 64, 128, 300, false);
        run(dt, 1, 7, 3, 1, 1, false);
        run(dt, 33, 50, 16, 1024, 1000, false);
        run(dt, 8, 50, 16, 3, 7, true);
    }
    std::vector<unsigned char> z(64);   /* the CPU refuses bf16 */
    double loss;
    check_status("bf16 forward cpu", ml_ce_forward_cpu(ML_BF16, &loss, (double *)z.data(), z.data(), z.data(),
                                                       (int64_t *)z.data(), 1, 1, 1, 1, 1, z.data(), &emu_ctx),
                 ML_EUNSUPPORTED);
    return emu_finish();
}
