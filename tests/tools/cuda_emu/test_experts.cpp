/* kernels/experts.cu under the emulator against kernels/experts.c
 * (tests/spec/gpu_spec.lua's tolerance 16 (D + 2F) eps); cuBLAS is stubbed
 * with ml_matmul_cpu, so only the experts' own kernels are emulated.
 * Prints kernel launches and GEMM calls per tile; EMU_DIGEST=1 prints a
 * digest of each case's device outputs (to compare two versions of
 * experts.cu bitwise) */
#include "cuda_util.cu.cpp"
#include "experts.cu.cpp"
#include "emu.h"
extern "C" {
#include "dispatch.h"
}

static long gemms = 0;
extern "C" ml_status ml_matmul_cuda(ml_dtype dt, void *c, const void *a, const void *b, const ml_gemm_shape *s,
                                    const ml_kctx *ctx)
{
    gemms++;
    return ml_matmul_cpu(dt, c, a, b, s, ctx);
}

/* launches (kernels, GEMMs) since the last call, per tile */
static void per_tile(const std::string &what, long &k0, long &g0, int64_t tiles)
{
    printf("     %-52s %.2f kernels + %.2f GEMMs per tile (%ld tiles)\n", what.c_str(),
           (double)(emu_launches - k0) / tiles, (double)(gemms - g0) / tiles, (long)tiles);
    k0 = emu_launches;
    g0 = gemms;
}

static uint64_t digest = 1469598103934665603ull;
static void eat(const std::vector<unsigned char> &b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        digest = (digest ^ b[i]) * 1099511628211ull;
}

static void run(ml_dtype dt, int64_t T, int64_t k, int64_t D, int64_t F, int64_t E, int64_t tile, int64_t cap,
                int save)
{
    double tol = 16 * (D + 2 * F) * (dt == ML_F32 ? EPS32 : EPS64);
    int64_t n = T * k;
    std::vector<int64_t> idx(n), off(E + 1), order(n), counts(E);
    std::vector<uint8_t> dropped(n);
    std::uniform_int_distribution<int64_t> u(0, E - 1);
    for (auto &i : idx)
        i = u(emu_rng);
    int64_t nd = 0;
    ml_dispatch_cpu(off.data(), order.data(), counts.data(), dropped.data(), &nd, idx.data(), n, E, cap, nullptr, &emu_ctx);
    int64_t S = save == 0 ? 0 : save == 1 ? off[E] : off[E] / 2;
    ml_experts_cfg c = {T, k, D, F, E, tile, S};
    auto x = as_dt(dt, randn(T * D)), w = as_dt(dt, randn(n)), gu = as_dt(dt, randn(E * 2 * F * D, 0.2));
    auto dn = as_dt(dt, randn(E * D * F, 0.2)), dy = as_dt(dt, randn(T * D));
    size_t es = ml_dtype_size(dt);
    std::vector<unsigned char> y1(T * D * es + 8), y2(T * D * es + 8, 0xff), h1(S * 2 * F * es + 8), h2(h1.size(), 0xff);
    std::vector<unsigned char> sf1(ml_experts_forward_scratch(&c) * es + 8), sf2(sf1.size());
    std::string nm = std::string(dtn(dt)) + " T=" + std::to_string(T) + " E=" + std::to_string(E) + " tile=" +
                     std::to_string(tile) + " cap=" + std::to_string(cap) + " S=" + std::to_string(S);
    int64_t tiles = 0;
    for (int64_t e = 0; e < E; e++)
        tiles += (off[e + 1] - off[e] + tile - 1) / tile;
    long k0 = emu_launches, g0 = gemms;
    check_status(nm + " fwd", ml_experts_forward_cuda(dt, y2.data(), h2.data(), sf2.data(), x.data(), w.data(),
                                                      order.data(), off.data(), gu.data(), dn.data(), &c, &emu_ctx),
                 ml_experts_forward_cpu(dt, y1.data(), h1.data(), sf1.data(), x.data(), w.data(), order.data(),
                                        off.data(), gu.data(), dn.data(), &c, &emu_ctx));
    per_tile(nm + " fwd", k0, g0, tiles);
    check(nm + " y", to_d(dt, y2.data(), T * D), to_d(dt, y1.data(), T * D), tol);
    int64_t hs = S / tile * tile;   /* only whole tiles below S are saved */
    if (save == 1 && cap < 0)
        hs = S;
    check(nm + " h_saved", to_d(dt, h2.data(), hs * 2 * F), to_d(dt, h1.data(), hs * 2 * F), tol);
    auto dx1 = as_dt(dt, randn(T * D)), dgu1 = as_dt(dt, randn(E * 2 * F * D)), ddn1 = as_dt(dt, randn(E * D * F));
    auto dx2 = dx1, dgu2 = dgu1, ddn2 = ddn1;
    std::vector<unsigned char> dw1(n * es), dw2(n * es, 0xff), sb1(ml_experts_backward_scratch(&c) * es + 8),
        sb2(sb1.size());
    std::vector<uint8_t> t1(E, 9), t2(E, 7);
    check_status(nm + " bwd", ml_experts_backward_cuda(dt, dx2.data(), dgu2.data(), ddn2.data(), dw2.data(), t2.data(),
                                                       sb2.data(), h1.data(), dy.data(), x.data(), w.data(),
                                                       order.data(), off.data(), gu.data(), dn.data(), &c, &emu_ctx),
                 ml_experts_backward_cpu(dt, dx1.data(), dgu1.data(), ddn1.data(), dw1.data(), t1.data(), sb1.data(),
                                         h1.data(), dy.data(), x.data(), w.data(), order.data(), off.data(), gu.data(),
                                         dn.data(), &c, &emu_ctx));
    per_tile(nm + " bwd", k0, g0, tiles);
    eat(y2, T * D * es), eat(h2, hs * 2 * F * es), eat(dx2, T * D * es), eat(dgu2, dgu2.size()),
        eat(ddn2, ddn2.size()), eat(dw2, n * es);
    if (getenv("EMU_DIGEST"))
        printf("     digest %016llx %s\n", (unsigned long long)digest, nm.c_str());
    check(nm + " dx (+=)", to_d(dt, dx2.data(), T * D), to_d(dt, dx1.data(), T * D), tol);
    check(nm + " dgate_up (+=)", to_d(dt, dgu2.data(), E * 2 * F * D), to_d(dt, dgu1.data(), E * 2 * F * D), tol);
    check(nm + " ddown (+=)", to_d(dt, ddn2.data(), E * D * F), to_d(dt, ddn1.data(), E * D * F), tol);
    check(nm + " dw", to_d(dt, dw2.data(), n), to_d(dt, dw1.data(), n), tol);
    check(nm + " touched", std::vector<double>(t2.begin(), t2.end()), std::vector<double>(t1.begin(), t1.end()), 0);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64}) {
        run(dt, 100, 2, 24, 20, 6, 32, -1, 1);
        run(dt, 100, 2, 24, 20, 6, 32, -1, 0);
        run(dt, 100, 2, 24, 20, 6, 17, -1, 2);
        run(dt, 100, 2, 24, 20, 6, 64, 25, 1);
        run(dt, 33, 3, 7, 5, 11, 5, 4, 2);
        run(dt, 40, 3, 300, 8, 2, 16, -1, 2);   /* D over a column block; a token twice in most tiles */
        run(dt, 10, 2, 0, 4, 3, 4, -1, 1);      /* D = 0 */
    }
    return emu_finish();
}
