/* kernels/experts.cu under the emulator against kernels/experts.c
 * (tests/spec/gpu_spec.lua's tolerance 16 (D + 2F) eps); cuBLAS is stubbed
 * with ml_matmul_cpu, so only the experts' own kernels are emulated.
 * Per plan: one call over all experts; one with an expert skipped (NULL
 * table entry, cfg.accumulate = 1 into prefilled outputs: nothing of it
 * written on either side); two calls over expert halves (accumulate 0
 * then 1), against the CPU's one call and bitwise against each backend's
 * own one call (experts.h: "results are bitwise one call's").
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
extern "C" ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                                    const ml_gemm_shape *s, const ml_kctx *ctx)
{
    gemms++;
    return emu_cublas(dt, cdt, c, a, b, s, ctx);
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

typedef std::vector<unsigned char> bytes;
/* n bytes of fill, and one more: a buffer of 0 elements is not NULL */
static bytes buf(size_t n, int fill) { return bytes(n + 1, (unsigned char)fill); }

/* A plan and the layer's inputs: the weights as [E, 2F, D] / [E, D, F]
 * blocks the tables point into. */
struct problem {
    ml_dtype dt;
    size_t es;
    ml_experts_cfg c;
    std::vector<int64_t> off, order;
    bytes x, w, gu, dn, dy;
};

/* What one backend writes; the same starting values on both sides unless
 * a case says otherwise. */
struct outs {
    bytes y, h, dx, dgu, ddn, dw;
    std::vector<uint8_t> touched;
};

/* The tables of the experts in sel, pointing into the blocks (weights)
 * and into o's gradients; NULL for the others. */
struct tables {
    std::vector<const void *> gu, dn;
    std::vector<void *> dgu, ddn;
    ml_experts_weights wt;
    ml_experts_wgrads dwt;
    tables(const problem &P, outs &o, const std::vector<bool> &sel)
    {
        int64_t E = P.c.E, gs = 2 * P.c.F * P.c.D * P.es, ds = P.c.D * P.c.F * P.es;
        for (int64_t e = 0; e < E; e++) {
            gu.push_back(sel[e] ? P.gu.data() + e * gs : nullptr);
            dn.push_back(sel[e] ? P.dn.data() + e * ds : nullptr);
            dgu.push_back(sel[e] ? o.dgu.data() + e * gs : nullptr);
            ddn.push_back(sel[e] ? o.ddn.data() + e * ds : nullptr);
        }
        wt = {gu.data(), dn.data()};
        dwt = {dgu.data(), ddn.data()};
    }
};

/* Forward then backward over the experts in sel, on the CPU (ctx
 * emu_ctx, nthreads lanes of scratch) or CUDA (one lane); backward reads
 * hb (the CPU's one-call h, so its comparisons do not compound forward's). */
static void pass(bool cuda, const problem &P, outs &o, const std::vector<bool> &sel, int acc, const bytes &hb,
                 const std::string &nm)
{
    ml_experts_cfg c = P.c;
    c.accumulate = acc;
    tables tb(P, o, sel);
    auto sz = [&](int b) {
        return cuda ? ml_experts_scratch_bytes_cuda(P.dt, &c, b, 1) : ml_experts_scratch_bytes(P.dt, &c, b, emu_ctx.nthreads);
    };
    bytes sf(sz(0), 0xa5), sb(sz(1), 0xa5);
    void *h = c.nsaved ? o.h.data() : nullptr;
    const void *hr = c.nsaved ? hb.data() : nullptr;
    auto f = cuda ? ml_experts_forward_cuda : ml_experts_forward_cpu;
    auto b = cuda ? ml_experts_backward_cuda : ml_experts_backward_cpu;
    check_status(nm + (cuda ? " fwd cuda" : " fwd cpu"),
                 f(P.dt, o.y.data(), h, sf.data(), P.x.data(), P.w.data(), P.order.data(), P.off.data(), &tb.wt, &c,
                   &emu_ctx), ML_OK);
    check_status(nm + (cuda ? " bwd cuda" : " bwd cpu"),
                 b(P.dt, o.dx.data(), &tb.dwt, o.dw.data(), o.touched.data(), sb.data(), hr, P.dy.data(), P.x.data(),
                   P.w.data(), P.order.data(), P.off.data(), &tb.wt, &c, &emu_ctx), ML_OK);
}

/* got against want, every output, within tol */
static void compare(const std::string &nm, const problem &P, const outs &got, const outs &want, double tol)
{
    ml_dtype dt = P.dt;
    int64_t T = P.c.T, D = P.c.D, F = P.c.F, E = P.c.E, n = T * P.c.k, S = P.c.nsaved;
    check(nm + " y", to_d(dt, got.y.data(), T * D), to_d(dt, want.y.data(), T * D), tol);
    check(nm + " h_saved", to_d(dt, got.h.data(), S * 2 * F), to_d(dt, want.h.data(), S * 2 * F), tol);
    check(nm + " dx (+=)", to_d(dt, got.dx.data(), T * D), to_d(dt, want.dx.data(), T * D), tol);
    check(nm + " dgate_up (+=)", to_d(dt, got.dgu.data(), E * 2 * F * D), to_d(dt, want.dgu.data(), E * 2 * F * D),
          tol);
    check(nm + " ddown (+=)", to_d(dt, got.ddn.data(), E * D * F), to_d(dt, want.ddn.data(), E * D * F), tol);
    check(nm + " dw", to_d(dt, got.dw.data(), n), to_d(dt, want.dw.data(), n), tol);
    check(nm + " touched", std::vector<double>(got.touched.begin(), got.touched.end()),
          std::vector<double>(want.touched.begin(), want.touched.end()), 0);
}

/* 1 where dispatch position p lies in a tile that forward saves */
static std::vector<bool> saved_rows(const problem &P)
{
    std::vector<bool> m(P.c.nsaved, false);
    for (int64_t e = 0; e < P.c.E; e++)
        for (int64_t p0 = P.off[e]; p0 < P.off[e + 1]; p0 += P.c.tile) {
            int64_t r = std::min(P.c.tile, P.off[e + 1] - p0);
            for (int64_t p = p0; p0 + r <= P.c.nsaved && p < p0 + r; p++)
                m[p] = true;
        }
    return m;
}

/* rows of h outside saved tiles (or of skipped experts) still hold the
 * 0xff sentinel (NaN) on the given side */
static void check_h_untouched(const std::string &nm, const problem &P, const outs &o, const std::vector<bool> &keep)
{
    int64_t F = P.c.F, bad = 0;
    for (int64_t p = 0; p < P.c.nsaved; p++)
        for (int64_t j = 0; keep[p] && j < 2 * F; j++)
            bad += !std::isnan(ml_load(P.dt, o.h.data(), p * 2 * F + j));
    check(nm + " h rows not saved untouched", {(double)bad}, {0}, 0);
}

static void run(ml_dtype dt, int64_t T, int64_t k, int64_t D, int64_t F, int64_t E, int64_t tile, int64_t cap,
                int save, std::vector<int64_t> caps = {})
{
    double tol = 16 * (D + 2 * F) * (dt == ML_F32 ? EPS32 : EPS64);
    int64_t n = T * k;
    problem P;
    P.dt = dt;
    P.es = ml_dtype_size(dt);
    P.off.resize(E + 1);
    P.order.resize(n);
    std::vector<int64_t> idx(n), counts(E);
    std::vector<uint8_t> dropped(n);
    std::uniform_int_distribution<int64_t> u(0, E - 1);
    for (auto &i : idx)
        i = u(emu_rng);
    int64_t nd = 0;
    ml_dispatch_cpu(P.off.data(), P.order.data(), counts.data(), dropped.data(), &nd, idx.data(), n, E, cap,
                    caps.empty() ? nullptr : caps.data(), nullptr, &emu_ctx);
    int64_t S = save == 0 ? 0 : save == 1 ? P.off[E] : P.off[E] / 2;
    P.c = {T, k, D, F, E, tile, S, 0};
    P.x = as_dt(dt, randn(T * D)), P.w = as_dt(dt, randn(n)), P.gu = as_dt(dt, randn(E * 2 * F * D, 0.2));
    P.dn = as_dt(dt, randn(E * D * F, 0.2)), P.dy = as_dt(dt, randn(T * D));
    size_t es = P.es;
    std::string nm = std::string(dtn(dt)) + " T=" + std::to_string(T) + " E=" + std::to_string(E) + " tile=" +
                     std::to_string(tile) + " cap=" + std::to_string(cap) + (caps.empty() ? "" : " caps") +
                     " S=" + std::to_string(S);
    int64_t tiles = 0;
    for (int64_t e = 0; e < E; e++)
        tiles += (P.off[e + 1] - P.off[e] + tile - 1) / tile;

    /* starting values: the accumulators random, the (=) outputs garbage
     * that differs between the sides (all of it must be overwritten) */
    outs init;
    init.h = buf(S * 2 * F * es, 0xff);
    init.dx = as_dt(dt, randn(T * D)), init.dgu = as_dt(dt, randn(E * 2 * F * D)), init.ddn = as_dt(dt, randn(E * D * F));
    outs c1 = init, c2 = init;
    c1.y = buf(T * D * es, 0), c2.y = buf(T * D * es, 0xff);
    c1.dw = buf(n * es, 0), c2.dw = buf(n * es, 0xff);
    c1.touched.assign(E, 9), c2.touched.assign(E, 7);
    std::vector<bool> all(E, true);

    /* one call over every expert */
    long k0 = emu_launches, g0 = gemms;
    pass(false, P, c1, all, 0, c1.h, nm);   /* forward writes c1.h before backward reads it */
    pass(true, P, c2, all, 0, c1.h, nm);
    per_tile(nm + " fwd+bwd", k0, g0, tiles);
    eat(c2.y, T * D * es), eat(c2.h, c2.h.size()), eat(c2.dx, T * D * es), eat(c2.dgu, c2.dgu.size()),
        eat(c2.ddn, c2.ddn.size()), eat(c2.dw, n * es);
    if (getenv("EMU_DIGEST"))
        printf("     digest %016llx %s\n", (unsigned long long)digest, nm.c_str());
    compare(nm, P, c2, c1, tol);
    std::vector<bool> unsaved = saved_rows(P);
    unsaved.flip();
    check_h_untouched(nm + " cuda", P, c2, unsaved);
    check_h_untouched(nm + " cpu", P, c1, unsaved);

    /* expert s (the one with most rows) skipped, accumulating into the
     * same prefilled outputs on both sides: none of its entries change */
    int64_t s = 0;
    for (int64_t e = 1; e < E; e++)
        if (P.off[e + 1] - P.off[e] > P.off[s + 1] - P.off[s])
            s = e;
    std::vector<bool> sel(E, true);
    sel[s] = false;
    outs s1 = init;
    s1.y = as_dt(dt, randn(T * D)), s1.dw = buf(n * es, 0xff), s1.touched.assign(E, 5);
    outs s2 = s1;
    std::string sn = nm + " skip " + std::to_string(s);
    pass(false, P, s1, sel, 1, c1.h, sn);
    pass(true, P, s2, sel, 1, c1.h, sn);
    compare(sn, P, s2, s1, tol);
    std::vector<bool> mine(S, false);
    for (int64_t p = P.off[s]; p < P.off[s + 1] && p < S; p++)
        mine[p] = true;
    for (auto *o : {&s1, &s2}) {
        std::string side = sn + (o == &s1 ? " cpu" : " cuda");
        check_h_untouched(side, P, *o, mine);
        int64_t bad = o->touched[s] != 5;
        for (int64_t p = P.off[s]; p < P.off[s + 1]; p++)
            bad += !std::isnan(ml_load(dt, o->dw.data(), P.order[p]));
        size_t gs = 2 * F * D * es, ds = D * F * es;
        bad += memcmp(o->dgu.data() + s * gs, init.dgu.data() + s * gs, gs) != 0;
        bad += memcmp(o->ddn.data() + s * ds, init.ddn.data() + s * ds, ds) != 0;
        check(side + " dw, touched, grads untouched", {(double)bad}, {0}, 0);
    }

    /* experts [0, E/2) with accumulate 0, then the rest with 1 */
    std::vector<bool> lo(E), hi(E);
    for (int64_t e = 0; e < E; e++)
        lo[e] = e < E / 2, hi[e] = !lo[e];
    outs h1 = init, h2 = init;
    h1.y = buf(T * D * es, 0x77), h2.y = buf(T * D * es, 0xff);
    h1.dw = buf(n * es, 0x77), h2.dw = buf(n * es, 0xff);
    h1.touched.assign(E, 3), h2.touched.assign(E, 4);
    std::string hn = nm + " halves";
    for (int acc : {0, 1}) {
        pass(false, P, h1, acc ? hi : lo, acc, c1.h, hn);
        pass(true, P, h2, acc ? hi : lo, acc, c1.h, hn);
    }
    compare(hn + " cuda vs cpu one call", P, h2, c1, tol);
    compare(hn + " cpu vs cpu one call", P, h1, c1, 0);
    compare(hn + " cuda vs cuda one call", P, h2, c2, 0);
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
        run(dt, 100, 2, 24, 20, 6, 8, -1, 2, {30, 0, 7, 200, 12, 1});   /* per-expert capacities */
    }
    return emu_finish();
}
