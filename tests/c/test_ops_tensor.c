/*
 * tests/c/test_ops_tensor.c - the tensor ops of host/runtime/ops_view.c and
 * ops_math.c called from C on a host with the CPU backend and no Lua
 * state, printing TAP.
 *
 * Covers: arange, a narrow + transpose view sharing storage, a copy of that
 * view into a contiguous tensor, matmul (plain and with a transposed
 * operand) against a product computed by hand, a broadcast add, a sum
 * reduction over a dim and over everything, a refused argument (status and
 * message, nothing allocated), buffers on both sides of the CPU backend's
 * huge-page threshold (backend_cpu.c), and the ledger back to zero. Not here: the
 * Lua bindings and their messages (tests/spec/math_spec.lua,
 * math_errors_spec.lua, tensor_spec.lua).
 */
#include <stdint.h>
#include <string.h>

#include "ops_math.h"
#include "ops_view.h"
#include "tap.h"

static ml_host h;

static const double *f64(const ml_tensor *t)
{
    return ml_data(t);
}

static int equals(const ml_tensor *t, const double *want, int64_t n)
{
    if (ml_numel(t) != n || t->dtype != ML_F64 || !ml_is_contiguous(t))
        return 0;
    for (int64_t i = 0; i < n; i++)
        if (f64(t)[i] != want[i])
            return 0;
    return 1;
}

/* x [3,4] = 0..11 (f64), the input of every test below. */
static ml_status make_x(ml_tensor *x, ml_err *e)
{
    ML_TRY(ml_op_arange(&h, x, ML_CPU, ML_F64, 0, 12, 1, e));
    ml_tensor flat = *x;
    *x = (ml_tensor){0};
    int64_t shape[2] = {3, 4};
    ml_status s = ml_op_view(x, &flat, 2, shape, e);
    ml_tensor_drop(&flat);
    return s;
}

static void test_arange_views_copy(void)
{
    ml_err e;
    ml_tensor x = {0}, n = {0}, v = {0}, c = {0};
    ok(make_x(&x, &e) == ML_OK && x.ndim == 2 && x.shape[0] == 3 && x.shape[1] == 4 &&
       f64(&x)[0] == 0 && f64(&x)[11] == 11, "arange: 0..11, viewed as [3,4]");
    /* columns 1..2 of x, transposed: [2,3] = {{1,5,9},{2,6,10}} */
    ok(ml_op_narrow(&n, &x, 1, 1, 2, &e) == ML_OK && ml_op_transpose(&v, &n, 0, 1, &e) == ML_OK,
       "narrow + transpose: ok");
    ok(v.st == x.st && v.st->refs == 3 && v.shape[0] == 2 && v.shape[1] == 3 && v.offset == 1 &&
       v.stride[0] == 1 && v.stride[1] == 4 && !ml_is_contiguous(&v),
       "narrow + transpose: a strided view sharing x's storage");
    ok(ml_tensor_alloc(&h, &c, ML_CPU, ML_F64, 2, v.shape, &e) == ML_OK &&
       ml_op_copy(&h, &c, &v, &e) == ML_OK, "copy: into a contiguous tensor");
    static const double want[6] = {1, 5, 9, 2, 6, 10};
    ok(equals(&c, want, 6), "copy: the view's values in row-major order");
    ml_tensor_drop(&c);
    ml_tensor_drop(&v);
    ml_tensor_drop(&n);
    ml_tensor_drop(&x);
}

static void test_matmul(void)
{
    ml_err e;
    ml_tensor x = {0}, xt = {0}, p = {0}, q = {0};
    make_x(&x, &e);
    /* x xᵀ [3,3]: row i of x is 4i + (0,1,2,3), so
     * (x xᵀ)[i][j] = Σ_k (4i+k)(4j+k) = 16ij·4 + 4(i+j)·6 + 14 */
    ok(ml_op_transpose(&xt, &x, 0, 1, &e) == ML_OK &&
       ml_op_matmul(&h, &p, &x, &xt, 1, 0, &e) == ML_OK, "matmul: x times a transposed view");
    double want[9];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++)
            want[i * 3 + j] = 64.0 * i * j + 24.0 * (i + j) + 14;
    ok(equals(&p, want, 9), "matmul: x xT is the hand-computed product");
    /* out given: c = 2 x xᵀ + 1 c accumulates in place */
    ok(ml_op_matmul(&h, &p, &x, &xt, 2, 1, &e) == ML_OK, "matmul: into a given out, alpha, beta");
    for (int i = 0; i < 9; i++)
        want[i] *= 3;
    ok(equals(&p, want, 9), "matmul: out = 2 x xT + out");
    /* k = 0: no BLAS call, c = beta c */
    int64_t z[2] = {3, 0}, zt[2] = {0, 3};
    ml_tensor a0 = {0}, b0 = {0};
    ml_tensor_alloc(&h, &a0, ML_CPU, ML_F64, 2, z, &e);
    ml_tensor_alloc(&h, &b0, ML_CPU, ML_F64, 2, zt, &e);
    ok(ml_op_matmul(&h, &p, &a0, &b0, 1, 0.5, &e) == ML_OK && f64(&p)[0] == 0.5 * want[0] &&
       f64(&p)[4] == 0.5 * want[4], "matmul: k = 0 scales out by beta");
    ok(ml_op_matmul(&h, &q, &x, &x, 1, 0, &e) == ML_EINVAL &&
       strcmp(e.msg, "shapes [3,4] and [3,4] do not agree on the inner dimension") == 0 && !q.st,
       "matmul: a bad shape is ML_EINVAL with its message and allocates nothing");
    ml_tensor_drop(&a0);
    ml_tensor_drop(&b0);
    ml_tensor_drop(&p);
    ml_tensor_drop(&xt);
    ml_tensor_drop(&x);
}

static void test_add_sum(void)
{
    ml_err e;
    ml_tensor x = {0}, b = {0}, y = {0}, s = {0}, all = {0};
    make_x(&x, &e);
    ml_op_arange(&h, &b, ML_CPU, ML_F64, 100, 500, 100, &e);   /* [4] = 100..400 */
    ok(ml_op_binary(&h, &y, ML_ADD, &x, &b, &e) == ML_OK && y.ndim == 2 && y.shape[0] == 3 &&
       y.shape[1] == 4, "add: [3,4] + [4] broadcasts to [3,4]");
    double want[12];
    for (int i = 0; i < 12; i++)
        want[i] = i + 100.0 * (i % 4 + 1);
    ok(equals(&y, want, 12), "add: the bias is added to every row");
    ok(ml_op_binary(&h, &x, ML_ADD, &x, &b, &e) == ML_OK && equals(&x, want, 12),
       "add: in place (out == a)");
    ok(ml_op_reduce(&h, &s, NULL, ML_RSUM, &y, 0, &e) == ML_OK && s.ndim == 1 && s.shape[0] == 4,
       "sum over dim 0: [4]");
    static const double col[4] = {312, 615, 918, 1221};
    ok(equals(&s, col, 4), "sum over dim 0: the column sums");
    ok(ml_op_reduce(&h, &all, NULL, ML_RSUM, &y, -1, &e) == ML_OK && all.ndim == 0 &&
       f64(&all)[0] == 3066, "sum of everything: a 0-dim tensor");
    ml_tensor bad = {0}, i32 = {0};
    int64_t two = 2;
    ml_tensor_alloc(&h, &i32, ML_CPU, ML_I32, 1, &two, &e);
    ok(ml_op_binary(&h, &bad, ML_ADD, &x, &i32, &e) == ML_EINVAL && !bad.st &&
       strcmp(e.msg, "dtypes differ (f64 and i32): convert one with :to()") == 0,
       "add: mixed dtypes are refused with a message");
    ml_tensor_drop(&i32);
    ml_tensor_drop(&all);
    ml_tensor_drop(&s);
    ml_tensor_drop(&y);
    ml_tensor_drop(&b);
    ml_tensor_drop(&x);
}

/* f32 tensors just under and just over 2 MiB (backend_cpu.c maps the
 * latter on its own, at a 2 MiB boundary, except under ASan): filled to
 * the last element, charged to the ledger at the size asked, freed. */
static void test_large_buffers(void)
{
    ml_err e;
    int64_t n[2] = {((int64_t)2 << 20) / 4 - 1, ((int64_t)2 << 20) / 4 + 1};
    for (int i = 0; i < 2; i++) {
        ml_tensor t = {0};
        size_t before = h.books[ML_CPU].total;
        ok(ml_tensor_alloc(&h, &t, ML_CPU, ML_F32, 1, &n[i], &e) == ML_OK &&
           h.books[ML_CPU].total - before == (size_t)n[i] * 4,
           "%lld f32: allocated, the ledger charged %lld bytes", (long long)n[i], (long long)n[i] * 4);
        const float *d = ml_data(&t);
        ok(ml_op_fill(&h, &t, 3.5, &e) == ML_OK && d[0] == 3.5f && d[n[i] / 2] == 3.5f &&
           d[n[i] - 1] == 3.5f, "%lld f32: written and read to the last element", (long long)n[i]);
#ifndef __SANITIZE_ADDRESS__
        if (i == 1)
            ok((uintptr_t)d % ((uintptr_t)2 << 20) == 0, "over 2 MiB: at a 2 MiB boundary (huge pages)");
#endif
        ml_tensor_drop(&t);
        ok(h.books[ML_CPU].total == before, "%lld f32: freed", (long long)n[i]);
    }
    /* a freed mapping serves the next request of its length, and is
     * charged again; mem.empty_cache's unmap leaves nothing kept */
    ml_tensor a = {0}, b = {0};
    ok(ml_tensor_alloc(&h, &a, ML_CPU, ML_F32, 1, &n[1], &e) == ML_OK, "a mapping: allocated");
    const void *first = ml_data(&a);
    ml_tensor_drop(&a);
    ok(ml_tensor_alloc(&h, &b, ML_CPU, ML_F32, 1, &n[1], &e) == ML_OK &&
       h.books[ML_CPU].total == (size_t)n[1] * 4 && ml_op_fill(&h, &b, 1.0, &e) == ML_OK,
       "the same length again: charged and writable");
#ifndef __SANITIZE_ADDRESS__
    ok(ml_data(&b) == first, "... in the kept mapping (under ASan, malloc's)");
#else
    (void)first;
#endif
    ml_tensor_drop(&b);
    ml_cpu_empty_cache();
    ok(h.books[ML_CPU].total == 0, "empty_cache: the ledger unchanged");
}

int main(void)
{
    ml_host_init(&h);
    test_arange_views_copy();
    test_matmul();
    test_add_sum();
    test_large_buffers();
    ok(h.books[ML_CPU].total == 0, "ledger: back to zero after every tensor is dropped");
    ml_host_free(&h);
    return tap_done();
}
