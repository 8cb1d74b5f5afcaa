/* kernels/router.cu under the emulator against kernels/router.c (the
 * cases and tolerances of tests/spec/gpu_spec.lua: idx and counts bitwise,
 * w, dx, dwg f32 4 eps / f64 1e-12, psum, z, entropy 1e-12).
 * bf16 (mixed precision, router.h): inputs rounded to bf16; the reference
 * is the CPU's f32 kernel on the widened values, whose logits the device
 * reproduces bitwise, so idx and counts are exact (no top-k margin needed
 * here; the GPU spec allows one where CUDA's libm moves a near tie); w and
 * dx (bf16) within 2^-8 normwise of the f32 reference and, as the
 * emulator's libm is glibc's, bitwise its bf16 rounding; dwg (f32) and the
 * f64 sums as for f32. */
#include "cuda_util.cu.cpp"
#include "router.cu.cpp"
#include "emu.h"

static std::vector<double> dv(const std::vector<int64_t> &v) { return std::vector<double>(v.begin(), v.end()); }

static std::vector<ml_router_cfg> cases()
{
    ml_router_cfg b = {2, 64, ML_ROUTER_SOFTMAX_TOPK, 1, 1.0, 0, 0, 0, 0, 0, 0, 0};
    std::vector<ml_router_cfg> c(5, b);
    c[1].k = 3, c[1].chunk = 1000, c[1].mode = ML_ROUTER_TOPK_SOFTMAX, c[1].temperature = 0.7;
    c[2].chunk = 33, c[2].renorm = 0, c[2].eps = 0.1, c[2].noise = 0.8, c[2].seed = 11, c[2].step = 5, c[2].layer = 2;
    c[3].k = 1, c[3].chunk = 50, c[3].gumbel = 1, c[3].seed = 4, c[3].step = 9, c[3].temperature = 1.5;
    c[4].k = 3, c[4].chunk = 7, c[4].noise = 0.5, c[4].seed = 8, c[4].step = 1, c[4].token_offset = 1000;
    return c;
}

/* Tolerance of a dt output against the reference (bf16: its rounding). */
static double out_tol(ml_dtype dt) { return dt == ML_F32 ? 4 * EPS32 : dt == ML_F64 ? 1e-12 : 1.0 / 256; }

/* A bf16 output is bitwise the bf16 rounding of the f32 reference (glibc's
 * libm on both sides here). */
static void check_rounded(const std::string &nm, ml_dtype dt, const void *got, ml_dtype rt, const void *ref,
                          size_t n)
{
    if (dt == ML_BF16)
        check(nm + " = bf16(ref)", to_d(dt, got, n), rounded(dt, to_d(rt, ref, n)), 0);
}

static void forward(ml_dtype dt, int64_t T, int64_t D, int64_t E)
{
    ml_dtype rt = ml_grad_dtype(dt);
    double tol = out_tol(dt);
    auto xv = rounded(dt, randn(T * D)), wv = rounded(dt, randn(E * D));
    auto bias = as_dt(rt, randn(E, 0.01));   /* f32 / f64 for every dt */
    auto cx = as_dt(rt, xv), cwg = as_dt(rt, wv), gx = as_dt(dt, xv), gwg = as_dt(dt, wv);
    int ci = 0;
    for (auto &c : cases()) {
        ci++;
        for (int wb = 0; wb < 2; wb++) {
            int64_t k = c.k;
            std::vector<unsigned char> s1(ml_router_scratch_bytes(T, D, E, c.chunk, 0) + 8),
                s2(ml_router_scratch_bytes_cuda(T, D, E, c.chunk, 0), 0xa5);
            std::vector<int64_t> i1(T * k, -1), i2(T * k, -1), n1(E, 3), n2(E, 3);
            std::vector<unsigned char> w1(T * k * 8), w2(T * k * 8, 0xff);
            std::vector<double> p1(E, 0.5), p2(E, 0.5);
            double z1 = 1, z2 = 1, h1 = 2, h2 = 2;
            ml_status a = ml_router_forward_cpu(rt, i1.data(), w1.data(), n1.data(), p1.data(), &z1, &h1,
                                                cx.data(), cwg.data(), rt, wb ? bias.data() : nullptr, T, D, E, &c,
                                                s1.data(), &emu_ctx);
            ml_status b = ml_router_forward_cuda(dt, i2.data(), w2.data(), n2.data(), p2.data(), &z2, &h2,
                                                 gx.data(), gwg.data(), rt, wb ? bias.data() : nullptr, T, D, E,
                                                 &c, s2.data(), &emu_ctx);
            std::string nm = std::string("fwd ") + dtn(dt) + " T=" + std::to_string(T) + " E=" + std::to_string(E) +
                             " case " + std::to_string(ci) + (wb ? " +bias" : "");
            check_status(nm, b, a);
            check(nm + " idx", dv(i2), dv(i1), 0);
            check(nm + " counts", dv(n2), dv(n1), 0);
            check(nm + " w", to_d(dt, w2.data(), T * k), to_d(rt, w1.data(), T * k), tol);
            check_rounded(nm + " w", dt, w2.data(), rt, w1.data(), T * k);
            check(nm + " psum", p2, p1, 1e-12);
            check(nm + " z, entropy", {z2, h2}, {z1, h1}, 1e-12);
        }
    }
}

static void backward(ml_dtype dt, int64_t T, int64_t D, int64_t E)
{
    ml_dtype gdt = ml_grad_dtype(dt), rt = gdt;   /* dwg's dtype; the CPU's reference in it */
    double tol = out_tol(dt), gtol = out_tol(gdt);
    auto xv = rounded(dt, randn(T * D)), wv = rounded(dt, randn(E * D));
    auto cx = as_dt(rt, xv), cwg = as_dt(rt, wv), gx = as_dt(dt, xv), gwg = as_dt(dt, wv);
    int ci = 0;
    for (auto &c : cases()) {
        ci++;
        int64_t k = c.k;
        std::vector<unsigned char> s1(ml_router_scratch_bytes(T, D, E, c.chunk, 1) + 8),
            s2(ml_router_scratch_bytes_cuda(T, D, E, c.chunk, 1), 0xa5);
        std::vector<int64_t> idx(T * k), n(E);
        std::vector<unsigned char> w(T * k * 8);
        std::vector<double> p(E);
        double z = 0, h = 0;
        ml_router_forward_cpu(rt, idx.data(), w.data(), n.data(), p.data(), &z, &h, cx.data(), cwg.data(), rt,
                              nullptr, T, D, E, &c, s1.data(), &emu_ctx);
        auto dwv = rounded(dt, randn(T * k)), dxv = rounded(dt, randn(T * D)), dwgv = rounded(gdt, randn(E * D));
        auto dw1 = as_dt(rt, dwv), dx1 = as_dt(rt, dxv), dwg1 = as_dt(rt, dwgv);
        auto dw2 = as_dt(dt, dwv), dx2 = as_dt(dt, dxv), dwg2 = as_dt(gdt, dwgv);
        auto aux = randn(E);
        ml_status a = ml_router_backward_cpu(rt, dx1.data(), dwg1.data(), idx.data(), dw1.data(), aux.data(), 0.3,
                                             cx.data(), cwg.data(), T, D, E, &c, s1.data(), &emu_ctx);
        ml_status b = ml_router_backward_cuda(dt, dx2.data(), dwg2.data(), idx.data(), dw2.data(), aux.data(), 0.3,
                                              gx.data(), gwg.data(), T, D, E, &c, s2.data(), &emu_ctx);
        std::string nm = std::string("bwd ") + dtn(dt) + " T=" + std::to_string(T) + " E=" + std::to_string(E) +
                         " case " + std::to_string(ci);
        check_status(nm, b, a);
        check(nm + " dx (+=)", to_d(dt, dx2.data(), T * D), to_d(rt, dx1.data(), T * D), tol);
        check_rounded(nm + " dx (+=)", dt, dx2.data(), rt, dx1.data(), T * D);
        check(nm + " dwg (+=, " + dtn(gdt) + ")", to_d(gdt, dwg2.data(), E * D), to_d(rt, dwg1.data(), E * D), gtol);
    }
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16}) {
        forward(dt, 301, 37, 8);
        forward(dt, 70, 9, 5);     /* E not a power of two */
        backward(dt, 203, 29, 8);
        backward(dt, 65, 10, 3);
        if (dt == ML_BF16) {       /* the CPU refuses bf16; the bias stays f32 / f64 */
            std::vector<unsigned char> z(64);
            check_status("bf16 on the CPU", ml_router_forward_cpu(dt, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                                  nullptr, nullptr, nullptr, ML_F32, nullptr, 1, 1,
                                                                  1, &cases()[0], z.data(), &emu_ctx),
                         ML_EUNSUPPORTED);
            check_status("bf16 bias", ml_router_update_bias_cuda(dt, z.data(), nullptr, 1, 0.1, &emu_ctx),
                         ML_EUNSUPPORTED);
            continue;
        }
        auto b1 = as_dt(dt, randn(6)), b2 = b1;
        std::vector<int64_t> cnt = {5, 0, 9, 3, 3, 1};
        ml_router_update_bias_cpu(dt, b1.data(), cnt.data(), 6, 0.01, &emu_ctx);
        check_status("update_bias", ml_router_update_bias_cuda(dt, b2.data(), cnt.data(), 6, 0.01, &emu_ctx), ML_OK);
        check(std::string("update_bias ") + dtn(dt), to_d(dt, b2.data(), 6), to_d(dt, b1.data(), 6), 0);
    }
    return emu_finish();
}
