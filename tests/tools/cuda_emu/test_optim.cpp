/* kernels/optim.cu under the emulator against kernels/optim.c (expected
 * bitwise; tests/spec/gpu_optim_spec.lua's bounds: updates f32 1e-6, f64
 * 1e-12, norms n 2^-53 relative) */
#include "cuda_util.cu.cpp"
#include "optim.cu.cpp"
#include "emu.h"

typedef std::vector<unsigned char> buf;

static double tol_of(ml_dtype dt) { return dt == ML_F32 ? 1e-6 : 1e-12; }

static void adamw(ml_dtype dt, int64_t n, double beta1)
{
    auto p = as_dt(dt, randn(n)), m = as_dt(dt, std::vector<double>(n)), v = m;
    buf gp = p, gm = m, gv = v;
    for (int t = 1; t <= 5; t++) {
        auto g = as_dt(dt, randn(n, 0.1));
        ml_adamw_hp hp = {1e-2 * (t % 2 == 0 ? 0.5 : 1), beta1, 0.95, 1e-8, 0.1, t};
        ml_adamw_cpu(dt, p.data(), m.data(), v.data(), g.data(), n, &hp, &emu_ctx);
        check_status("adamw", ml_adamw_cuda(dt, gp.data(), gm.data(), gv.data(), g.data(), n, &hp, &emu_ctx), ML_OK);
    }
    char nm[64];
    snprintf(nm, sizeof nm, "adamw %s n=%ld beta1=%g", dtn(dt), (long)n, beta1);
    check(std::string(nm) + " p", to_d(dt, gp.data(), n), to_d(dt, p.data(), n), tol_of(dt));
    check(std::string(nm) + " m", to_d(dt, gm.data(), n), to_d(dt, m.data(), n), tol_of(dt));
    check(std::string(nm) + " v", to_d(dt, gv.data(), n), to_d(dt, v.data(), n), tol_of(dt));
}

static void sgd(ml_dtype dt, int64_t n, double mom, double damp, double wd, int nest)
{
    auto p = as_dt(dt, randn(n)), b = as_dt(dt, std::vector<double>(n));
    buf gp = p, gb = b;
    for (int t = 1; t <= 5; t++) {
        auto g = as_dt(dt, randn(n, 0.1));
        ml_sgd_hp hp = {1e-2, mom, damp, wd, nest, t == 1};
        ml_sgd_cpu(dt, p.data(), b.data(), g.data(), n, &hp, &emu_ctx);
        check_status("sgd", ml_sgd_cuda(dt, gp.data(), gb.data(), g.data(), n, &hp, &emu_ctx), ML_OK);
    }
    char nm[80];
    snprintf(nm, sizeof nm, "sgd %s n=%ld mom=%g damp=%g wd=%g nest=%d", dtn(dt), (long)n, mom, damp, wd, nest);
    check(std::string(nm) + " p", to_d(dt, gp.data(), n), to_d(dt, p.data(), n), tol_of(dt));
    check(std::string(nm) + " buf", to_d(dt, gb.data(), n), to_d(dt, b.data(), n), tol_of(dt));
}

static void lazy(ml_dtype dt, int64_t E, int64_t S)
{
    int64_t n = E * S;
    auto p = as_dt(dt, randn(n));
    buf gp = p;
    std::vector<buf> ms(E), vs(E), gms(E), gvs(E);
    std::vector<void *> mp(E), vp(E), gmp(E), gvp(E);
    for (int64_t e = 0; e < E; e++) {
        if (e == 2)
            continue;   /* expert 2 has no states; never active */
        ms[e] = vs[e] = gms[e] = gvs[e] = as_dt(dt, std::vector<double>(S));
        mp[e] = ms[e].data(), vp[e] = vs[e].data(), gmp[e] = gms[e].data(), gvp[e] = gvs[e].data();
    }
    uint8_t masks[5][4] = {{1, 1, 0, 0}, {0, 1, 0, 1}, {1, 0, 0, 1}, {1, 1, 0, 1}, {0, 0, 0, 0}};
    std::vector<int64_t> steps(E), gsteps(E);
    ml_adamw_hp hp = {1e-2, 0.9, 0.99, 1e-8, 0.1, 0};
    for (auto &mask : masks) {
        auto g = as_dt(dt, randn(n, 0.1));
        int64_t k = -1, gk = -2;
        ml_lazy_adamw_cpu(dt, p.data(), mp.data(), vp.data(), steps.data(), g.data(), mask, n, E, &hp, &k, &emu_ctx);
        check_status("lazy", ml_lazy_adamw_cuda(dt, gp.data(), gmp.data(), gvp.data(), gsteps.data(), g.data(), mask,
                                                n, E, &hp, &gk, &emu_ctx), ML_OK);
        check_status("lazy nactive", (ml_status)gk, (ml_status)k);
    }
    std::string nm = std::string("lazy adamw ") + dtn(dt) + " E=" + std::to_string(E) + " S=" + std::to_string(S);
    check(nm + " p", to_d(dt, gp.data(), n), to_d(dt, p.data(), n), tol_of(dt));
    for (int64_t e = 0; e < E; e++)
        if (e != 2) {
            check(nm + " m" + std::to_string(e), to_d(dt, gms[e].data(), S), to_d(dt, ms[e].data(), S), tol_of(dt));
            check(nm + " v" + std::to_string(e), to_d(dt, gvs[e].data(), S), to_d(dt, vs[e].data(), S), tol_of(dt));
        }
    check(nm + " steps", std::vector<double>(gsteps.begin(), gsteps.end()),
          std::vector<double>(steps.begin(), steps.end()), 0);
}

static void norms(ml_dtype dt, int64_t n, int64_t E)
{
    auto x = as_dt(dt, randn(n));
    double a = -1, b = -2;
    std::string nm = std::string(dtn(dt)) + " n=" + std::to_string(n) + " E=" + std::to_string(E);
    std::vector<unsigned char> scr(ml_sumsq_scratch_bytes_cuda(n), 0xa5);
    ml_sumsq_cpu(dt, &a, x.data(), n, nullptr, &emu_ctx);
    check_status("sumsq", ml_sumsq_cuda(dt, &b, x.data(), n, scr.data(), &emu_ctx), ML_OK);
    check("sumsq " + nm, {b}, {a}, n * EPS64);
    std::vector<double> cn(E, -1), gn(E, NAN), f(E);
    std::vector<unsigned char> nscr(ml_slice_norms_scratch_bytes_cuda(n, E), 0xa5);
    ml_slice_norms_cpu(dt, cn.data(), x.data(), n, E, nullptr, &emu_ctx);
    check_status("slice_norms", ml_slice_norms_cuda(dt, gn.data(), x.data(), n, E, nscr.data(), &emu_ctx),
                 ML_OK);
    check("slice_norms " + nm, gn, cn, n * EPS64);
    for (int64_t e = 0; e < E; e++)
        f[e] = 0.5 + e * 0.37;
    buf gx = x;
    ml_scale_slices_cpu(dt, x.data(), f.data(), n, E, &emu_ctx);
    check_status("scale_slices", ml_scale_slices_cuda(dt, gx.data(), f.data(), n, E, &emu_ctx), ML_OK);
    check("scale_slices " + nm, to_d(dt, gx.data(), n), to_d(dt, x.data(), n), 0);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64}) {
        for (double b1 : {0.9, 0.3})
            adamw(dt, 10007, b1);
        adamw(dt, 1, 0.9);
        sgd(dt, 10007, 0, 0, 0.01, 0);
        sgd(dt, 10007, 0.9, 0.1, 0, 0);
        sgd(dt, 10007, 0.9, 0, 0.01, 1);
        lazy(dt, 4, 2501);
        norms(dt, 10007, 1);
        norms(dt, 0, 3);
        norms(dt, 2 * (4096 * 1024 + 6), 2);   /* slices past one super block */
        norms(dt, 4096 * 1024 * 2 + 5, 1);
        norms(dt, 30, 30);
    }
    return emu_finish();
}
