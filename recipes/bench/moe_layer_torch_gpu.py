#!/usr/bin/env python3
"""PyTorch eager GPU baseline of recipes/bench/moe_layer.lua --device cuda,
and the GPU's measured matmul peak (the denominator of MFU figures).

  python3 recipes/bench/moe_layer_torch_gpu.py --what moe --tokens 32768 --dim 4096 \\
      --ffn 14336 --experts 8 --topk 2 --dtype f32,bf16
  python3 recipes/bench/moe_layer_torch_gpu.py --what peak --dtype bf16,f32

moe: Hugging Face's MixtralSparseMoeBlock (transformers.models.mixtral),
built from a MixtralConfig with hidden_size D, intermediate_size F,
num_local_experts E, num_experts_per_tok k (no jitter noise; on transformers
>= 5 the experts' kernel is --experts-impl, default eager: the per-expert
loop every version has), weights
N(0, 0.02) as moelua's, on CUDA in the given dtype; forward of x [T, D]
(as [1, T, D]) and backward of the output against a random dy. fwd_ms and
bwd_ms are medians over --reps after --warmup steps, timed with CUDA events;
gemm_gflops uses the Lua recipe's expert GEMM FLOPs (6 * T * k * 3 * D * F);
peak_bytes is torch.cuda.max_memory_allocated over the timed steps.

peak: torch.matmul of two N x N matrices (N = --size, 8192) per dtype;
tflops is the median over --reps calls after --warmup, 2 * N^3 / time.

f32 means f32: TF32 is switched off (moelua's cuBLAS handle uses
CUBLAS_DEFAULT_MATH, no TF32). One JSON line per config. Imports nothing
but torch, transformers (moe only), json, argparse, time and statistics;
needs no network. Exits with a message when torch, transformers or a CUDA
device is missing.
"""
import argparse
import json
import statistics
import time

DTYPES = ("f32", "bf16")


def need_torch():
    try:
        import torch
    except ImportError as e:
        raise SystemExit("moe_layer_torch_gpu.py: PyTorch is not installed (%s)" % e)
    return torch


def need_cuda(torch):
    if not torch.cuda.is_available():
        raise SystemExit("moe_layer_torch_gpu.py: CUDA is unavailable to PyTorch %s "
                         "(no GPU, no driver, or a CPU-only build: torch.version.cuda = %s)"
                         % (torch.__version__, torch.version.cuda))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def need_block():
    try:
        import transformers
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        from transformers import MixtralConfig
    except ImportError as e:
        raise SystemExit("moe_layer_torch_gpu.py: transformers (with Mixtral) is not installed (%s); "
                         "--what peak needs only torch" % e)
    return transformers.__version__, MixtralConfig, MixtralSparseMoeBlock


def dtype_of(torch, name):
    return {"f32": torch.float32, "bf16": torch.bfloat16}[name]


def timed(torch, fn, warmup, reps):
    """Median seconds of fn() over reps calls after warmup calls, CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def matmul_peak(torch, name, n, warmup, reps):
    dt = dtype_of(torch, name)
    a = torch.randn(n, n, device="cuda", dtype=dt)
    b = torch.randn(n, n, device="cuda", dtype=dt)
    c = torch.empty(n, n, device="cuda", dtype=dt)
    s = timed(torch, lambda: torch.matmul(a, b, out=c), warmup, reps)
    return {"bench": "matmul_peak", "impl": "torch", "device": "cuda", "dtype": name, "size": n,
            "reps": reps, "ms": 1e3 * s, "tflops": 2 * n ** 3 / s / 1e12,
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}


def moe_step(torch, block_cls, config_cls, name, a):
    T, D, F, E, k = a.tokens, a.dim, a.ffn, a.experts, a.topk
    dt = dtype_of(torch, name)
    torch.manual_seed(0)
    cfg = config_cls(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=k,
                     router_jitter_noise=0.0)
    # transformers >= 5 picks the experts' kernel per config; older ones always loop (eager)
    if hasattr(cfg, "_experts_implementation"):
        try:
            cfg._experts_implementation = a.experts_impl
        except (AttributeError, ValueError) as e:
            raise SystemExit("moe_layer_torch_gpu.py: --experts-impl %s: %s" % (a.experts_impl, e))
    elif a.experts_impl != "eager":
        raise SystemExit("moe_layer_torch_gpu.py: --experts-impl %s needs transformers >= 5 "
                         "(this one only has the eager loop)" % a.experts_impl)
    with torch.device("cuda"):   # built and drawn on the GPU: Mixtral width is 1.4e9 weights
        block = block_cls(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    block = block.to(dtype=dt).train()
    x = torch.randn(1, T, D, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(1, T, D, device="cuda", dtype=dt)
    params = list(block.parameters())

    def step(times=None):
        for p in params:
            p.grad = None
        x.grad = None
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        out = block(x)
        y = out[0] if isinstance(out, tuple) else out
        e1.record()
        y.backward(dy)
        e2.record()
        e2.synchronize()
        if times is not None:
            times[0].append(e0.elapsed_time(e1) / 1e3)
            times[1].append(e1.elapsed_time(e2) / 1e3)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = ([], [])
    t0 = time.perf_counter()
    for _ in range(a.reps):
        step(times)
    wall = (time.perf_counter() - t0) / a.reps
    f, b = statistics.median(times[0]), statistics.median(times[1])
    flops = 6 * T * k * 3 * D * F         # forward 2*T*k*3*D*F, backward twice that
    out = {"bench": "moe_layer", "impl": "torch_hf", "experts_impl": a.experts_impl, "device": "cuda",
           "dtype": name, "tokens": T, "dim": D, "ffn": F, "experts": E, "topk": k, "reps": a.reps, "warmup": a.warmup,
           "fwd_ms": 1e3 * f, "bwd_ms": 1e3 * b, "step_wall_ms": 1e3 * wall,
           "gemm_gflops": flops / (f + b) / 1e9,
           "peak_bytes": torch.cuda.max_memory_allocated(),
           "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    del block, x, dy, params
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--what", choices=["moe", "peak"], default="moe")
    p.add_argument("--dtype", default="f32,bf16", help="comma list of f32, bf16")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--experts-impl", default="eager",
                   help="moe: the experts' kernel on transformers >= 5 (eager, batched_mm, grouped_mm)")
    p.add_argument("--size", type=int, default=8192, help="peak: matrix size N")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    names = [s for s in a.dtype.split(",") if s]
    for s in names:
        if s not in DTYPES:
            p.error("--dtype: unknown dtype '%s' (f32, bf16)" % s)
    if a.reps < 1 or a.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    torch = need_torch()
    if a.what == "moe":
        tv, config_cls, block_cls = need_block()
    need_cuda(torch)
    for s in names:
        if a.what == "peak":
            out = matmul_peak(torch, s, a.size, a.warmup, a.reps)
        else:
            out = moe_step(torch, block_cls, config_cls, s, a)
            out["transformers"] = tv
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
