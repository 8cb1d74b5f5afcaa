#!/usr/bin/env python3
"""Peak acts+pool against seq_len from train.lua JSON lines (train_memory.sh):
measured (the ledger's peaks over the measured step) and planned (the same
code as a moelua.mem.plan dry run), with the ratio to the previous seq_len.
  /usr/bin/python3 recipes/bench/train_memory_summary.py runs/bench/train_memory.jsonl"""
import json
import os
import sys

MiB = 2 ** 20
series = {}
if len(sys.argv) != 2 or not os.path.isfile(sys.argv[1]):
    sys.exit("usage: python3 recipes/bench/train_memory_summary.py LINES (the JSON lines of its benchmark)")
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{"):
        r = json.loads(line)
        key = "L=%d D=%d H=%d/%d E=%d F=%d ck=%s" % (r["layers"], r["dim"], r["heads"], r["kv_heads"],
                                                     r["experts"], r["ffn"], r["checkpoint"])
        series.setdefault(key, []).append(r)
print("| model | seq_len | peak acts MiB | peak pool MiB | acts+pool MiB | x previous "
      "| planned acts+pool MiB | ledger peak MiB | planned ledger peak MiB | peak RSS MiB | step s |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for key, rs in series.items():
    prev = None
    for r in sorted(rs, key=lambda r: r["seq_len"]):
        p = r["peak_ledger_bytes"]
        ap = r["peak_acts_pool_bytes"]
        print("| %s | %d | %.1f | %.1f | %.1f | %s | %.1f | %.1f | %.1f | %.1f | %.0f |" % (
            key, r["seq_len"], p["acts"] / MiB, p["pool"] / MiB, ap / MiB,
            "%.3f" % (ap / prev) if prev else "", r["planned_peak_acts_pool_bytes"] / MiB,
            p["total"] / MiB, r["planned_peak_ledger_bytes"] / MiB, r["peak_rss_bytes"] / MiB,
            r["step_ms"] / 1e3))
        prev = ap
