# tests/gpu/env.sh - sourced by the bundle's run.sh and bench.sh (copied
# next to them by tests/gpu/bundle.sh): finds cuBLAS and NCCL (both
# dlopen'ed by moelua) and points moelua at the bundle's libraries, Lua
# library and busted. Sets B (the bundle's directory: the caller's $PWD),
# cublas_dir and nccl_dir (empty when not found).
B=$PWD

# cuBLAS: the CUDA install first, then a pip wheel (PyTorch), then ldconfig
cublas_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && { cublas_dir=$d; break; }
done
if [ -z "$cublas_dir" ] && command -v python3 >/dev/null; then
    for p in $(python3 -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null); do
        for d in "$p"/nvidia/cublas/lib "$p"/nvidia/cu13/lib; do
            [ -e "$d/libcublas.so.13" ] && { cublas_dir=$d; break 2; }
        done
    done
fi
if [ -z "$cublas_dir" ]; then
    f=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF; exit}')
    [ -n "$f" ] && cublas_dir=$(dirname "$f")
fi

# NCCL (libnccl.so.2): the CUDA install, then a pip wheel (PyTorch's
# nvidia-nccl), then ldconfig
nccl_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda-13*/lib64 /usr/local/cuda-13*/lib; do
    [ -e "$d/libnccl.so.2" ] && { nccl_dir=$d; break; }
done
if [ -z "$nccl_dir" ] && command -v python3 >/dev/null; then
    for p in $(python3 -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null); do
        for d in "$p"/nvidia/nccl/lib "$p"/nvidia/cu13/lib; do
            [ -e "$d/libnccl.so.2" ] && { nccl_dir=$d; break 2; }
        done
    done
fi
if [ -z "$nccl_dir" ]; then
    f=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
    [ -n "$f" ] && nccl_dir=$(dirname "$f")
fi

export LD_LIBRARY_PATH="$B/lib${cublas_dir:+:$cublas_dir}${nccl_dir:+:$nccl_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOELUA_LUA_DIR="$B/lua"
# $B/?.lua: the specs' require "tests.support"
export LUA_PATH="$B/share/lua/5.4/?.lua;$B/share/lua/5.4/?/init.lua;$B/?.lua;$B/?/init.lua"
export LUA_CPATH="$B/lib/lua/5.4/?.so"
unset LUA_PATH_5_4 LUA_CPATH_5_4

# the machine, cuBLAS and moelua's view of CUDA (device.txt of run.sh and bench.sh)
describe_device() {
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -n) $(uname -r)"
    echo "cublas: ${cublas_dir:-NOT FOUND (GPU matmuls will fail)}"
    echo "nccl: ${nccl_dir:-NOT FOUND (GPU collectives will fail)}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ./moelua -e 'local m = require "moelua"; print("moelua cuda_available: " .. tostring(m.cuda_available()))'
}
