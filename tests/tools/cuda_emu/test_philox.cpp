/* kernels/philox.cu under the emulator against kernels/philox.c. DESIGN.md:
 * integer and uniform draws bit-identical on CPU and CUDA, normals to a few
 * ulp. rand is checked bitwise for every float dtype; randn in f64 by its
 * largest ulp distance (0 here: the emulator uses glibc's log/cos; a GPU's
 * differ by 1-2 ulp) and in the narrow dtypes bitwise; element i is a pure
 * function of (seed, offset, i): offset 1 is offset 0 shifted by 4 */
#include "cuda_util.cu.cpp"
#include "philox.cu.cpp"
#include "emu.h"

/* ulps between two doubles: their bits mapped to a monotone unsigned order */
static uint64_t ordered(double a)
{
    uint64_t u;
    memcpy(&u, &a, 8);
    return u >> 63 ? ~u : u | (1ull << 63);
}
static double ulps(double a, double b)
{
    uint64_t x = ordered(a), y = ordered(b);
    return (double)(x > y ? x - y : y - x);
}

static void run(ml_dtype dt, int64_t n, uint64_t seed, uint64_t offset)
{
    size_t es = ml_dtype_size(dt);
    for (int normal = 0; normal < 2; normal++) {
        std::vector<unsigned char> a(n * es + 8, 0), b(n * es + 8, 0xff);
        double p = normal ? 1 : -2, q = normal ? 2 : 3;
        char nm[96];
        snprintf(nm, sizeof nm, "%s %s n=%ld seed=%llu offset=%llu", normal ? "randn" : "rand", dtn(dt), (long)n,
                 (unsigned long long)seed, (unsigned long long)offset);
        if (normal) {
            ml_randn_cpu(dt, a.data(), n, seed, offset, p, q, &emu_ctx);
            check_status(nm, ml_randn_cuda(dt, b.data(), n, seed, offset, p, q, &emu_ctx), ML_OK);
        } else {
            ml_rand_cpu(dt, a.data(), n, seed, offset, p, q, &emu_ctx);
            check_status(nm, ml_rand_cuda(dt, b.data(), n, seed, offset, p, q, &emu_ctx), ML_OK);
        }
        check(std::string(nm) + " bytes", std::vector<double>(b.begin(), b.begin() + n * es),
              std::vector<double>(a.begin(), a.begin() + n * es), 0);
        if (normal && dt == ML_F64) {
            double worst = 0;
            for (int64_t i = 0; i < n; i++)
                worst = std::max(worst, ulps(((double *)a.data())[i], ((double *)b.data())[i]));
            check(std::string(nm) + " max ulp <= 4", {worst}, {0}, 4);
        }
        if (!normal && n >= 12) {   /* in [lo, hi) */
            auto g = to_d(dt, b.data(), n);
            double bad = 0;
            for (double e : g)
                bad += !(e >= p && e <= q);   /* bf16/f16 rounding may reach hi */
            check(std::string(nm) + " in range", {bad}, {0}, 0);
        }
    }
    if (n >= 12) {
        std::vector<unsigned char> a(12 * es), b(8 * es);
        check_status("rand by counter", ml_rand_cuda(dt, a.data(), 12, seed, offset, 0, 1, &emu_ctx), ML_OK);
        check_status("rand by counter", ml_rand_cuda(dt, b.data(), 8, seed, offset + 1, 0, 1, &emu_ctx), ML_OK);
        check(std::string("rand offset+1 = shift by 4 ") + dtn(dt), to_d(dt, b.data(), 8),
              to_d(dt, a.data() + 4 * es, 8), 0);
    }
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16, ML_F16}) {
        run(dt, 1001, 1234, 77);
        run(dt, 4099, 42, 5);
        run(dt, 1, 9, 0);
        run(dt, 0, 9, 0);
        run(dt, 13, 0xfedcba9876543210ull, 0xffffffffull);      /* the counter carries into word 1 */
        run(dt, 257, 7, 0xfffffffffffffff0ull);                 /* and wraps */
    }
    check_status("rand i32 refused", ml_rand_cuda(ML_I32, nullptr, 4, 1, 0, 0, 1, &emu_ctx), ML_EUNSUPPORTED);
    return emu_finish();
}
