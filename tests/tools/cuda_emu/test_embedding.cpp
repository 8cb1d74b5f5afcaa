/* kernels/embedding.cu under the emulator against kernels/embedding.c:
 * bitwise in f32 and f64; bf16 (W and dout rounded to bf16, dW f32 by
 * ml_grad_dtype) bitwise the CPU's f32 kernel on the widened values, the
 * forward a copy and the backward the same f32 adds in the same order
 * (tests/spec/gpu_dense_spec.lua) */
#include "cuda_util.cu.cpp"
#include "embedding.cu.cpp"
#include "emu.h"

static void run(ml_dtype dt, int64_t T, int64_t V, int64_t D)
{
    ml_dtype gd = ml_grad_dtype(dt), rt = gd;   /* dW's dtype; the CPU's reference in it */
    std::vector<int64_t> ids(T + 1);
    std::uniform_int_distribution<int64_t> u(0, V - 1);
    for (int64_t i = 0; i < T; i++)
        ids[i] = i % 3 == 2 ? 5 % V : u(emu_rng);   /* a third one hot id: runs across tiles */
    auto W = rounded(dt, randn(V * D)), dout = rounded(dt, randn(T * D)), dW0 = rounded(gd, randn(V * D));
    char nm[96];
    snprintf(nm, sizeof nm, "%s T=%ld V=%ld D=%ld", dtn(dt), (long)T, (long)V, (long)D);
    std::string s = nm;
    auto cW = as_dt(rt, W), cdout = as_dt(rt, dout), cdW = as_dt(rt, dW0);
    std::vector<unsigned char> cout_(T * D * ml_dtype_size(rt) + 1);
    ml_embedding_forward_cpu(rt, cout_.data(), ids.data(), cW.data(), T, V, D, &emu_ctx);
    ml_embedding_backward_cpu(rt, cdW.data(), cdout.data(), ids.data(), T, V, D, &emu_ctx);
    auto gW = as_dt(dt, W), gdout = as_dt(dt, dout), gdW = as_dt(gd, dW0);
    std::vector<unsigned char> gout(T * D * ml_dtype_size(dt) + 1, 0xff);
    check_status(s, ml_embedding_forward_cuda(dt, gout.data(), ids.data(), gW.data(), T, V, D, &emu_ctx), ML_OK);
    check_status(s, ml_embedding_backward_cuda(dt, gdW.data(), gdout.data(), ids.data(), T, V, D, &emu_ctx),
                 ML_OK);
    check(s + " forward", to_d(dt, gout.data(), T * D), to_d(rt, cout_.data(), T * D), 0);
    check(s + " backward dW (+=, " + dtn(gd) + ")", to_d(gd, gdW.data(), V * D), to_d(rt, cdW.data(), V * D), 0);
}

int main()
{
    for (ml_dtype dt : {ML_F32, ML_F64, ML_BF16}) {
        run(dt, 3000, 197, 40);
        run(dt, 1, 1, 1);
        run(dt, 257, 64, 3);
        run(dt, 20, 300, 300);
    }
    check_status("T=0", ml_embedding_backward_cuda(ML_F32, nullptr, nullptr, nullptr, 0, 5, 5, &emu_ctx), ML_OK);
    return emu_finish();
}
