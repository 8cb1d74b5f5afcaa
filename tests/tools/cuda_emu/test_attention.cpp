/* kernels/attention.cu under the emulator against kernels/attention.c
 * (tests/spec/gpu_attention_spec.lua's tolerances: f64 1e-12, f32 1e-5,
 * normwise). The CUDA tiles are 16 x 16 (AT_B): the shapes put S at 1,
 * below, on and past a tile edge (19 = 16 + 3) and past the CPU f32 path's
 * 128-row tile; GQA groups of 1, 2, 3 with KV = 1 and 2; hd from 5 to
 * ML_ATT_HD_MAX (256: the largest dynamic shared memory). The CUDA side
 * gets no scratch (NULL, as the op layer passes it); the CPU gets
 * ml_attention_scratch_bytes(hd, S, nthreads). Each side runs forward then backward
 * on its own out and lse, as the spec does.
 *
 * bf16: q, k, v, dout rounded to bf16; the reference is the CPU's f32
 * kernel on the widened values, its backward fed the GPU's own out (bf16,
 * widened exactly) and lse, so both sides compute in f32 on identical
 * inputs and differ by f32 reordering (~1e-6, the f32 tolerance) plus the
 * final rounding of out, dq, dk, dv to bf16: at most 2^-8 relative per
 * element (bf16's unit roundoff, 8 significant bits), so at most 2^-8
 * normwise, about 0.4 * 2^-8 seen (the RMS of a uniform rounding error).
 * Those four are held to 2 * 2^-8, the factor 2 for the f32 differences
 * that dS = P (dP - drow) amplifies by cancellation (the spec's 1e-2 is
 * looser); lse (f64, computed in f32 from the same values) to f32's 1e-5;
 * drow (f64, dout . out in f64 over d ascending on both sides, from the
 * same values) must be bitwise equal.
 *
 * Decoding against a KV cache (Sq < Sk, forward only): each side's out and
 * lse must be bitwise the last Sq rows of its own square call (attention.h:
 * a query row walks the same tiles in the same order; on the CPU only f64,
 * whose tiles are not sgemm calls), and the two sides agree as above. */
#include "cuda_util.cu.cpp"
#include "attention.cu.cpp"
#include "emu.h"

static const double BF16_OUT = 2.0 / 256;

static void run(ml_dtype dt, int64_t S, int64_t H, int64_t KV, int64_t hd)
{
    ml_dtype rt = ml_grad_dtype(dt);   /* the CPU has no bf16: f32 on the rounded inputs */
    double tol = dt == ML_F64 ? 1e-12 : 1e-5, tol_o = dt == ML_BF16 ? BF16_OUT : tol;
    int64_t nq = S * H * hd, nk = S * KV * hd;
    auto q = rounded(dt, randn(nq)), k = rounded(dt, randn(nk)), v = rounded(dt, randn(nk));
    auto dout = rounded(dt, randn(nq));
    char nm[96];
    snprintf(nm, sizeof nm, "%s S=%ld H=%ld KV=%ld hd=%ld", dtn(dt), (long)S, (long)H, (long)KV, (long)hd);
    std::string s = nm;

    /* emulated device, outputs poisoned, no scratch */
    auto gq = as_dt(dt, q), gk = as_dt(dt, k), gv = as_dt(dt, v), gdout = as_dt(dt, dout);
    size_t bq = nq * ml_dtype_size(dt) + 1, bk = nk * ml_dtype_size(dt) + 1;
    std::vector<unsigned char> gout(bq, 0xff), gdq(bq, 0xff), gdk(bk, 0xff), gdv(bk, 0xff);
    std::vector<double> glse(H * S + 1, NAN), gdrow(H * S + 1, NAN);
    check_status(s + " fwd", ml_attention_forward_cuda(dt, gout.data(), glse.data(), gq.data(), gk.data(),
                                                       gv.data(), S, S, H, KV, hd, nullptr, &emu_ctx), ML_OK);
    check_status(s + " bwd", ml_attention_backward_cuda(dt, gdq.data(), gdk.data(), gdv.data(), gdrow.data(),
                                                        gdout.data(), gq.data(), gk.data(), gv.data(),
                                                        gout.data(), glse.data(), S, H, KV, hd, nullptr,
                                                        &emu_ctx), ML_OK);
    /* CPU; bf16's backward on the GPU's out and lse */
    auto cq = as_dt(rt, q), ck = as_dt(rt, k), cv = as_dt(rt, v), cdout = as_dt(rt, dout);
    std::vector<unsigned char> cout(nq * ml_dtype_size(rt) + 1), cdq(cout.size());
    std::vector<unsigned char> cdk(nk * ml_dtype_size(rt) + 1), cdv(cdk.size());
    std::vector<unsigned char> scratch(ml_attention_scratch_bytes(hd, S, emu_ctx.nthreads));
    std::vector<double> clse(H * S + 1), cdrow(H * S + 1);
    check_status(s + " cpu fwd", ml_attention_forward_cpu(rt, cout.data(), clse.data(), cq.data(), ck.data(),
                                                          cv.data(), S, S, H, KV, hd, scratch.data(), &emu_ctx),
                 ML_OK);
    check(s + " out", to_d(dt, gout.data(), nq), to_d(rt, cout.data(), nq), tol_o);
    check(s + " lse", std::vector<double>(glse.begin(), glse.end() - 1),
          std::vector<double>(clse.begin(), clse.end() - 1), tol);
    if (dt == ML_BF16) {
        cout = as_dt(rt, to_d(dt, gout.data(), nq));
        clse = glse;
    }
    check_status(s + " cpu bwd", ml_attention_backward_cpu(rt, cdq.data(), cdk.data(), cdv.data(), cdrow.data(),
                                                           cdout.data(), cq.data(), ck.data(), cv.data(),
                                                           cout.data(), clse.data(), S, H, KV, hd,
                                                           scratch.data(), &emu_ctx), ML_OK);
    check(s + " drow", std::vector<double>(gdrow.begin(), gdrow.end() - 1),
          std::vector<double>(cdrow.begin(), cdrow.end() - 1), dt == ML_BF16 ? 0 : tol);
    if (S == 1) {   /* one key: P = 1, out = v, dS = dout.v - drow = 0: both sides leave rounding noise */
        check(s + " dq = 0 (absolute)", to_d(dt, gdq.data(), nq), std::vector<double>(nq), tol);
        check(s + " dk = 0 (absolute)", to_d(dt, gdk.data(), nk), std::vector<double>(nk), tol);
    } else {
        check(s + " dq", to_d(dt, gdq.data(), nq), to_d(rt, cdq.data(), nq), tol_o);
        check(s + " dk", to_d(dt, gdk.data(), nk), to_d(rt, cdk.data(), nk), tol_o);
    }
    check(s + " dv", to_d(dt, gdv.data(), nk), to_d(rt, cdv.data(), nk), tol_o);
}

/* One forward of the last Sq of Sk queries on each side (the CPU in the
 * reference dtype), against that side's square forward and the other side. */
static void run_cached(ml_dtype dt, int64_t Sq, int64_t Sk, int64_t H, int64_t KV, int64_t hd)
{
    ml_dtype rt = ml_grad_dtype(dt);
    double tol = dt == ML_F64 ? 1e-12 : 1e-5, tol_o = dt == ML_BF16 ? BF16_OUT : tol;
    int64_t P = Sk - Sq, nq = Sq * H * hd, nk = Sk * KV * hd, row = H * hd;
    auto q = rounded(dt, randn(Sk * row)), k = rounded(dt, randn(nk)), v = rounded(dt, randn(nk));
    std::vector<double> qlast(q.begin() + P * row, q.end());
    char nm[96];
    snprintf(nm, sizeof nm, "%s cached Sq=%ld Sk=%ld H=%ld KV=%ld hd=%ld", dtn(dt), (long)Sq, (long)Sk, (long)H,
             (long)KV, (long)hd);
    std::string s = nm;
    struct side { ml_dtype dt; bool cuda; std::vector<double> out, lse, sq_out, sq_lse; };
    side sides[2] = {{dt, true, {}, {}, {}, {}}, {rt, false, {}, {}, {}, {}}};
    std::vector<unsigned char> scratch(ml_attention_scratch_bytes(hd, Sk, emu_ctx.nthreads));   /* the square call's */
    for (auto &sd : sides) {
        auto fwd = sd.cuda ? ml_attention_forward_cuda : ml_attention_forward_cpu;
        void *scr = sd.cuda ? nullptr : scratch.data();
        auto bk = as_dt(sd.dt, k), bv = as_dt(sd.dt, v), bq = as_dt(sd.dt, q), bl = as_dt(sd.dt, qlast);
        std::vector<unsigned char> o((Sk * row) * ml_dtype_size(sd.dt)), oc(nq * ml_dtype_size(sd.dt));
        std::vector<double> l(H * Sk), lc(H * Sq);
        check_status(s + (sd.cuda ? " cuda" : " cpu") + " square",
                     fwd(sd.dt, o.data(), l.data(), bq.data(), bk.data(), bv.data(), Sk, Sk, H, KV, hd, scr,
                         &emu_ctx), ML_OK);
        check_status(s + (sd.cuda ? " cuda" : " cpu") + " cached",
                     fwd(sd.dt, oc.data(), lc.data(), bl.data(), bk.data(), bv.data(), Sq, Sk, H, KV, hd, scr,
                         &emu_ctx), ML_OK);
        auto full = to_d(sd.dt, o.data(), Sk * row);
        sd.out = to_d(sd.dt, oc.data(), nq);
        sd.lse = lc;
        sd.sq_out.assign(full.begin() + P * row, full.end());
        for (int64_t h = 0; h < H; h++)
            sd.sq_lse.insert(sd.sq_lse.end(), l.begin() + h * Sk + P, l.begin() + (h + 1) * Sk);
        bool bitwise = sd.cuda || sd.dt == ML_F64;
        double t = bitwise ? 0 : tol;
        check(s + (sd.cuda ? " cuda" : " cpu") + " out = square's last rows", sd.out, sd.sq_out, t);
        check(s + (sd.cuda ? " cuda" : " cpu") + " lse = square's last rows", sd.lse, sd.sq_lse, t);
    }
    check(s + " out", sides[0].out, sides[1].out, tol_o);
    check(s + " lse", sides[0].lse, sides[1].lse, tol);
}

/* argument checks: the CPU refuses bf16; CUDA refuses what the CPU does;
 * an empty sequence is a no-op */
static void refusals(void)
{
    std::vector<double> z(64);
    void *p = z.data();
    check_status("bf16 forward cpu", ml_attention_forward_cpu(ML_BF16, p, z.data(), p, p, p, 1, 1, 1, 1, 8, p,
                                                              &emu_ctx), ML_EUNSUPPORTED);
    check_status("Sq > Sk cpu", ml_attention_forward_cpu(ML_F32, p, z.data(), p, p, p, 2, 1, 1, 1, 8, p,
                                                         &emu_ctx), ML_EUNSUPPORTED);
    check_status("Sq > Sk cuda", ml_attention_forward_cuda(ML_F32, p, z.data(), p, p, p, 2, 1, 1, 1, 8, nullptr,
                                                           &emu_ctx), ML_EUNSUPPORTED);
    check_status("bf16 backward cpu", ml_attention_backward_cpu(ML_BF16, p, p, p, z.data(), p, p, p, p, p,
                                                                z.data(), 1, 1, 1, 8, p, &emu_ctx),
                 ML_EUNSUPPORTED);
    int64_t bad[][3] = {{1, 1, 0}, {1, 1, ML_ATT_HD_MAX + 1}, {3, 2, 8}, {2, 0, 8}};   /* H, KV, hd */
    for (auto &b : bad) {
        std::string nm = "cuda refuses H=" + std::to_string(b[0]) + " KV=" + std::to_string(b[1]) +
                         " hd=" + std::to_string(b[2]);
        check_status(nm + " fwd", ml_attention_forward_cuda(ML_F32, p, z.data(), p, p, p, 1, 1, b[0], b[1], b[2],
                                                            nullptr, &emu_ctx), ML_EUNSUPPORTED);
        check_status(nm + " bwd", ml_attention_backward_cuda(ML_F32, p, p, p, z.data(), p, p, p, p, p, z.data(),
                                                             1, b[0], b[1], b[2], nullptr, &emu_ctx),
                     ML_EUNSUPPORTED);
    }
    long before = emu_launches;
    check_status("S=0 fwd", ml_attention_forward_cuda(ML_BF16, p, z.data(), p, p, p, 0, 0, 2, 1, 8, nullptr,
                                                      &emu_ctx), ML_OK);
    check_status("S=0 bwd", ml_attention_backward_cuda(ML_BF16, p, p, p, z.data(), p, p, p, p, p, z.data(), 0, 2,
                                                       1, 8, nullptr, &emu_ctx), ML_OK);
    check_status("S=0 launches nothing", emu_launches == before ? ML_OK : ML_EINVAL, ML_OK);
}

int main()
{
    /* {S, H, KV, hd} */
    int64_t shapes[][4] = {{1, 1, 1, 8},  {19, 4, 2, 8}, {19, 3, 1, 16}, {16, 2, 2, 5},
                           {35, 2, 1, 20}, {3, 2, 1, 256}, {130, 1, 1, 4}};
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16})
        for (auto &sh : shapes)
            run(dt, sh[0], sh[1], sh[2], sh[3]);
    /* {Sq, Sk, H, KV, hd}: one query, several within and across tiles, past
     * the CPU's 128-row f32 tile */
    int64_t cached[][5] = {{1, 1, 2, 1, 8}, {1, 19, 4, 2, 8}, {3, 35, 3, 1, 16}, {5, 16, 2, 2, 5},
                           {1, 130, 1, 1, 4}, {20, 150, 2, 1, 8}};
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16})
        for (auto &c : cached)
            run_cached(dt, c[0], c[1], c[2], c[3], c[4]);
    refusals();
    return emu_finish();
}
