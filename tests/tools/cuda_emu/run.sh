#!/bin/bash
# CUDA kernels on the CPU: builds each kernels/<family>.cu as C++ against an
# emulated CUDA runtime (README at the top of emu.h) with ASan + UBSan, and
# runs it against the CPU kernels (kernels/*.c), threads in order and
# reversed; prints the FAIL lines and each run's summary (a family that
# does not build is a FAIL; the others still run). A developer tool, not
# part of `make test`. Usage, from the repository root:
#   tests/tools/cuda_emu/run.sh [family ...]     (default: every family)
set -eo pipefail
cd "$(dirname "$0")/../../.."
T=tests/tools/cuda_emu
B=build/cuda_emu
SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined -g -O1"
mkdir -p $B/gen $B/cpu
objs=""
for c in kernels/*.c; do
    o=$B/cpu/$(basename "$c" .c).o
    if [ ! -e "$o" ] || [ "$c" -nt "$o" ] || [ -n "$(find kernels -name '*.h' -newer "$o")" ]; then
        gcc -std=c11 -D_GNU_SOURCE -fopenmp -ffp-contract=off -Wall -Wno-unused-parameter $SAN -c "$c" -o "$o"
    fi
    objs="$objs $o"
done
fams="$*"
[ -n "$fams" ] || fams=$(ls $T/test_*.cpp | sed 's/.*test_\(.*\)\.cpp/\1/')
status=0
for f in $fams; do
    for cu in cuda_util $f; do
        lua5.4 $T/launch.lua kernels/$cu.cu $B/gen/$cu.cu.cpp
    done
    g++ -std=c++20 -ffp-contract=off -Wall -Wextra -Wno-unused-parameter $SAN -I$T/include -Ikernels \
        -I$B/gen $T/test_$f.cpp $objs -lopenblas -ldnnl -fopenmp -lm -pthread -o $B/test_$f \
        || { echo "== $f"; echo "FAIL $f does not build"; status=1; continue; }
    echo "== $f"
    for rev in 0 1; do
        EMU_REVERSE=$rev ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 $B/test_$f \
            | grep -v '^ok' || status=1
    done
done
exit $status
