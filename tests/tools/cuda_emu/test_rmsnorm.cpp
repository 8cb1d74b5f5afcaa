/* kernels/rmsnorm.cu under the emulator against kernels/rmsnorm.c
 * (tolerances of tests/spec/gpu_dense_spec.lua). bf16: inputs rounded to
 * bf16, the reference the CPU's f32 kernel on the widened values; y and dx
 * (bf16) within 2^-8 normwise, dw (f32, ml_grad_dtype: the same f64 terms
 * in another fixed order, rounded once) within 4 f32 eps like f32's. */
#include "cuda_util.cu.cpp"
#include "rmsnorm.cu.cpp"
#include "emu.h"

static void run(ml_dtype dt, int64_t N, int64_t D)
{
    ml_dtype rt = ml_grad_dtype(dt);   /* the CPU has no bf16: f32 on the rounded inputs */
    ml_dtype gd = ml_grad_dtype(dt);              /* dw's dtype */
    double tol_y = dt == ML_F32 ? 64 * EPS32 : dt == ML_F64 ? 1e-12 : 1.0 / 256;
    double tol_dx = dt == ML_F32 ? 128 * EPS32 : dt == ML_F64 ? 1e-12 : 1.0 / 256;
    double tol_r = dt == ML_BF16 ? 64 * EPS32 : tol_y;
    double tol_dw = dt == ML_F64 ? 1e-12 : 4 * EPS32;
    auto x = rounded(dt, randn(N * D)), w = rounded(dt, randn(D)), dy = rounded(dt, randn(N * D));
    auto dw0 = rounded(gd, randn(D));
    char nm[96];
    snprintf(nm, sizeof nm, "%s N=%ld D=%ld", dtn(dt), (long)N, (long)D);
    std::string s = nm;

    /* CPU */
    auto cx = as_dt(rt, x), cw = as_dt(rt, w), cdy = as_dt(rt, dy), cy = as_dt(rt, x), cdx = as_dt(rt, x),
         cdw = as_dt(rt, dw0);
    std::vector<double> crstd(N + 1);
    ml_rmsnorm_forward_cpu(rt, cy.data(), crstd.data(), cx.data(), cw.data(), N, D, 1e-5, &emu_ctx);
    ml_rmsnorm_backward_cpu(rt, cdx.data(), cdw.data(), cdy.data(), cx.data(), cw.data(), crstd.data(), N, D,
                            &emu_ctx);
    /* emulated device, outputs poisoned */
    auto gx = as_dt(dt, x), gw = as_dt(dt, w), gdy = as_dt(dt, dy), gdw = as_dt(gd, dw0);
    std::vector<unsigned char> gy(N * D * ml_dtype_size(dt) + 1, 0xff), gdx(gy.size(), 0xff);
    std::vector<double> grstd(N + 1, NAN);
    check_status(s + " fwd", ml_rmsnorm_forward_cuda(dt, gy.data(), grstd.data(), gx.data(), gw.data(), N, D,
                                                     1e-5, &emu_ctx), ML_OK);
    check_status(s + " bwd", ml_rmsnorm_backward_cuda(dt, gdx.data(), gdw.data(), gdy.data(), gx.data(),
                                                      gw.data(), grstd.data(), N, D, &emu_ctx), ML_OK);
    if (N * D == 0) {
        check(s + " dw untouched", to_d(gd, gdw.data(), D), dw0, 0);
        return;
    }
    check(s + " y", to_d(dt, gy.data(), N * D), to_d(rt, cy.data(), N * D), tol_y);
    check(s + " rstd", std::vector<double>(grstd.begin(), grstd.begin() + N),
          std::vector<double>(crstd.begin(), crstd.begin() + N), tol_r);
    if (D > 1)   /* D = 1: dx = r g (1 - x^2 r^2) cancels to ~eps: no relative parity */
        check(s + " dx", to_d(dt, gdx.data(), N * D), to_d(rt, cdx.data(), N * D), tol_dx);
    check(s + " dw (+=, " + dtn(gd) + ")", to_d(gd, gdw.data(), D), to_d(rt, cdw.data(), D), tol_dw);
}

int main()
{
    int64_t shapes[][2] = {{300, 320}, {1, 1}, {7, 33}, {65, 600}, {3, 1025}, {0, 8}, {40, 2}};
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16})
        for (auto &sh : shapes)
            run(dt, sh[0], sh[1]);
    return emu_finish();
}
