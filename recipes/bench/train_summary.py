#!/usr/bin/env python3
"""Medians and moelua/PyTorch ratios of train_compare.sh's JSON lines.
  /usr/bin/python3 recipes/bench/train_summary.py runs/bench/train.jsonl"""
import collections
import json
import statistics
import sys

rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    line = line.strip()
    if line.startswith("{"):
        r = json.loads(line)
        rows[(r["seq_len"], r["impl"])].append(r)

MiB = 2 ** 20
med = statistics.median
print("| seq_len | impl | runs | tokens/s | step ms | data | fwd | bwd | optim | peak RSS MiB | ledger peak MiB | acts+pool MiB |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
summary = {}
for S in sorted({k[0] for k in rows}):
    for impl in ("torch", "moelua"):
        rs = rows.get((S, impl))
        if not rs:
            continue
        m = {"tps": med([r["tokens_per_s"] for r in rs]), "ms": med([r["step_ms"] for r in rs]),
             "rss": med([r["peak_rss_bytes"] for r in rs])}
        ph = {k: med([r["phases_ms"][k] for r in rs]) for k in ("data", "fwd", "bwd", "optim")}
        led = ap = ""
        if impl == "moelua":
            led = "%.0f" % (med([r["peak_ledger_bytes"]["total"] for r in rs]) / MiB)
            ap = "%.0f" % (med([r["peak_acts_pool_bytes"] for r in rs]) / MiB)
        summary[(S, impl)] = m
        print("| %d | %s | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %s | %s |" % (
            S, impl, len(rs), m["tps"], m["ms"], ph["data"], ph["fwd"], ph["bwd"], ph["optim"],
            m["rss"] / MiB, led, ap))
print()
# Round i's moelua run and torch run of a seq_len ran back to back: their
# ratio is the least disturbed comparison; quote its median over the rounds.
print("| seq_len | tokens/s moelua / torch (median of per-round ratios) | per round "
      "| peak RSS moelua / torch |")
print("|---:|---:|---|---:|")
for S in sorted({k[0] for k in summary}):
    ours, theirs = rows.get((S, "moelua"), []), rows.get((S, "torch"), [])
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours, theirs)]
    rss = [a["peak_rss_bytes"] / b["peak_rss_bytes"] for a, b in zip(ours, theirs)]
    if pairs:
        print("| %d | %.2fx | %s | %.2fx |" % (S, med(pairs), ", ".join("%.2f" % x for x in pairs), med(rss)))
