#!/usr/bin/env python3
"""One JSON line describing the machine a comparison ran on, for the compare
scripts' output files: CPU model and the SIMD flags that pick GEMM kernels, the
OpenBLAS kernel path (core name) and every OPENBLAS_* / OMP_* variable as set
(read only; never changed here), the load average at the start.
  /usr/bin/python3 recipes/bench/bench_env.py >> runs/bench/train.jsonl"""
import ctypes
import json
import os
import time

model, flags = "unknown", set()
with open("/proc/cpuinfo") as f:
    for line in f:
        if line.startswith("model name") and model == "unknown":
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
core = None
try:
    ob = ctypes.CDLL("libopenblas.so.0")
    ob.openblas_get_corename.restype = ctypes.c_char_p
    core = ob.openblas_get_corename().decode()
except OSError:
    pass
print(json.dumps({
    "bench": "env", "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": model, "cores": os.cpu_count(),
    "flags": [f for f in ("fma", "avx2", "avx512f", "avx512bw") if f in flags],
    "openblas_core": core,
    "vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OPENBLAS_", "OMP_"))},
    "loadavg": os.getloadavg()[0],
}))
