#!/usr/bin/env bash
# tests/gpu/bundle.sh - build gpu-bundle/: everything a GPU run needs on a
# machine with a CUDA driver (and PyTorch) but no Lua, busted, OpenBLAS or
# network. Run by `make gpu-bundle` after `make CUDA=1`.
#
#   gpu-bundle/moelua          the CUDA host (Lua 5.4 linked in, cudart static)
#   gpu-bundle/lua/            the moelua Lua library
#   gpu-bundle/share/lua/5.4/  busted and its Lua deps (luassert, say, pl, ...)
#   gpu-bundle/lib/lua/5.4/    their C modules (lfs, term, system, lpeg, ...)
#   gpu-bundle/lib/            shared libraries the binary and modules need
#                              (OpenBLAS, gfortran, readline, ...), not glibc
#   gpu-bundle/busted          the busted runner script
#   gpu-bundle/tests/spec/     every spec; gpu-bundle/run.sh runs them
#   gpu-bundle/recipes/        the recipes and benchmarks; gpu-bundle/bench.sh
#                              runs the GPU benchmarks (tests/gpu/bench.sh,
#                              its summary tests/gpu/bench_summary.py)
#   gpu-bundle/env.sh          the environment both scripts source
#
# cuBLAS is not carried (libcublas + libcublasLt are ~600 MB): moelua
# dlopens libcublas.so.13 on the first GPU matmul, and run.sh finds it in
# the machine's CUDA install or PyTorch's nvidia-cublas wheel.
# What travels is gpu-bundle.tar.gz (the directory is larger: MPICH alone is
# 41 MB, OpenBLAS 36 MB); it must stay under 64 MiB, and this script fails
# when it does not. On the GPU machine: tar xzf gpu-bundle.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=${MOELUA_CUDA_BIN:-build/cuda/moelua}
OUTDIR=gpu-bundle
LUA_SHARE=/usr/share/lua/5.4
LUA_LIB=/usr/lib/x86_64-linux-gnu/lua/5.4
LIMIT_KIB=$((64 * 1024))

[ -x "$BIN" ] || { echo "bundle.sh: $BIN missing; run make CUDA=1" >&2; exit 1; }
[ -d "$LUA_SHARE/busted" ] || { echo "bundle.sh: busted not installed (make deps)" >&2; exit 1; }

rm -rf "$OUTDIR" "$OUTDIR.tar.gz"
mkdir -p "$OUTDIR/lib/lua" "$OUTDIR/share/lua" "$OUTDIR/tests"

# the binary without debug info (the bundle is size-limited)
cp "$BIN" "$OUTDIR/moelua"
strip --strip-debug "$OUTDIR/moelua"

cp -r lua "$OUTDIR/lua"
cp -r tests/spec "$OUTDIR/tests/spec"
cp tests/support.lua "$OUTDIR/tests/support.lua"
cp README.md "$OUTDIR/README.md"   # optim_spec and train_spec run its examples
for d in tests/data tests/fixtures recipes; do
    [ -d "$d" ] && cp -r "$d" "$OUTDIR/$d"
done
cp tests/gpu/run.sh tests/gpu/bench.sh tests/gpu/env.sh "$OUTDIR/"
mkdir -p "$OUTDIR/tests/gpu"
cp tests/gpu/bench_summary.py "$OUTDIR/tests/gpu/"
chmod +x "$OUTDIR/run.sh" "$OUTDIR/bench.sh"

# busted and friends: Lua files (dereferencing Debian's 5.1 symlinks) and C modules
cp -rL "$LUA_SHARE" "$OUTDIR/share/lua/5.4"
cp -rL "$LUA_LIB" "$OUTDIR/lib/lua/5.4"
cp -L /usr/bin/busted "$OUTDIR/busted"

# Shared libraries: the dependency closure of the binary and the C modules,
# minus glibc (the target's own must be used) and the CUDA driver.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libutil\.so|libresolv\.so|libcuda\.so)'
objs=("$BIN")
while IFS= read -r f; do objs+=("$f"); done < <(find -L "$LUA_LIB" -name '*.so')
for o in "${objs[@]}"; do
    ldd "$o" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -L "$path" "$OUTDIR/lib/$name"
done

# a missing library would only show on the GPU machine: check here
if LD_LIBRARY_PATH="$OUTDIR/lib" ldd "$OUTDIR/moelua" | grep -q "not found"; then
    echo "bundle.sh: unresolved libraries:" >&2
    LD_LIBRARY_PATH="$OUTDIR/lib" ldd "$OUTDIR/moelua" | grep "not found" >&2
    exit 1
fi
# the bundle runs here too (CUDA reported unavailable, GPU specs skipped)
(cd "$OUTDIR" && env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$PWD/lib" MOELUA_LUA_DIR="$PWD/lua" \
    LUA_PATH="$PWD/share/lua/5.4/?.lua;$PWD/share/lua/5.4/?/init.lua" LUA_CPATH="$PWD/lib/lua/5.4/?.so" \
    ./moelua -e 'require "busted.runner"; require "moelua"') \
    || { echo "bundle.sh: the bundled moelua cannot load busted and moelua" >&2; exit 1; }

tar czf "$OUTDIR.tar.gz" "$OUTDIR"
kib=$(( $(stat -c %s "$OUTDIR.tar.gz") / 1024 ))
echo "$OUTDIR.tar.gz: $kib KiB of $LIMIT_KIB allowed ($(du -sh "$OUTDIR" | cut -f1) unpacked)"
du -sh "$OUTDIR"/moelua "$OUTDIR"/lib "$OUTDIR"/share "$OUTDIR"/lua "$OUTDIR"/tests | sed 's/^/  /'
if [ "$kib" -gt "$LIMIT_KIB" ]; then
    echo "bundle.sh: $OUTDIR.tar.gz exceeds 64 MiB" >&2
    exit 1
fi
