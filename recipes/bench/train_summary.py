#!/usr/bin/env python3
"""Medians and moelua/PyTorch ratios of train_compare.sh's JSON lines. PyTorch
runs in several thread configurations ("config": t1, t2, t2-passive); per
seq_len the best one (highest median tokens/s) is the baseline, named in the
ratio table.
  /usr/bin/python3 recipes/bench/train_summary.py runs/bench/train.jsonl"""
import collections
import json
import os
import statistics
import sys

rows = collections.defaultdict(list)
if len(sys.argv) != 2 or not os.path.isfile(sys.argv[1]):
    sys.exit("usage: python3 recipes/bench/train_summary.py LINES (the JSON lines of its benchmark)")
for line in open(sys.argv[1]):
    line = line.strip()
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if r.get("bench") == "env":
        print("machine:", json.dumps(r))
        continue
    name = "torch " + r["config"] if r.get("impl") == "torch" else "moelua"
    rows[(r["seq_len"], name)].append(r)

MiB = 2 ** 20
med = statistics.median
print("| seq_len | impl | runs | tokens/s | step ms | data | fwd | bwd | optim | peak RSS MiB | ledger peak MiB | acts+pool MiB |")
print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
summary = {}
for S, name in sorted(rows, key=lambda k: (k[0], k[1] == "moelua", k[1])):
    rs = rows[(S, name)]
    m = {"tps": med([r["tokens_per_s"] for r in rs]), "ms": med([r["step_ms"] for r in rs]),
         "rss": med([r["peak_rss_bytes"] for r in rs])}
    ph = {k: med([r["phases_ms"][k] for r in rs]) for k in ("data", "fwd", "bwd", "optim")}
    led = ap = ""
    if name == "moelua":
        led = "%.0f" % (med([r["peak_ledger_bytes"]["total"] for r in rs]) / MiB)
        ap = "%.0f" % (med([r["peak_acts_pool_bytes"] for r in rs]) / MiB)
    summary[(S, name)] = m
    print("| %d | %s | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %s | %s |" % (
        S, name, len(rs), m["tps"], m["ms"], ph["data"], ph["fwd"], ph["bwd"], ph["optim"],
        m["rss"] / MiB, led, ap))
print()
# Round i's moelua run and its torch runs of a seq_len ran back to back: the
# per-round ratios show the spread; the quoted ratio is of the medians.
print("| seq_len | best PyTorch config | tokens/s moelua / torch (medians) | per round "
      "| peak RSS moelua / torch |")
print("|---:|---|---:|---|---:|")
for S in sorted({k[0] for k in summary}):
    base = [k for k in summary if k[0] == S and k[1] != "moelua"]
    if not base or (S, "moelua") not in summary:
        continue
    best = max(base, key=lambda k: summary[k]["tps"])
    ours, theirs = summary[(S, "moelua")], summary[best]
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rows[(S, "moelua")], rows[best])]
    print("| %d | %s | %.2fx | %s | %.2fx |" % (S, best[1], ours["tps"] / theirs["tps"],
                                                ", ".join("%.2f" % x for x in pairs),
                                                ours["rss"] / theirs["rss"]))
