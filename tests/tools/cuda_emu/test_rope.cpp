/* kernels/rope.cu under the emulator against kernels/rope.c (tolerances
 * of tests/spec/gpu_dense_spec.lua); in place (y = x) too */
#include "cuda_util.cu.cpp"
#include "rope.cu.cpp"
#include "emu.h"

static void run(ml_dtype dt, int64_t S, int64_t H, int64_t hd, int64_t off, double theta, bool inplace)
{
    ml_dtype rt = ml_grad_dtype(dt);
    double tol = dt == ML_F32 ? 8 * EPS32 : dt == ML_F64 ? 1e-11 : 1.0 / 256;
    size_t n = S * H * hd;
    auto x = rounded(dt, randn(n));
    char nm[96];
    snprintf(nm, sizeof nm, "%s S=%ld H=%ld hd=%ld off=%ld%s", dtn(dt), (long)S, (long)H, (long)hd, (long)off,
             inplace ? " in place" : "");
    for (int dir = 0; dir < 2; dir++) {
        auto cx = as_dt(rt, x), cy = as_dt(rt, x);
        auto gx = as_dt(dt, x);
        std::vector<unsigned char> gy(n * ml_dtype_size(dt) + 1, 0xff);
        void *out = inplace ? gx.data() : gy.data();
        if (dir == 0) {
            ml_rope_forward_cpu(rt, cy.data(), cx.data(), S, H, hd, off, theta, &emu_ctx);
            check_status(nm, ml_rope_forward_cuda(dt, out, gx.data(), S, H, hd, off, theta, &emu_ctx), ML_OK);
        } else {
            ml_rope_backward_cpu(rt, cy.data(), cx.data(), S, H, hd, off, theta, &emu_ctx);
            check_status(nm, ml_rope_backward_cuda(dt, out, gx.data(), S, H, hd, off, theta, &emu_ctx), ML_OK);
        }
        check(std::string(nm) + (dir ? " bwd" : " fwd"), to_d(dt, out, n), to_d(rt, cy.data(), n), tol);
    }
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16}) {
        run(dt, 130, 3, 64, 0, 10000, false);
        run(dt, 130, 3, 64, 1000, 500000, false);
        run(dt, 7, 2, 6, 3, 10000, true);
        run(dt, 1, 1, 2, 0, 10000, false);
        run(dt, 300, 1, 2, 5, 10000, true);
    }
    /* empty: nothing written, status ok */
    check_status("S=0", ml_rope_forward_cuda(ML_F32, nullptr, nullptr, 0, 3, 64, 0, 1e4, &emu_ctx), ML_OK);
    return emu_finish();
}
