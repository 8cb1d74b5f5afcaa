/* kernels/dispatch.cu under the emulator against kernels/dispatch.c:
 * bitwise (integers), dropless, capacity-drop and per-expert-capacity
 * paths, several tiles; pack (every element size) and unpack (f32, f64,
 * bitwise: the same order of additions; bf16 bitwise against the CPU's
 * f32 sum of the widened values, rounded once) over the plans */
#include "cuda_util.cu.cpp"
#include "dispatch.cu.cpp"
#include "emu.h"

static std::vector<double> dv(const std::vector<int64_t> &v) { return std::vector<double>(v.begin(), v.end()); }

/* A scratch of exactly ml_dispatch_scratch_bytes_cuda bytes, garbage-filled
 * (ASan sees any use past it); NULL for 0 bytes, as the op passes. */
struct scratch {
    std::vector<unsigned char> b;
    scratch(int64_t n, int64_t E, int check) : b(ml_dispatch_scratch_bytes_cuda(n, E, check), 0xa5) {}
    void *p() { return b.empty() ? nullptr : b.data(); }
};

static int64_t find_bad_cuda(const int64_t *idx, int64_t n, int64_t E)
{
    return ml_dispatch_find_bad_cuda(idx, n, E, scratch(n, E, 1).p(), &emu_ctx);
}

static int64_t check_plan_cuda(const int64_t *o, const int64_t *r, const int64_t *idx, int64_t n, int64_t E)
{
    return ml_dispatch_check_plan_cuda(o, r, idx, n, E, scratch(n, E, 1).p(), &emu_ctx);
}

/* pack and unpack over the plan (o, r) of n = rows·div assignments:
 * bitwise against the CPU, unpack adding into the same garbage-free rows */
static void pack_unpack(const std::string &s, const int64_t *o, const int64_t *r, int64_t n, int64_t E,
                        int64_t div)
{
    int64_t kept = o[E], rows = n / div;
    for (ml_dtype dt : {ML_U8, ML_BF16, ML_F32, ML_F64}) {
        for (int64_t cols : {1, 5, 67}) {
            std::string nm = s + " " + dtn(dt) + " cols=" + std::to_string(cols) + " div=" + std::to_string(div);
            std::vector<unsigned char> in(rows * cols * ml_dtype_size(dt) + 1);   /* any bits: pack copies */
            std::uniform_int_distribution<int> byte(0, 255);
            for (auto &b : in)
                b = (unsigned char)byte(emu_rng);
            size_t bytes = kept * cols * ml_dtype_size(dt);
            std::vector<unsigned char> p1(bytes + 1, 0x5a), p2(bytes + 1, 0x5a);
            check_status(nm + " pack", ml_dispatch_pack_cpu(dt, p1.data(), in.data(), r, kept, cols, div, &emu_ctx),
                         ML_OK);
            check_status(nm + " pack", ml_dispatch_pack_cuda(dt, p2.data(), in.data(), r, kept, cols, div, &emu_ctx),
                         ML_OK);
            check(nm + " pack", std::vector<double>(p2.begin(), p2.end()), std::vector<double>(p1.begin(), p1.end()),
                  0);
            if (dt == ML_U8)
                continue;
            /* the CPU's sum (bf16: in f32 over the widened values, rounded once at the end) */
            ml_dtype rd = ml_grad_dtype(dt);
            auto rin = as_dt(dt, randn(kept * cols)), u2 = as_dt(dt, randn(rows * cols));
            auto rin1 = as_dt(rd, to_d(dt, rin.data(), kept * cols)), u1 = as_dt(rd, to_d(dt, u2.data(), rows * cols));
            std::vector<unsigned char> sc(ml_dispatch_unpack_scratch_bytes_cuda(rows, div), 0xa5);
            if (dt == ML_BF16)   /* CPU runs are fp32 */
                check_status(nm + " unpack cpu refuses", ml_dispatch_unpack_cpu(dt, u2.data(), rin.data(), r, kept,
                                                                                cols, div, rows, nullptr, &emu_ctx),
                             ML_EUNSUPPORTED);
            check_status(nm + " unpack", ml_dispatch_unpack_cpu(rd, u1.data(), rin1.data(), r, kept, cols, div, rows,
                                                                nullptr, &emu_ctx), ML_OK);
            check_status(nm + " unpack", ml_dispatch_unpack_cuda(dt, u2.data(), rin.data(), r, kept, cols, div, rows,
                                                                 sc.empty() ? nullptr : sc.data(), &emu_ctx), ML_OK);
            check(nm + " unpack (+=)", to_d(dt, u2.data(), rows * cols), rounded(dt, to_d(rd, u1.data(), rows * cols)),
                  0);
        }
    }
}

/* caps: per-expert capacities (cap ignored) when not empty */
static void run(int64_t n, int64_t E, int64_t cap, bool skewed, std::vector<int64_t> caps = {}, int64_t div = 1)
{
    std::vector<int64_t> idx(n + 1);
    std::uniform_int_distribution<int64_t> u(0, E - 1);
    for (int64_t a = 0; a < n; a++)
        idx[a] = skewed && a % 3 ? 0 : u(emu_rng);
    std::vector<int64_t> o1(E + 1, -5), o2(E + 1, -5), r1(n + 1, -5), r2(n + 1, -5), c1(E + 1, -5), c2(E + 1, -5);
    std::vector<uint8_t> d1(n + 1, 7), d2(n + 1, 9);
    int64_t nd1 = -1, nd2 = -2;
    const int64_t *cp = caps.empty() ? nullptr : caps.data();
    ml_dispatch_cpu(o1.data(), r1.data(), c1.data(), d1.data(), &nd1, idx.data(), n, E, cap, cp, nullptr, &emu_ctx);
    check_status("dispatch", ml_dispatch_cuda(o2.data(), r2.data(), c2.data(), d2.data(), &nd2, idx.data(), n, E,
                                              cap, cp, scratch(n, E, 0).p(), &emu_ctx), ML_OK);
    char nm[96];
    snprintf(nm, sizeof nm, "dispatch n=%ld E=%ld cap=%ld%s%s", (long)n, (long)E, (long)cap, skewed ? " skewed" : "",
             cp ? " caps" : "");
    std::string s = nm;
    check(s + " offsets", dv(o2), dv(o1), 0);
    check(s + " order", dv(r2), dv(r1), 0);
    check(s + " counts", dv(c2), dv(c1), 0);
    check(s + " dropped", std::vector<double>(d2.begin(), d2.end() - 1), std::vector<double>(d1.begin(), d1.end() - 1), 0);
    check(s + " ndropped", {(double)nd2}, {(double)nd1}, 0);
    check(s + " check_plan", {(double)check_plan_cuda(o1.data(), r1.data(), idx.data(), n, E)},
          {(double)ml_dispatch_check_plan_cpu(o1.data(), r1.data(), idx.data(), n, E, nullptr, &emu_ctx)}, 0);
    if (n % div == 0)
        pack_unpack(s, o1.data(), r1.data(), n, E, div);
    if (o1[E] > 2) {   /* a broken plan: two kept entries swapped, then a bad offset */
        std::swap(r1[0], r1[o1[E] - 1]);
        check(s + " check_plan swapped", {(double)check_plan_cuda(o1.data(), r1.data(), idx.data(), n, E)},
              {(double)ml_dispatch_check_plan_cpu(o1.data(), r1.data(), idx.data(), n, E, nullptr, &emu_ctx)}, 0);
        o1[E / 2] = n + 1;
        check(s + " check_plan offsets", {(double)check_plan_cuda(o1.data(), r1.data(), idx.data(), n, E)},
              {(double)ml_dispatch_check_plan_cpu(o1.data(), r1.data(), idx.data(), n, E, nullptr, &emu_ctx)}, 0);
    }
    check(s + " find_bad", {(double)find_bad_cuda(idx.data(), n, E)},
          {(double)ml_dispatch_find_bad_cpu(idx.data(), n, E, nullptr, &emu_ctx)}, 0);
    if (n > 10) {
        idx[n - 3] = E;
        idx[n - 7] = -1;
        check(s + " find_bad (bad ids)", {(double)find_bad_cuda(idx.data(), n, E)},
              {(double)ml_dispatch_find_bad_cpu(idx.data(), n, E, nullptr, &emu_ctx)}, 0);
    }
}

int main()
{
    run(0, 4, -1, false);
    run(1, 1, -1, false);
    run(37, 3, -1, false);
    run(37, 3, 5, false);
    run(37, 3, 0, false);
    run(5000, 7, -1, false);          /* three tiles, E not a power of two */
    run(5000, 7, 600, true);          /* drops in every tile */
    run(4097, 64, 70, false);
    run(6000, 1, 2500, false);
    run(37, 3, -1, false, {4, 0, 9}, 1);                  /* per-expert capacities (cap ignored) */
    run(40, 5, 3, false, {40, 40, 40, 40, 40}, 2);         /* caps keeping everything, pack per token */
    run(5000, 7, -1, true, {600, 0, 1, 5000, 300, 2, 650}, 4);
    run(4096, 64, 70, false, std::vector<int64_t>(64, 50), 8);
    return emu_finish();
}
