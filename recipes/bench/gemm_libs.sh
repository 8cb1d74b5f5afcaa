#!/usr/bin/env bash
# recipes/bench/gemm_libs.sh: builds recipes/bench/gemm_libs.c (cc -O2)
# against OpenBLAS, BLIS (OpenMP build), oneDNN and libxsmm from Debian and
# runs it: f32 GEMM GFLOP/s on 1 and 2 threads, error against f64 and
# bitwise determinism per library on moelua's shapes (issue 15). Not part
# of `make`; needs root once for the packages.
#   recipes/bench/gemm_libs.sh [rounds=7] [ms_per_sample=20]
# Leaves the environment (OPENBLAS_*, OMP_*) as it finds it: the run prints
# what it saw.
set -euo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 2 "$@"
bench_count rounds "${1:-7}"
bench_count ms_per_sample "${2:-20}"
pkgs="libopenblas-dev libblis-dev libdnnl-dev libxsmm-dev"
missing=$(for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
if [ -n "$missing" ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing
fi
mkdir -p build
cc -O2 -fopenmp -o build/gemm_libs recipes/bench/gemm_libs.c \
    -I/usr/include/x86_64-linux-gnu/blis-openmp \
    -lopenblas -L/usr/lib/x86_64-linux-gnu/blis-openmp -lblis -ldnnl \
    /usr/lib/libxsmmnoblas.a /usr/lib/libxsmm.a -lpthread -ldl -lrt -lm
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores;" \
     "flags $(grep -o -w 'avx2\|avx512f\|avx512bw\|fma' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
build/gemm_libs "${1:-7}" "${2:-20}"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
