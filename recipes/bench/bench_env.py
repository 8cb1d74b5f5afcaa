#!/usr/bin/env python3
"""What a benchmark ran on, for the compare scripts and the PyTorch
baselines. As a script: one JSON line describing the machine (CPU model and
the SIMD flags that pick GEMM kernels, the OpenBLAS kernel path (core name)
and every OPENBLAS_* / OMP_* variable as set (read only; never changed
here), the load average at the start):
  /usr/bin/python3 recipes/bench/bench_env.py >> runs/bench/train.jsonl
As a module (the torch scripts): blas_library() and thread_config(torch)."""
import ctypes
import json
import os
import time


def openblas():
    """OpenBLAS's pool size and kernel path, or (None, None)."""
    try:
        ob = ctypes.CDLL("libopenblas.so.0")
        ob.openblas_get_corename.restype = ctypes.c_char_p
        return ob.openblas_get_num_threads(), ob.openblas_get_corename().decode()
    except OSError:
        return None, None


def blas_library():
    """The libblas.so.3 this process actually mapped (must be OpenBLAS)."""
    with open("/proc/self/maps") as f:
        for line in f:
            if "libblas" in line or "openblas" in line:
                return os.path.realpath(line.split()[-1])
    return "unknown"


def thread_config(torch):
    """What ran: torch's pool, OpenMP's wait policy, OpenBLAS's pool and kernel path."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").lower() or "default"
    threads, core = openblas()
    return {"config": "t%d%s" % (torch.get_num_threads(), "-" + policy if policy != "default" else ""),
            "threads": torch.get_num_threads(), "omp_wait_policy": policy,
            "openblas_threads": threads, "openblas_core": core}


def machine():
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags |= set(line.split(":", 1)[1].split())
    return {
        "bench": "env", "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": model, "cores": os.cpu_count(),
        "flags": [f for f in ("fma", "avx2", "avx512f", "avx512bw") if f in flags],
        "openblas_core": openblas()[1],
        "vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OPENBLAS_", "OMP_"))},
        "loadavg": os.getloadavg()[0],
    }


if __name__ == "__main__":
    print(json.dumps(machine()))
