/* kernels/reduce.cu under the emulator against kernels/reduce.c: bitwise
 * (values and argmax/argmin positions), NaN and ties included */
#include "cuda_util.cu.cpp"
#include "reduce.cu.cpp"
#include "emu.h"

static const char *opn[] = {"sum", "mean", "max", "min"};

static std::vector<double> input(int64_t n, int nan_at)
{
    auto x = randn(n);
    for (int64_t i = 0; i < n; i++)
        if (i % 7 == 3)
            x[i] = 1.5;   /* ties for max / min */
    if (nan_at >= 0 && nan_at < n)
        x[nan_at] = NAN;
    return x;
}

static void dim(ml_dtype dt, int64_t outer, int64_t r, int64_t inner, int nan_at)
{
    auto x = as_dt(dt, input(outer * r * inner, nan_at));
    int64_t no = outer * inner;
    for (int op = 0; op < ML_NREDOPS; op++) {
        std::vector<unsigned char> a(no * 8 + 8, 0), b(no * 8 + 8, 0xff);
        std::vector<int64_t> ia(no + 1, -7), ib(no + 1, -9);
        int ext = op >= ML_RMAX;
        ml_reduce_cpu((ml_redop)op, dt, a.data(), ext ? ia.data() : nullptr, x.data(), outer, r, inner, &emu_ctx);
        check_status("reduce", ml_reduce_cuda((ml_redop)op, dt, b.data(), ext ? ib.data() : nullptr, x.data(), outer,
                                              r, inner, &emu_ctx), ML_OK);
        char nm[96];
        snprintf(nm, sizeof nm, "dim %s %s [%ld,%ld,%ld] nan@%d", opn[op], dtn(dt), (long)outer, (long)r,
                 (long)inner, nan_at);
        check(nm, to_d(dt, b.data(), no), to_d(dt, a.data(), no), 0);
        if (ext)
            check(std::string(nm) + " idx", std::vector<double>(ib.begin(), ib.end() - 1),
                  std::vector<double>(ia.begin(), ia.end() - 1), 0);
    }
}

static void all(ml_dtype dt, int64_t n, int nan_at)
{
    auto x = as_dt(dt, input(n, nan_at));
    for (int op = 0; op < ML_NREDOPS; op++) {
        double a[2] = {0, 0}, b[2] = {0, 0};
        int64_t ia = -7, ib = -9;
        int ext = op >= ML_RMAX;
        std::vector<unsigned char> scr(ml_reduce_all_scratch_bytes_cuda(n), 0xa5);
        ml_reduce_all_cpu((ml_redop)op, dt, a, ext ? &ia : nullptr, x.data(), n, nullptr, &emu_ctx);
        check_status("reduce_all", ml_reduce_all_cuda((ml_redop)op, dt, b, ext ? &ib : nullptr, x.data(), n, scr.data(),
                                                      &emu_ctx),
                     ML_OK);
        char nm[96];
        snprintf(nm, sizeof nm, "all %s %s n=%ld nan@%d", opn[op], dtn(dt), (long)n, nan_at);
        check(nm, to_d(dt, b, 1), to_d(dt, a, 1), 0);
        if (ext)
            check(std::string(nm) + " idx", {(double)ib}, {(double)ia}, 0);
    }
}

static void cumsum(ml_dtype dt, int64_t outer, int64_t r, int64_t inner)
{
    size_t n = outer * r * inner;
    std::vector<double> v = randn(n);
    if (dt == ML_I32 || dt == ML_I64)
        for (auto &e : v)
            e = floor(e * 100);
    auto x = as_dt(dt, v);
    std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
    ml_cumsum_cpu(dt, a.data(), x.data(), outer, r, inner, &emu_ctx);
    check_status("cumsum", ml_cumsum_cuda(dt, b.data(), x.data(), outer, r, inner, &emu_ctx), ML_OK);
    char nm[96];
    snprintf(nm, sizeof nm, "cumsum %s [%ld,%ld,%ld]", dtn(dt), (long)outer, (long)r, (long)inner);
    check(nm, to_d(dt, b.data(), n), to_d(dt, a.data(), n), 0);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64}) {
        dim(dt, 3, 17, 5, -1);
        dim(dt, 300, 4, 1, 11);
        dim(dt, 1, 1000, 1, 500);
        dim(dt, 2, 0, 3, -1);
        dim(dt, 1, 1, 1, -1);
        all(dt, 10007, -1);
        all(dt, 10007, 4097);
        all(dt, 0, -1);
        all(dt, 1, -1);
        all(dt, 4096 * 1024 + 4097, -1);        /* two super blocks */
        all(dt, 4096 * 1024 + 4097, 4096 * 1024 + 9);
    }
    for (ml_dtype dt : {ML_F32, ML_F64, ML_I32, ML_I64}) {
        cumsum(dt, 3, 17, 5);
        cumsum(dt, 1, 1000, 1);
        cumsum(dt, 300, 1, 2);
    }
    return emu_finish();
}
