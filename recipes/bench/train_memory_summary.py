#!/usr/bin/env python3
"""Peak acts+pool against seq_len from train.lua JSON lines (train_memory.sh).
  /usr/bin/python3 recipes/bench/train_memory_summary.py runs/bench/train_memory.jsonl"""
import json
import sys

MiB = 2 ** 20
series = {}
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{"):
        r = json.loads(line)
        key = "L=%d D=%d H=%d/%d E=%d F=%d ck=%s" % (r["layers"], r["dim"], r["heads"], r["kv_heads"],
                                                     r["experts"], r["ffn"], r["checkpoint"])
        series.setdefault(key, []).append(r)
print("| model | seq_len | peak acts MiB | peak pool MiB | acts+pool MiB | x previous | pool high-water MiB | acts+pool high-water | x previous | ledger peak MiB | peak RSS MiB | step s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for key, rs in series.items():
    prev = prevhw = None
    for r in sorted(rs, key=lambda r: r["seq_len"]):
        p = r["peak_ledger_bytes"]
        ap = r["peak_acts_pool_bytes"]
        ratio = "%.3f" % (ap / prev) if prev else ""
        hw = r.get("pool_high_water_bytes")
        hwa = p["acts"] + hw if hw is not None else None
        rhw = "%.3f" % (hwa / prevhw) if (prevhw and hwa) else ""
        print("| %s | %d | %.1f | %.1f | %.1f | %s | %s | %s | %s | %.1f | %.1f | %.0f |" % (
            key, r["seq_len"], p["acts"] / MiB, p["pool"] / MiB, ap / MiB, ratio,
            "%.1f" % (hw / MiB) if hw is not None else "", "%.1f" % (hwa / MiB) if hwa else "", rhw,
            p["total"] / MiB, r["peak_rss_bytes"] / MiB, r["step_ms"] / 1e3))
        prev, prevhw = ap, hwa
