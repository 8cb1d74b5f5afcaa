/* kernels/index.cu under the emulator against kernels/index.c: bitwise
 * (tests/spec/gpu_spec.lua) for index_select and gather of every element
 * size, scatter_add in index order (repeated indices), bincount */
#include "cuda_util.cu.cpp"
#include "index.cu.cpp"
#include "emu.h"

static std::vector<int64_t> indices(size_t m, int64_t n)
{
    std::vector<int64_t> r(m);
    std::uniform_int_distribution<int64_t> u(0, n > 0 ? n - 1 : 0);
    for (auto &i : r)
        i = u(emu_rng);
    return r;
}

static std::vector<double> values(ml_dtype dt, size_t n)
{
    auto v = randn(n, dt == ML_I32 || dt == ML_I64 || dt == ML_U8 ? 50.0 : 1.0);
    for (size_t i = 0; i < n; i++) {
        if (dt == ML_I32 || dt == ML_I64 || dt == ML_U8)
            v[i] = floor(fabs(v[i]));
        if (i % 11 == 5 && dt != ML_I32 && dt != ML_I64 && dt != ML_U8)
            v[i] = NAN;
    }
    return v;
}

static std::string shape(const char *what, ml_dtype dt, int64_t outer, int64_t n, int64_t inner, int64_t m)
{
    char nm[96];
    snprintf(nm, sizeof nm, "%s %s outer=%ld n=%ld inner=%ld m=%ld", what, dtn(dt), (long)outer, (long)n,
             (long)inner, (long)m);
    return nm;
}

static void select_gather(ml_dtype dt, int64_t outer, int64_t n, int64_t inner, int64_t m)
{
    auto x = as_dt(dt, values(dt, outer * n * inner));
    size_t no = outer * m * inner, es = ml_dtype_size(dt);
    for (int gather = 0; gather < 2; gather++) {
        auto idx = indices(gather ? no : m, n);
        std::vector<unsigned char> a(no * es + 8, 0), b(no * es + 8, 0xff);
        auto nm = shape(gather ? "gather" : "index_select", dt, outer, n, inner, m);
        if (gather) {
            ml_gather_cpu(dt, a.data(), x.data(), idx.data(), outer, n, inner, m, &emu_ctx);
            check_status(nm, ml_gather_cuda(dt, b.data(), x.data(), idx.data(), outer, n, inner, m, &emu_ctx),
                         ML_OK);
        } else {
            ml_index_select_cpu(dt, a.data(), x.data(), idx.data(), outer, n, inner, m, &emu_ctx);
            check_status(nm, ml_index_select_cuda(dt, b.data(), x.data(), idx.data(), outer, n, inner, m,
                                                  &emu_ctx), ML_OK);
        }
        check(nm, std::vector<double>(b.begin(), b.begin() + no * es),
              std::vector<double>(a.begin(), a.begin() + no * es), 0);   /* the bytes */
    }
}

static void scatter_add(ml_dtype dt, int64_t outer, int64_t n, int64_t inner, int64_t m)
{
    auto base = values(dt, outer * n * inner);
    for (auto &e : base)
        if (e != e)
            e = 0.5;
    auto src = values(dt, outer * m * inner);
    if (dt == ML_F32 || dt == ML_F64)   /* a NaN source only poisons its column, on both sides */
        for (size_t i = 0; i < src.size(); i++)
            src[i] = i == 7 ? NAN : src[i] != src[i] ? 1e8 : src[i];
    auto idx = indices(outer * m * inner, n);
    auto a = as_dt(dt, base), b = a, s = as_dt(dt, src);
    auto nm = shape("scatter_add", dt, outer, n, inner, m);
    ml_status want = ml_scatter_add_cpu(dt, a.data(), s.data(), idx.data(), outer, n, inner, m, &emu_ctx);
    check_status(nm, ml_scatter_add_cuda(dt, b.data(), s.data(), idx.data(), outer, n, inner, m, &emu_ctx), want);
    size_t no = outer * n * inner;
    check(nm, to_d(dt, b.data(), no), to_d(dt, a.data(), no), 0);
}

static void bincount(int64_t n, int64_t nbins)
{
    auto idx = indices(n, nbins);
    std::vector<int64_t> a(nbins + 1, -3), b(nbins + 1, -5);
    ml_bincount_cpu(a.data(), idx.data(), n, nbins, &emu_ctx);
    char nm[64];
    snprintf(nm, sizeof nm, "bincount n=%ld nbins=%ld", (long)n, (long)nbins);
    check_status(nm, ml_bincount_cuda(b.data(), idx.data(), n, nbins, &emu_ctx), ML_OK);
    check(nm, std::vector<double>(b.begin(), b.end() - 1), std::vector<double>(a.begin(), a.end() - 1), 0);
    check(std::string(nm) + " past the end", {(double)b[nbins]}, {-5.0}, 0);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16, ML_I32, ML_I64, ML_U8}) {
        select_gather(dt, 5, 6, 7, 4);
        select_gather(dt, 1, 6, 42, 3);
        select_gather(dt, 30, 7, 1, 5);
        select_gather(dt, 3, 257, 1, 300);
        select_gather(dt, 1, 1, 1, 1);
        select_gather(dt, 0, 5, 3, 2);
        select_gather(dt, 2, 5, 0, 2);
        select_gather(dt, 2, 5, 3, 0);
    }
    for (ml_dtype dt : {ML_F32, ML_F64, ML_I32, ML_I64}) {
        scatter_add(dt, 5, 6, 7, 4);
        scatter_add(dt, 1, 3, 300, 40);
        scatter_add(dt, 40, 1, 9, 17);
        scatter_add(dt, 1, 1, 1, 1);
        scatter_add(dt, 2, 3, 4, 0);
        scatter_add(dt, 0, 3, 4, 2);
    }
    check_status("scatter_add bf16 refused", ml_scatter_add_cuda(ML_BF16, nullptr, nullptr, nullptr, 1, 1, 1, 1,
                                                                 &emu_ctx), ML_EUNSUPPORTED);
    bincount(10000, 40);
    bincount(1, 1);
    bincount(0, 5);
    bincount(300, 257);
    bincount(5, 0);
    return emu_finish();
}
