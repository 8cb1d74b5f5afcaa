/* kernels/topk.cu under the emulator against kernels/topk.c: values and
 * indices bitwise (tests/spec/gpu_spec.lua), ties to the lower index, k
 * past the 64-entry row buffer, NaN refused with ML_ENAN */
#include "cuda_util.cu.cpp"
#include "topk.cu.cpp"
#include "emu.h"

static void run(ml_dtype dt, int64_t rows, int64_t cols, int64_t k, int ties, int nan_at)
{
    auto v = randn(rows * cols, 3.0);
    if (ties)   /* few distinct values: many ties */
        for (auto &e : v)
            e = floor(e);
    if (nan_at >= 0 && nan_at < rows * cols)
        v[nan_at] = NAN;
    auto x = as_dt(dt, v);
    size_t n = rows * k;
    std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
    std::vector<int64_t> ia(n + 1, -7), ib(n + 1, -9);
    std::vector<unsigned char> scr(ml_topk_scratch_bytes_cuda(rows, cols, k), 0xa5);
    ml_status want = ml_topk_cpu(dt, a.data(), ia.data(), x.data(), rows, cols, k, nullptr, &emu_ctx);
    char nm[96];
    snprintf(nm, sizeof nm, "topk %s [%ld,%ld] k=%ld ties=%d nan@%d", dtn(dt), (long)rows, (long)cols, (long)k,
             ties, nan_at);
    check_status(nm, ml_topk_cuda(dt, b.data(), ib.data(), x.data(), rows, cols, k, scr.data(), &emu_ctx), want);
    check(nm, to_d(dt, b.data(), n), to_d(dt, a.data(), n), 0);
    check(std::string(nm) + " idx", std::vector<double>(ib.begin(), ib.begin() + n),
          std::vector<double>(ia.begin(), ia.begin() + n), 0);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64}) {
        for (int64_t k : {1, 2, 8, 64})
            run(dt, 200, 64, k, 0, -1);
        run(dt, 200, 64, 3, 1, -1);
        run(dt, 2, 5, 3, 1, -1);
        run(dt, 3, 300, 100, 0, -1);
        run(dt, 3, 300, 65, 1, -1);
        run(dt, 1, 1, 1, 0, -1);
        run(dt, 129, 7, 2, 0, 40);
        run(dt, 4, 6, 6, 0, 0);
        run(dt, 0, 6, 2, 0, -1);
        run(dt, 5, 6, 0, 0, -1);
    }
    return emu_finish();
}
