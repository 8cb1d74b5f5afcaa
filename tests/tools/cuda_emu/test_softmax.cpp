/* kernels/softmax.cu under the emulator against kernels/softmax.c
 * (tests/spec/gpu_spec.lua: 32 eps normwise; NaN rows NaN in the same
 * places); in place equals out of place bitwise */
#include "cuda_util.cu.cpp"
#include "softmax.cu.cpp"
#include "emu.h"

static void run(ml_dtype dt, int64_t rows, int64_t cols, int nan_row, int inf_row)
{
    double tol = 32 * (dt == ML_F32 ? EPS32 : EPS64);
    auto v = randn(rows * cols, 4.0);
    if (nan_row >= 0 && nan_row < rows)
        v[nan_row * cols + cols / 2] = NAN;
    if (inf_row >= 0 && inf_row < rows)   /* a row of -inf: 0/0 on both sides */
        for (int64_t j = 0; j < cols; j++)
            v[inf_row * cols + j] = -INFINITY;
    auto x = as_dt(dt, v);
    for (int log = 0; log < 2; log++) {
        std::vector<unsigned char> a(x.size(), 0), b(x.size(), 0xff), c = x;
        ml_softmax_cpu(log, dt, a.data(), x.data(), rows, cols, &emu_ctx);
        char nm[96];
        snprintf(nm, sizeof nm, "%s %s [%ld,%ld] nan@%d -inf@%d", log ? "log_softmax" : "softmax", dtn(dt),
                 (long)rows, (long)cols, nan_row, inf_row);
        check_status(nm, ml_softmax_cuda(log, dt, b.data(), x.data(), rows, cols, &emu_ctx), ML_OK);
        check(nm, to_d(dt, b.data(), rows * cols), to_d(dt, a.data(), rows * cols), tol);
        check_status(std::string(nm) + " in place", ml_softmax_cuda(log, dt, c.data(), c.data(), rows, cols,
                                                                    &emu_ctx), ML_OK);
        check(std::string(nm) + " in place", to_d(dt, c.data(), rows * cols), to_d(dt, b.data(), rows * cols), 0);
    }
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64}) {
        run(dt, 65, 8, -1, -1);
        run(dt, 65, 1000, 3, -1);
        run(dt, 2, 3, 0, -1);
        run(dt, 1, 1, -1, -1);
        run(dt, 5, 129, 4, 1);
        run(dt, 3, 127, -1, 2);
        run(dt, 0, 5, -1, -1);
        run(dt, 4, 0, -1, -1);
    }
    check_status("softmax bf16 refused", ml_softmax_cuda(0, ML_BF16, nullptr, nullptr, 1, 1, &emu_ctx),
                 ML_EUNSUPPORTED);
    return emu_finish();
}
