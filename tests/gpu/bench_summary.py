#!/usr/bin/env python3
"""tests/gpu/bench_summary.py RESULTS_DIR - summary.txt of tests/gpu/bench.sh.

Reads the JSON lines of peak.jsonl (moe_layer_torch_gpu.py --what peak),
moe.jsonl (moe_layer.lua --device cuda and moe_layer_torch_gpu.py) and
train.jsonl (train.lua --device cuda); other lines (warnings) are ignored.
Prints:
  - the measured matmul peaks (TFLOP/s, torch.matmul 8192^3);
  - per MoE config: fwd, bwd, total ms, the expert GEMMs' TFLOP/s and their
    share of the measured peak of the run's dtype (f32 runs: the f32 peak),
    peak memory; then moelua's time over torch eager's in the same dtype
    (bf16 and f32; below 1: moelua is faster);
  - per training run: tokens/s and MFU = model FLOPs per token * tokens/s /
    peak, with model FLOPs per token 6 * active params (the experts counted
    at topk/experts; the usual 6N) and, beside it, 6N plus causal
    attention's 6 * layers * seq * dim, each against the bf16 peak (the
    usual MFU denominator) and the f32 peak.
Standard library only.
"""
import json
import os
import sys


def read(path):
    rows = []
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: bench_summary.py RESULTS_DIR")
    res = sys.argv[1]
    peaks = {r["dtype"]: r["tflops"] for r in read(os.path.join(res, "peak.jsonl"))
             if r.get("bench") == "matmul_peak"}
    moe = [r for r in read(os.path.join(res, "moe.jsonl")) if r.get("bench") == "moe_layer"]
    train = read(os.path.join(res, "train.jsonl"))

    print("measured matmul peak (torch.matmul 8192^3, median): " +
          (", ".join("%s %.1f TFLOP/s" % (d, peaks[d]) for d in sorted(peaks)) or "none (the peak step failed)"))
    gpu = next((r["gpu"] for r in read(os.path.join(res, "peak.jsonl")) + moe if "gpu" in r), None)
    if gpu:
        print("gpu: " + gpu)

    print("\nMoE layer forward + backward (expert GEMM FLOPs 6*T*k*3*D*F; %peak: of the run's dtype's peak)")
    print("%-6s %-5s %-6s %-5s %-26s %-5s %9s %9s %9s %8s %6s %9s" %
          ("T", "D", "F", "E/k", "impl", "dtype", "fwd ms", "bwd ms", "total ms", "TFLOP/s", "%peak", "peak GiB"))
    times = {}
    for r in moe:
        dtype = r.get("dtype", "f32")
        impl = r["impl"]
        if impl == "torch_hf":
            impl += " (%s)" % r.get("experts_impl", "eager")
        elif r.get("tile") is not None:
            impl += " (tile %d)" % r["tile"]
        total = r["fwd_ms"] + r["bwd_ms"]
        tflops = r["gemm_gflops"] / 1e3
        pk = peaks.get(dtype)
        print("%-6d %-5d %-6d %-5s %-26s %-5s %9.1f %9.1f %9.1f %8.1f %6s %9.2f" %
              (r["tokens"], r["dim"], r["ffn"], "%d/%d" % (r["experts"], r["topk"]), impl, dtype,
               r["fwd_ms"], r["bwd_ms"], total, tflops, fmt(pk and 100 * tflops / pk, ".1f"),
               r["peak_bytes"] / 2 ** 30))
        key = (r["tokens"], r["dim"], r["ffn"], r["experts"], r["topk"])
        if r["impl"] == "moelua" and r.get("tile", 256) == 256:
            times.setdefault(key, {})["moelua_" + dtype] = total
        elif r["impl"] == "torch_hf" and r.get("experts_impl", "eager") == "eager":
            times.setdefault(key, {})["torch_" + dtype] = total
    print("\nmoelua time / torch eager time in the same dtype (below 1: moelua faster)")
    for key in sorted(times):
        t = times[key]
        parts = []
        for d in ("bf16", "f32"):
            m, o = t.get("moelua_" + d), t.get("torch_" + d)
            parts.append("%s %s" % (d, fmt(m and o and m / o, ".2f")))
        print("T %d D %d F %d E %d k %d: %s" % (key + (", ".join(parts),)))

    print("\ntraining step (train.lua; MFU = FLOPs per token * tokens/s / peak)")
    print("  6N: 6 * active params (experts at topk/experts); +attn: plus causal attention 6 * layers * seq * dim")
    for r in train:
        if "tokens_per_s" not in r:
            continue
        n = r.get("active_params")
        tps = r["tokens_per_s"]
        print("%s %s, model D %d L %d E %d k %d F %d, seq %d: %.0f tokens/s, step %.1f ms, params %s (active %s)" %
              (r.get("device", "cpu"), r.get("dtype", "f32"), r["dim"], r["layers"], r["experts"], r["topk"],
               r["ffn"], r["seq_len"], tps, r["step_ms"], r.get("params"), n))
        planned, peak = r.get("planned_peak_ledger_bytes"), r.get("peak_ledger_bytes", {}).get("total")
        untracked = r.get("device_untracked_bytes")
        if r.get("device") == "cuda" and planned is not None and peak is not None:
            print("  ledger peak %d bytes, planned %d (%s); outside the ledger (cudaMemGetInfo's used less the "
                  "allocator's reserved): %s MiB" % (peak, planned, "equal" if peak == planned else "DIFFER",
                                                    fmt(untracked and untracked / 2**20, ".1f")))
        if n is None:
            continue
        f6n = 6 * n
        fattn = f6n + 6 * r["layers"] * r["seq_len"] * r["dim"]
        for d in ("bf16", "f32"):
            pk = peaks.get(d)
            if pk:
                print("  MFU against the measured %s peak (%.1f TFLOP/s): 6N %.3g%%, 6N+attn %.3g%%" %
                      (d, pk, 100 * f6n * tps / (pk * 1e12), 100 * fattn * tps / (pk * 1e12)))
            else:
                print("  MFU against the %s peak: no %s peak measured" % (d, d))
    if not train:
        print("no training results (see train_*.log)")


if __name__ == "__main__":
    main()
