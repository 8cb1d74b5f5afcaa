/* kernels/experts.cu under the emulator against kernels/experts.c
 * (tests/spec/gpu_spec.lua's tolerance 16 (D + 2F) eps); cuBLAS's grouped
 * GEMM is stubbed with ml_matmul_cpu per problem, so only the experts' own
 * kernels are emulated.
 * bf16 (mixed precision): inputs drawn and rounded to bf16, the CPU's f32
 * kernels on the widened values are the reference (tolerances at run()).
 * Per plan: one call over all experts; the same in waves of 1 tile (the
 * walk tile by tile) and of 3, bitwise the default width's (experts.cu:
 * waves change no result); one with an expert skipped (NULL table entry,
 * cfg.accumulate = 1 into prefilled outputs: nothing of it written on
 * either side); two calls over expert halves (accumulate 0 then 1),
 * against the CPU's one call and bitwise against each backend's own one
 * call (experts.h: "results are bitwise one call's").
 * Prints kernel launches and grouped GEMM calls per tile; EMU_DIGEST=1
 * prints a digest of each case's device outputs (to compare two versions
 * of experts.cu bitwise) */
#include "cuda_util.cu.cpp"
#include "experts.cu.cpp"
#include "emu.h"
extern "C" {
#include "dispatch.h"
}

static long gemms = 0;
extern "C" ml_status ml_matmul_grouped_cuda(ml_dtype dt, ml_dtype cdt, int64_t count, const ml_gemm_shape *s,
                                            const void *const *a, const void *const *b, void *const *c,
                                            const ml_kctx *ctx)
{
    gemms++;
    return emu_cublas_grouped(dt, cdt, count, s, a, b, c, ctx);
}

/* launches (kernels, grouped GEMMs) since the last call, per tile */
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
 * blocks the tables point into; dt and its size es, the weight
 * gradients' gdt (ml_grad_dtype) and its size ges. */
struct problem {
    ml_dtype dt, gdt;
    size_t es, ges;
    ml_experts_cfg c;
    std::vector<int64_t> off, order;
    bytes x, w, gu, dn, dy;
};

/* buffer b of P.dt [n] as dtype dt */
static bytes as(ml_dtype dt, const problem &P, const bytes &b, size_t n) { return as_dt(dt, to_d(P.dt, b.data(), n)); }

/* The same problem in dtype rd (the CPU's reference: bf16 widened to f32). */
static problem widened(const problem &G, ml_dtype rd)
{
    problem C = G;
    int64_t T = G.c.T, D = G.c.D, F = G.c.F, E = G.c.E;
    C.dt = rd, C.gdt = ml_grad_dtype(rd), C.es = ml_dtype_size(rd), C.ges = ml_dtype_size(C.gdt);
    C.x = as(rd, G, G.x, T * D), C.w = as(rd, G, G.w, T * G.c.k), C.gu = as(rd, G, G.gu, E * 2 * F * D);
    C.dn = as(rd, G, G.dn, E * D * F), C.dy = as(rd, G, G.dy, T * D);
    return C;
}

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
        int64_t E = P.c.E, gs = 2 * P.c.F * P.c.D, ds = P.c.D * P.c.F;
        for (int64_t e = 0; e < E; e++) {
            gu.push_back(sel[e] ? P.gu.data() + e * gs * P.es : nullptr);
            dn.push_back(sel[e] ? P.dn.data() + e * ds * P.es : nullptr);
            dgu.push_back(sel[e] ? o.dgu.data() + e * gs * P.ges : nullptr);
            ddn.push_back(sel[e] ? o.ddn.data() + e * ds * P.ges : nullptr);
        }
        wt = {gu.data(), dn.data()};
        dwt = {dgu.data(), ddn.data()};
    }
};

/* Forward then backward over the experts in sel, on the CPU (ctx
 * emu_ctx, nthreads lanes of scratch) or CUDA (waves of width tiles);
 * backward reads hb (the CPU's one-call h, so its comparisons do not
 * compound forward's). */
static void pass(bool cuda, const problem &P, outs &o, const std::vector<bool> &sel, int acc, const bytes &hb,
                 const std::string &nm, int width = WAVE)
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
    ml_status fs, bs;
    if (cuda) {
        fs = forward_at(P.dt, o.y.data(), h, sf.data(), P.x.data(), P.w.data(), P.order.data(), P.off.data(),
                        &tb.wt, &c, width, &emu_ctx);
        bs = backward_at(P.dt, o.dx.data(), &tb.dwt, o.dw.data(), o.touched.data(), sb.data(), hr, P.dy.data(),
                         P.x.data(), P.w.data(), P.order.data(), P.off.data(), &tb.wt, &c, width, &emu_ctx);
    } else {
        fs = ml_experts_forward_cpu(P.dt, o.y.data(), h, sf.data(), P.x.data(), P.w.data(), P.order.data(),
                                    P.off.data(), &tb.wt, &c, &emu_ctx);
        bs = ml_experts_backward_cpu(P.dt, o.dx.data(), &tb.dwt, o.dw.data(), o.touched.data(), sb.data(), hr,
                                     P.dy.data(), P.x.data(), P.w.data(), P.order.data(), P.off.data(), &tb.wt,
                                     &c, &emu_ctx);
    }
    check_status(nm + (cuda ? " fwd cuda" : " fwd cpu"), fs, ML_OK);
    check_status(nm + (cuda ? " bwd cuda" : " bwd cpu"), bs, ML_OK);
}

/* got (of problem G) against want (of W), every output, within tol (the
 * activations: y, h, dx, dw) and gtol (the weight gradients) */
static void compare(const std::string &nm, const problem &G, const outs &got, const problem &W, const outs &want,
                    double tol, double gtol)
{
    int64_t T = G.c.T, D = G.c.D, F = G.c.F, E = G.c.E, n = T * G.c.k, S = G.c.nsaved;
    auto cmp = [&](const std::string &what, bool grad, const bytes &g, const bytes &w, int64_t m) {
        check(nm + what, to_d(grad ? G.gdt : G.dt, g.data(), m), to_d(grad ? W.gdt : W.dt, w.data(), m),
              grad ? gtol : tol);
    };
    cmp(" y", false, got.y, want.y, T * D);
    cmp(" h_saved", false, got.h, want.h, S * 2 * F);
    cmp(" dx (+=)", false, got.dx, want.dx, T * D);
    cmp(" dgate_up (+=)", true, got.dgu, want.dgu, E * 2 * F * D);
    cmp(" ddown (+=)", true, got.ddn, want.ddn, E * D * F);
    cmp(" dw", false, got.dw, want.dw, n);
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

/* f32, f64: the CUDA kernels against the CPU's in dt, at one tolerance.
 * bf16: inputs drawn in bf16, the CPU's f32 kernels on the widened values
 * as the reference; normwise tolerances in units of 2^-8 (bf16's unit
 * roundoff is 2^-9):
 *   h, y, dx, dw: 4. h is one rounding (<= 2^-9); y, dx and dw are rounded
 *     once (per expert for y, dx) after two or three bf16-rounded
 *     intermediates entered their f32 GEMMs and sums (h, act; h, dh, w·dy),
 *     each carrying about 2^-9 relative, amplified where silu' or a sum
 *     cancels: about 2^-8 in all, seen up to 1.1·2^-8.
 *   dgate_up, ddown (f32): 2. Each sums products of two factors the kernel
 *     rounded to bf16 (w·dy by act; dh, itself from the bf16 h, by the
 *     exact x), at most about 1.5·2^-8 per product, seen up to 0.95·2^-8;
 *     their f32 sums differ from the CPU's only by order (~1e-7). */
static void run(ml_dtype dt, int64_t T, int64_t k, int64_t D, int64_t F, int64_t E, int64_t tile, int64_t cap,
                int save, std::vector<int64_t> caps = {})
{
    double tol = dt == ML_BF16 ? 4.0 / 256 : 16 * (D + 2 * F) * (dt == ML_F32 ? EPS32 : EPS64);
    double gtol = dt == ML_BF16 ? 2.0 / 256 : tol;
    int64_t n = T * k;
    problem G;   /* the CUDA side; C, the CPU's, is G widened */
    G.dt = dt, G.gdt = ml_grad_dtype(dt), G.es = ml_dtype_size(dt), G.ges = ml_dtype_size(G.gdt);
    G.off.resize(E + 1);
    G.order.resize(n);
    std::vector<int64_t> idx(n), counts(E);
    std::vector<uint8_t> dropped(n);
    std::uniform_int_distribution<int64_t> u(0, E - 1);
    for (auto &i : idx)
        i = u(emu_rng);
    int64_t nd = 0;
    ml_dispatch_cpu(G.off.data(), G.order.data(), counts.data(), dropped.data(), &nd, idx.data(), n, E, cap,
                    caps.empty() ? nullptr : caps.data(), nullptr, &emu_ctx);
    int64_t S = save == 0 ? 0 : save == 1 ? G.off[E] : G.off[E] / 2;
    G.c = {T, k, D, F, E, tile, S, 0};
    G.x = as_dt(dt, randn(T * D)), G.w = as_dt(dt, randn(n)), G.gu = as_dt(dt, randn(E * 2 * F * D, 0.2));
    G.dn = as_dt(dt, randn(E * D * F, 0.2)), G.dy = as_dt(dt, randn(T * D));
    problem C = widened(G, ml_grad_dtype(dt));
    std::string nm = std::string(dtn(dt)) + " T=" + std::to_string(T) + " E=" + std::to_string(E) + " tile=" +
                     std::to_string(tile) + " cap=" + std::to_string(cap) + (caps.empty() ? "" : " caps") +
                     " S=" + std::to_string(S);
    int64_t tiles = 0;
    for (int64_t e = 0; e < E; e++)
        tiles += (G.off[e + 1] - G.off[e] + tile - 1) / tile;

    /* starting values: the accumulators random (the same values on both
     * sides), the (=) outputs garbage that differs between the sides (all
     * of it must be overwritten) */
    std::vector<double> dx0 = rounded(dt, randn(T * D)), dgu0 = randn(E * 2 * F * D), ddn0 = randn(E * D * F);
    auto init = [&](const problem &P) {
        outs o;
        o.h = buf(S * 2 * F * P.es, 0xff);
        o.dx = as_dt(P.dt, dx0), o.dgu = as_dt(P.gdt, dgu0), o.ddn = as_dt(P.gdt, ddn0);
        return o;
    };
    outs c1 = init(C), c2 = init(G);
    c1.y = buf(T * D * C.es, 0), c2.y = buf(T * D * G.es, 0xff);
    c1.dw = buf(n * C.es, 0), c2.dw = buf(n * G.es, 0xff);
    c1.touched.assign(E, 9), c2.touched.assign(E, 7);
    std::vector<bool> all(E, true);

    /* one call over every expert; CUDA's backward reads the CPU's h (in dt) */
    long k0 = emu_launches, g0 = gemms;
    pass(false, C, c1, all, 0, c1.h, nm);   /* forward writes c1.h before backward reads it */
    bytes hb = as(dt, C, c1.h, S * 2 * F);
    pass(true, G, c2, all, 0, hb, nm);
    per_tile(nm + " fwd+bwd", k0, g0, tiles);
    eat(c2.y, T * D * G.es), eat(c2.h, c2.h.size()), eat(c2.dx, T * D * G.es), eat(c2.dgu, c2.dgu.size()),
        eat(c2.ddn, c2.ddn.size()), eat(c2.dw, n * G.es);
    if (getenv("EMU_DIGEST"))
        printf("     digest %016llx %s\n", (unsigned long long)digest, nm.c_str());
    compare(nm, G, c2, C, c1, tol, gtol);
    std::vector<bool> unsaved = saved_rows(G);
    unsaved.flip();
    check_h_untouched(nm + " cuda", G, c2, unsaved);
    check_h_untouched(nm + " cpu", C, c1, unsaved);

    /* waves of 1 tile (the walk tile by tile) and of 3: bitwise the
     * default width's, from the same starting values */
    for (int width : {1, 3}) {
        outs cw = init(G);
        cw.y = buf(T * D * G.es, 0xff), cw.dw = buf(n * G.es, 0xff), cw.touched.assign(E, 7);
        pass(true, G, cw, all, 0, hb, nm, width);
        compare(nm + " waves of " + std::to_string(width) + " vs " + std::to_string(WAVE), G, cw, G, c2, 0, 0);
    }

    /* expert s (the one with most rows) skipped, accumulating into the
     * same prefilled outputs on both sides: none of its entries change */
    int64_t s = 0;
    for (int64_t e = 1; e < E; e++)
        if (G.off[e + 1] - G.off[e] > G.off[s + 1] - G.off[s])
            s = e;
    std::vector<bool> sel(E, true);
    sel[s] = false;
    std::vector<double> y0 = rounded(dt, randn(T * D));
    outs s1 = init(C), s2 = init(G);
    s1.y = as_dt(C.dt, y0), s1.dw = buf(n * C.es, 0xff), s1.touched.assign(E, 5);
    s2.y = as_dt(G.dt, y0), s2.dw = buf(n * G.es, 0xff), s2.touched.assign(E, 5);
    std::string sn = nm + " skip " + std::to_string(s);
    pass(false, C, s1, sel, 1, c1.h, sn);
    pass(true, G, s2, sel, 1, hb, sn);
    compare(sn, G, s2, C, s1, tol, gtol);
    std::vector<bool> mine(S, false);
    for (int64_t p = G.off[s]; p < G.off[s + 1] && p < S; p++)
        mine[p] = true;
    for (auto *o : {&s1, &s2}) {
        const problem &P = o == &s1 ? C : G;
        outs z = init(P);   /* the starting gradients */
        std::string side = sn + (o == &s1 ? " cpu" : " cuda");
        check_h_untouched(side, P, *o, mine);
        int64_t bad = o->touched[s] != 5;
        for (int64_t p = P.off[s]; p < P.off[s + 1]; p++)
            bad += !std::isnan(ml_load(P.dt, o->dw.data(), P.order[p]));
        size_t gs = 2 * F * D * P.ges, ds = D * F * P.ges;
        bad += memcmp(o->dgu.data() + s * gs, z.dgu.data() + s * gs, gs) != 0;
        bad += memcmp(o->ddn.data() + s * ds, z.ddn.data() + s * ds, ds) != 0;
        check(side + " dw, touched, grads untouched", {(double)bad}, {0}, 0);
    }

    /* experts [0, E/2) with accumulate 0, then the rest with 1 */
    std::vector<bool> lo(E), hi(E);
    for (int64_t e = 0; e < E; e++)
        lo[e] = e < E / 2, hi[e] = !lo[e];
    outs h1 = init(C), h2 = init(G);
    h1.y = buf(T * D * C.es, 0x77), h2.y = buf(T * D * G.es, 0xff);
    h1.dw = buf(n * C.es, 0x77), h2.dw = buf(n * G.es, 0xff);
    h1.touched.assign(E, 3), h2.touched.assign(E, 4);
    std::string hn = nm + " halves";
    for (int acc : {0, 1}) {
        pass(false, C, h1, acc ? hi : lo, acc, c1.h, hn);
        pass(true, G, h2, acc ? hi : lo, acc, hb, hn);
    }
    compare(hn + " cuda vs cpu one call", G, h2, C, c1, tol, gtol);
    compare(hn + " cpu vs cpu one call", C, h1, C, c1, 0, 0);
    compare(hn + " cuda vs cuda one call", G, h2, G, c2, 0, 0);
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
    /* bf16 on CUDA against the CPU's f32 */
    run(ML_BF16, 100, 2, 24, 20, 6, 32, -1, 1);
    run(ML_BF16, 100, 2, 24, 20, 6, 17, -1, 2);
    run(ML_BF16, 33, 3, 7, 5, 11, 5, 4, 0);
    run(ML_BF16, 40, 3, 300, 8, 2, 16, -1, 2);   /* a token twice in most tiles */
    /* after the cases above, which keep their draws (EMU_DIGEST) */
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16}) {
        run(dt, 100, 2, 6, 5, 6, 3, -1, 2);     /* experts of more tiles than a wave: rounds */
        run(dt, 60, 2, 4, 3, 300, 1, -1, 2);    /* waves end with each block of 256 experts */
    }
    return emu_finish();
}
