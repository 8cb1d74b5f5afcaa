#!/usr/bin/env python3
"""PyTorch eager baselines of moelua's MoE layer, for recipes/bench/moe_layer.lua.

Same layer: router logits x @ Wg^T in fp32, softmax, top-k, renormalised
weights (Mixtral), SwiGLU experts w2(silu(w1 x) * w3 x), forward + backward
of sum(y * dy) with respect to x and every weight. Two implementations:

  hf      the Hugging Face MixtralSparseMoeBlock loop: one_hot expert mask,
          per expert index_select, matmuls, index_add_
  sorted  tokens sorted by expert (argsort of the flat top-k ids), one
          contiguous slice per expert, scatter back with index_add_

One JSON object per line, same field names as the Lua recipe. Run one config
per process so ru_maxrss is that config's peak:

  /usr/bin/python3 recipes/bench/moe_layer_torch.py --impl sorted --tokens 32768

Needs Debian's python3-torch (make bench-deps) under /usr/bin/python3 (not a
pyenv python on PATH). Its BLAS is whatever libblas.so.3 resolves to, which
must be OpenBLAS: the "blas" field of each line says which library was mapped.

Thread configuration: --threads sets torch's OpenMP pool; OpenBLAS keeps its own
pool for the GEMMs, and the two compete for the cores. Run under
OMP_WAIT_POLICY=PASSIVE to make idle OpenMP threads sleep. Each line records
what ran ("config": t<threads>[-passive], "threads", "omp_wait_policy",
"openblas_threads", "openblas_core"); moe_layer_compare.sh keeps the best.
"""
import argparse
import json
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from bench_env import blas_library, thread_config


def moe_hf(x, wg, w1, w3, w2, k):
    logits = x @ wg.t()
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    y = torch.zeros_like(x)
    mask = F.one_hot(experts, num_classes=wg.shape[0]).permute(2, 1, 0)
    for e in range(wg.shape[0]):
        slot, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
        y.index_add_(0, tok, (h @ w2[e].t()) * weights[tok, slot, None])
    return y


def moe_sorted(x, wg, w1, w3, w2, k):
    T = x.shape[0]
    logits = x @ wg.t()
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.bincount(flat, minlength=wg.shape[0]).tolist()
    xs = x[tok]
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n:
            xe = xs[start:start + n]
            h = F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())
            outs.append(h @ w2[e].t())
        start += n
    out = torch.cat(outs) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tok, out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=["hf", "sorted"], default="sorted")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    T, D, Fh, E, k = a.tokens, a.dim, a.ffn, a.experts, a.topk
    s = 0.02
    x = torch.randn(T, D, requires_grad=True)
    wg = (torch.randn(E, D) * s).requires_grad_()
    w1 = (torch.randn(E, Fh, D) * s).requires_grad_()
    w3 = (torch.randn(E, Fh, D) * s).requires_grad_()
    w2 = (torch.randn(E, D, Fh) * s).requires_grad_()
    dy = torch.randn(T, D)
    fn = moe_hf if a.impl == "hf" else moe_sorted
    fwd, bwd = [], []
    for _ in range(a.reps + 1):             # the first run is warm-up
        for t in (x, wg, w1, w3, w2):
            t.grad = None
        t0 = time.perf_counter()
        y = fn(x, wg, w1, w3, w2, k)
        t1 = time.perf_counter()
        y.backward(dy)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    fwd, bwd = fwd[1:], bwd[1:]
    flops = 6 * T * k * D * Fh * 3          # forward 2*T*k*3*D*F, backward twice that
    print(json.dumps({
        "bench": "moe_layer", "impl": "torch_" + a.impl, "tokens": T, "dim": D, "ffn": Fh,
        "experts": E, "topk": k, **thread_config(torch), "reps": a.reps,
        "fwd_ms": 1e3 * statistics.median(fwd), "bwd_ms": 1e3 * statistics.median(bwd),
        "gemm_gflops": flops / (statistics.median(fwd) + statistics.median(bwd)) / 1e9,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "torch": torch.__version__, "blas": blas_library(),
    }))


if __name__ == "__main__":
    main()
