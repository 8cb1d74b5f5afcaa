/* kernels/elementwise.cu under the emulator against kernels/elementwise.c:
 * fill, arange, binary (broadcast over leading dims), binary_scalar and
 * unary bitwise; NaN wins max/min, integers saturate (tests/spec/gpu_spec.lua
 * allows 16 eps for exp/log/tanh on a GPU; here both sides use glibc). bf16
 * (CUDA only; the CPU refuses it) against the CPU's f32 op on the widened
 * inputs, rounded to bf16 once: bitwise, as the kernel computes in f32 */
#include "cuda_util.cu.cpp"
#include "elementwise.cu.cpp"
#include "emu.h"

static const ml_dtype ALL[] = {ML_F32, ML_F64, ML_BF16, ML_F16, ML_I32, ML_I64, ML_U8};
static const char *bop[] = {"add", "sub", "mul", "div", "max", "min"};
static const char *uop[] = {"exp", "log", "sqrt", "rsqrt", "silu", "sigmoid", "tanh", "neg", "abs"};

static bool is_int(ml_dtype dt) { return dt == ML_I32 || dt == ML_I64; }

/* the first n elements' bytes, so -0 and NaN payloads count */
static std::vector<double> bytes(ml_dtype dt, const std::vector<unsigned char> &b, int64_t n)
{
    return std::vector<double>(b.begin(), b.begin() + n * ml_dtype_size(dt));
}

/* normals with NaN, +-inf, +-0 and ties; integers large and of both signs */
static std::vector<double> input(ml_dtype dt, size_t n)
{
    auto v = randn(n, is_int(dt) ? 1e3 : 2.0);
    static const double sp[] = {NAN, INFINITY, -INFINITY, 0.0, -0.0, 1.5};
    for (size_t i = 0; i < n; i++) {
        if (is_int(dt))
            v[i] = i % 13 == 4 ? (dt == ML_I32 ? 2147483647.0 - i : 4e15 + i) : i % 13 == 6 ? -2147483648.0
                                                                                             : trunc(v[i]);
        else if (i % 9 == 2)
            v[i] = sp[(i / 9) % 6];
    }
    return v;
}

static void fill_arange(ml_dtype dt, int64_t n)
{
    for (double v : {3.7, -1e10, 1e10, -0.0, (double)NAN, 65520.0, 300.0}) {
        std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
        ml_fill_cpu(dt, a.data(), v, n, &emu_ctx);
        char nm[64];
        snprintf(nm, sizeof nm, "fill %s n=%ld v=%g", dtn(dt), (long)n, v);
        check_status(nm, ml_fill_cuda(dt, b.data(), v, n, &emu_ctx), ML_OK);
        check(nm, bytes(dt, b, n), bytes(dt, a, n), 0);
    }
    std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
    ml_arange_cpu(dt, a.data(), -3.1, 0.7, n, &emu_ctx);
    std::string nm = std::string("arange ") + dtn(dt) + " n=" + std::to_string(n);
    check_status(nm, ml_arange_cuda(dt, b.data(), -3.1, 0.7, n, &emu_ctx), ML_OK);
    check(nm, bytes(dt, b, n), bytes(dt, a, n), 0);
}

/* bf16, which the CPU refuses, is checked against the CPU's f32 op
 * (ml_grad_dtype) on the widened inputs: the reference's input bytes and
 * its first n outputs as dt's bytes (bf16: rounded once) */
static std::vector<unsigned char> ref_in(ml_dtype dt, const std::vector<unsigned char> &x, int64_t n)
{
    return dt == ML_BF16 ? as_dt(ML_F32, to_d(ML_BF16, x.data(), n)) : x;
}
static std::vector<double> ref_out(ml_dtype dt, const std::vector<unsigned char> &a, int64_t n)
{
    return dt == ML_BF16 ? bytes(dt, as_dt(dt, to_d(ML_F32, a.data(), n)), n) : bytes(dt, a, n);
}

static void binary(ml_dtype dt, int64_t n, int64_t na, int64_t nb)
{
    auto x = as_dt(dt, input(dt, na)), y = as_dt(dt, input(dt, nb));
    if (is_int(dt))   /* the binding refuses a zero integer divisor */
        for (int64_t i = 0; i < nb; i++)
            if (ml_load(dt, y.data(), i) == 0)
                ml_store(dt, y.data(), i, 3);
    auto rx = ref_in(dt, x, na), ry = ref_in(dt, y, nb);
    for (int op = 0; op < ML_NBINOPS; op++) {
        std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
        ml_binary_cpu((ml_binop)op, ml_grad_dtype(dt), a.data(), rx.data(), ry.data(), n, na, nb, &emu_ctx);
        char nm[96];
        snprintf(nm, sizeof nm, "binary %s %s n=%ld na=%ld nb=%ld", bop[op], dtn(dt), (long)n, (long)na, (long)nb);
        check_status(nm, ml_binary_cuda((ml_binop)op, dt, b.data(), x.data(), y.data(), n, na, nb, &emu_ctx),
                     ML_OK);
        check(nm, bytes(dt, b, n), ref_out(dt, a, n), 0);
        if (na == n) {   /* in place into a */
            auto c = x;
            check_status(std::string(nm) + " in place",
                         ml_binary_cuda((ml_binop)op, dt, c.data(), c.data(), y.data(), n, na, nb, &emu_ctx), ML_OK);
            check(std::string(nm) + " in place", bytes(dt, c, n), ref_out(dt, a, n), 0);
        }
    }
}

static void scalar(ml_dtype dt, int64_t n)
{
    auto x = as_dt(dt, input(dt, n)), rx = ref_in(dt, x, n);
    for (double s : {0.3, -2.5, 3.0, 1e300, (double)NAN})
        for (int rev = 0; rev < 2; rev++)
            for (int op = 0; op < ML_NBINOPS; op++) {
                if (is_int(dt) && rev && op == ML_DIV)   /* a zero element divisor: refused by the binding */
                    continue;
                std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
                ml_binary_scalar_cpu((ml_binop)op, ml_grad_dtype(dt), a.data(), rx.data(), s, rev, n, &emu_ctx);
                char nm[96];
                snprintf(nm, sizeof nm, "scalar %s %s n=%ld s=%g rev=%d", bop[op], dtn(dt), (long)n, s, rev);
                check_status(nm, ml_binary_scalar_cuda((ml_binop)op, dt, b.data(), x.data(), s, rev, n, &emu_ctx),
                             ML_OK);
                check(nm, bytes(dt, b, n), ref_out(dt, a, n), 0);
            }
}

static void unary(ml_dtype dt, int64_t n)
{
    auto x = as_dt(dt, input(dt, n)), rx = ref_in(dt, x, n);
    for (int op = 0; op < ML_NUNOPS; op++) {
        std::vector<unsigned char> a(n * 8 + 8, 0), b(n * 8 + 8, 0xff);
        ml_status want = ml_unary_cpu((ml_unop)op, ml_grad_dtype(dt), a.data(), rx.data(), n, &emu_ctx);
        char nm[96];
        snprintf(nm, sizeof nm, "unary %s %s n=%ld", uop[op], dtn(dt), (long)n);
        check_status(nm, ml_unary_cuda((ml_unop)op, dt, b.data(), x.data(), n, &emu_ctx), want);
        if (want == ML_OK)
            check(nm, bytes(dt, b, n), ref_out(dt, a, n), 0);
    }
}

int main()
{
    for (ml_dtype dt : ALL)
        for (int64_t n : {15, 1, 0, 257, 1001})
            fill_arange(dt, n);
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16, ML_I32, ML_I64}) {
        binary(dt, 54, 54, 9);    /* [6,9] op [9] */
        binary(dt, 54, 9, 54);
        binary(dt, 54, 54, 54);
        binary(dt, 513, 513, 1);
        binary(dt, 1, 1, 1);
        binary(dt, 0, 1, 1);
        binary(dt, 600, 3, 200);
        scalar(dt, 301);
        scalar(dt, 1);
        scalar(dt, 0);
        unary(dt, 1023);
        unary(dt, 1);
        unary(dt, 0);
    }
    for (ml_dtype dt : {ML_BF16, ML_F16})   /* the CPU refuses both */
        check_status(std::string("binary add ") + dtn(dt) + " cpu",
                     ml_binary_cpu(ML_ADD, dt, nullptr, nullptr, nullptr, 4, 4, 4, &emu_ctx), ML_EUNSUPPORTED);
    check_status("unary exp f16", ml_unary_cuda(ML_EXP, ML_F16, nullptr, nullptr, 4, &emu_ctx),
                 ML_EUNSUPPORTED);
    return emu_finish();
}
