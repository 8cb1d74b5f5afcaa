#!/bin/bash
# tests/tools/cuda_emu/moelua.sh - the whole program with its CUDA backend
# run by the emulator (emu.h), so `--device cuda` runs end to end on a
# machine without a GPU: build/cuda_emu/moelua links the host and CPU
# kernel objects of `make CUDA=1` (build/cuda/) with every kernels/*.cu
# rewritten by launch.lua and compiled as C++ (matmul.cu aside: cuBLAS's
# stand-in, emu_cublas, is in emu_runtime.cpp), the emulator's runtime and
# the CUDA runtime calls of the host (host_api.cpp); NCCL is
# build/cuda_emu/lib/libnccl.so.2 built from nccl_emu.c (MPI messages),
# which the binary's RPATH ($ORIGIN/lib) makes dlopen find before the real
# one, so multi-rank CUDA runs work under mpiexec. Slow (every CUDA
# thread is a fiber): tiny shapes. A developer tool, not part of make test.
# Usage, from the repository root:
#   tests/tools/cuda_emu/moelua.sh                       # build
#   build/cuda_emu/moelua SCRIPT [args]                  # e.g. the GPU specs:
#   build/cuda_emu/moelua /usr/bin/busted tests/spec/gpu_train_spec.lua
set -eo pipefail
cd "$(dirname "$0")/../../.."
T=tests/tools/cuda_emu
B=build/cuda_emu/prog
make CUDA=1 -j2 >/dev/null
mkdir -p $B/gen
CXX="g++ -std=c++20 -O2 -g -ffp-contract=off -fopenmp -Wall -Wno-unused-parameter -Wno-unused-function"
EMU="$CXX -DML_WITH_CUDA -I$T/include -Ikernels -I$B/gen"
newer() { [ ! -e "$1" ] || [ -n "$(find "${@:2}" -newer "$1" 2>/dev/null)" ]; }
objs=""
for cu in kernels/*.cu; do
    f=$(basename "$cu" .cu)
    [ "$f" = matmul ] && continue
    o=$B/$f.cu.o
    if newer "$o" "$cu" kernels/*.h kernels/*.cuh $T/include $T/launch.lua; then
        lua5.4 $T/launch.lua "$cu" $B/gen/$f.cu.cpp
        $EMU -c $B/gen/$f.cu.cpp -o "$o"
    fi
    objs="$objs $o"
done
newer $B/emu_runtime.o $T/emu_runtime.cpp $T/emu.h $T/include && $EMU -c $T/emu_runtime.cpp -o $B/emu_runtime.o
newer $B/host_api.o $T/host_api.cpp && $CXX -I/usr/local/cuda/include -c $T/host_api.cpp -o $B/host_api.o
L=build/cuda_emu/lib
mkdir -p $L
newer $L/libnccl.so.2 $T/nccl_emu.c && gcc -std=c11 -O2 -g -Wall -Wextra -Wno-unused-parameter \
    -fPIC -shared -I/usr/local/cuda/include $(pkg-config --cflags mpich) $T/nccl_emu.c \
    -o $L/libnccl.so.2 $(pkg-config --libs mpich)
host=$(find build/cuda/host build/cuda/kernels -name '*.o' ! -name '*.cu.o' | sort)
g++ -o build/cuda_emu/moelua $host $objs $B/emu_runtime.o $B/host_api.o \
    -Wl,-E /usr/lib/x86_64-linux-gnu/liblua5.4.a -lopenblas -ldnnl -lreadline -lcrypto -lm -ldl \
    -fopenmp -pthread $(pkg-config --libs mpich) -Wl,--disable-new-dtags,-rpath,'$ORIGIN/lib'
echo "built build/cuda_emu/moelua"
