/* kernels/copy.cu under the emulator against kernels/copy.c: strided
 * copies (narrow, transpose, select, broadcast strides, 0-dim) and every
 * dtype pair of conversions bitwise: bf16/f16 round to nearest even, NaN
 * stays NaN, integers saturate and map NaN to 0 (tests/spec/gpu_spec.lua) */
#include "cuda_util.cu.cpp"
#include "copy.cu.cpp"
#include "emu.h"

static const ml_dtype ALL[] = {ML_F32, ML_F64, ML_BF16, ML_F16, ML_I32, ML_I64, ML_U8};

/* the spec's cast values, plus rounding ties of bf16 and f16 */
static const double CASTS[] = {0.5, 1.5, 2.5, -2.5, 1 + 1.0 / 256, 65520, 70000, -3e9, 3e9, 1e20, -0.0, 300, -1,
                               INFINITY, -INFINITY, NAN, 1.0 / (1 << 20), 5.9604644775390625e-8,
                               1 + 3.0 / 512, 1 + 1.0 / 2048, 1 + 3.0 / 2048, 2.9802322387695312e-8,
                               -1e-45, 3e-40, 1e38, 255.5, -0.7, 9007199254740993.0, 65504, 65519.99};

/* out (row-major, dto) = in viewed with strides ist at element offset off */
static void strided(const char *what, ml_dtype dto, ml_dtype dti, const std::vector<int64_t> &shape,
                    const std::vector<int64_t> &ist, int64_t off, int64_t in_n)
{
    int nd = (int)shape.size();
    std::vector<int64_t> ost(nd + 1);
    int64_t n = 1;
    for (int d = nd - 1; d >= 0; d--) {
        ost[d] = n;
        n *= shape[d];
    }
    auto v = randn(in_n, 100.0);
    for (int64_t i = 0; i < in_n; i++)
        if (i % 5 == 1)
            v[i] = CASTS[i / 5 % (sizeof CASTS / sizeof *CASTS)];
    auto x = as_dt(dti, v);
    size_t es = ml_dtype_size(dto), ei = ml_dtype_size(dti);
    std::vector<unsigned char> a(n * es + 8, 0), b(n * es + 8, 0xff);
    const void *in = x.data() + off * ei;
    ml_copy_cpu(dto, a.data(), ost.data(), dti, in, ist.data(), nd, shape.data(), &emu_ctx);
    std::string nm = std::string(what) + " " + dtn(dti) + " -> " + dtn(dto);
    check_status(nm, ml_copy_cuda(dto, b.data(), ost.data(), dti, in, ist.data(), nd, shape.data(), &emu_ctx), ML_OK);
    check(nm, std::vector<double>(b.begin(), b.begin() + n * es), std::vector<double>(a.begin(), a.begin() + n * es),
          0);   /* the bytes: NaN payloads and -0 included */
}

int main()
{
    int64_t nc = sizeof CASTS / sizeof *CASTS;
    for (ml_dtype from : ALL)
        for (ml_dtype to : ALL) {
            std::vector<double> v(CASTS, CASTS + nc);
            auto x = as_dt(from, v);
            size_t es = ml_dtype_size(to);
            std::vector<unsigned char> a(nc * es, 0), b(nc * es, 0xff);
            int64_t st = 1;
            ml_copy_cpu(to, a.data(), &st, from, x.data(), &st, 1, &nc, &emu_ctx);
            std::string nm = std::string("cast ") + dtn(from) + " -> " + dtn(to);
            check_status(nm, ml_copy_cuda(to, b.data(), &st, from, x.data(), &st, 1, &nc, &emu_ctx), ML_OK);
            check(nm, std::vector<double>(b.begin(), b.end()), std::vector<double>(a.begin(), a.end()), 0);
        }
    for (ml_dtype to : {ML_F32, ML_BF16, ML_F16, ML_I32})
        for (ml_dtype from : {ML_F32, ML_F64}) {
            /* x [6,7,5] row-major: strides 35, 5, 1 */
            strided("narrow(2,2,4)", to, from, {6, 4, 5}, {35, 5, 1}, 5, 210);
            strided("transpose(1,3)", to, from, {5, 7, 6}, {1, 5, 35}, 0, 210);
            strided("select(1,2):t()", to, from, {5, 7}, {1, 5}, 70, 210);
            strided("transpose(1,2)", to, from, {7, 6, 5}, {5, 35, 1}, 0, 210);
            strided("broadcast (stride 0)", to, from, {4, 65}, {0, 1}, 0, 65);
            strided("0-dim", to, from, {}, {}, 3, 5);
            strided("one element", to, from, {1, 1}, {9, 9}, 2, 5);
            strided("empty", to, from, {3, 0, 2}, {0, 2, 1}, 0, 1);
            strided("row-major flat", to, from, {3, 300}, {300, 1}, 0, 900);
            strided("odd size 4-dim", to, from, {3, 5, 7, 11}, {1, 3, 15, 105}, 0, 1155);
        }
    int64_t sh[17], st[17];
    for (int d = 0; d < 17; d++)
        sh[d] = 1, st[d] = 1;
    check_status("ndim 17 refused", ml_copy_cuda(ML_F32, nullptr, st, ML_F32, nullptr, st, 17, sh, &emu_ctx),
                 ML_EUNSUPPORTED);
    return emu_finish();
}
