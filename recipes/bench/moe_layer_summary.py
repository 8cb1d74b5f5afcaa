#!/usr/bin/env python3
"""Medians over the rounds of recipes/bench/moe_layer_compare.sh, one table row per
(config, implementation, thread configuration), with moelua's time and peak RSS
as ratios of the best PyTorch baseline (the implementation and thread
configuration with the lowest median time for that shape, named).
  Usage: moe_layer_summary.py runs/bench/moe_layer.jsonl"""
import json
import os
import statistics
import sys
from collections import defaultdict

runs = defaultdict(list)
if len(sys.argv) != 2 or not os.path.isfile(sys.argv[1]):
    sys.exit("usage: python3 recipes/bench/moe_layer_summary.py LINES (the JSON lines of its benchmark)")
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("bench") == "env":
        print("machine", json.dumps(r))
        continue
    if r.get("bench") != "moe_layer":
        print("router_memory", json.dumps(r))
        continue
    impl = r["impl"] + (" " + r["config"] if r["impl"].startswith("torch") else "")
    key = (r["tokens"], r["dim"], r["ffn"], r["experts"], r["topk"], r.get("recompute", "-"), impl)
    runs[key].append(r)

def med(rs, f):
    return statistics.median(x[f] for x in rs)

rows = {}
for key, rs in sorted(runs.items()):
    total = med(rs, "fwd_ms") + med(rs, "bwd_ms")
    rows[key] = (total, med(rs, "peak_rss_bytes"))
    print("T=%-6d D=%-4d F=%-5d E=%-3d k=%d %-9s %-20s n=%d fwd %8.1f ms bwd %8.1f ms total %8.1f ms "
          "rss %7.1f MiB%s" % (key[0], key[1], key[2], key[3], key[4], key[5], key[6], len(rs),
                               med(rs, "fwd_ms"), med(rs, "bwd_ms"), total, med(rs, "peak_rss_bytes") / 2**20,
                               " floor %.1f%%" % med(rs, "floor_pct") if "floor_pct" in rs[0] else ""))
for key, (t, rss) in rows.items():
    if key[6] != "moelua":
        continue
    base = {k[6]: v for k, v in rows.items() if k[:5] == key[:5] and k[6].startswith("torch")}
    if base:
        best = min(base, key=lambda k: base[k][0])
        bt, brss = base[best]
        print("T=%d E=%d %s: time %.2fx the best PyTorch (%s, %.1f ms), peak RSS %.2fx" % (
            key[0], key[3], key[5], t / bt, best, bt, rss / brss))
