#!/usr/bin/env bash
# recipes/bench/store.sh: the expert store (--expert-budget) in one process.
# First the bandwidths that bound it, measured with dd on the disk under
# out_dir (where every store file of this script lives): the disk itself
# (O_DIRECT read and write) and the page cache (a buffered read of a cached
# file, a buffered overwrite of it in place), which serves a store file
# smaller than free memory after its first read. Then training: all experts
# resident (no store), then budgets of 100%, 50%, 25% of all slabs' bytes
# and two slabs, each with --expert-prefetch 2 and 0. Then generation
# (1024 bytes sampled at temperature 0.8, seed 1: the same bytes at every
# budget; a 2048-position KV cache, never full) from the checkpoint of a
# short resident run of the same model (60 steps, kept in out_dir and
# reused): all resident, 100%, 50%, 25% and one (inference) slab, three
# runs each. Before each run the load and the machine's disk traffic so
# far (/proc/vmstat) go to load.txt.
# recipes/bench/store_summary.lua makes the tables from out_dir.
#   recipes/bench/store.sh [out_dir=runs/bench/store] [steps=12] [part=all|generate]
# Model: D=256, 4 layers, 8 heads / 4 kv, E=8 top-2, F=512, seq_len 512,
# 2 threads, checkpoint moe. A training slab (parameters, gradients, both
# AdamW states, f32) is 48 D F bytes = 6 MiB, 32 of them = 192 MiB; an
# inference slab (parameters) is 12 D F = 1.5 MiB. About 4 min on 2 cores.
set -uo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 3 "$@"
out=${1:-runs/bench/store}
steps=${2:-12}
part=${3:-all}
bench_word out_dir "$out"
bench_count steps "$steps"
[ "$part" = all ] || [ "$part" = generate ] || bench_refuse "part must be all or generate, got '$part'"
D=256 F=512 L=4 E=8
model=(--dim $D --layers $L --heads 8 --kv-heads 4 --experts $E --ffn $F --seq-len 512 --threads 2)
slab=$((48 * D * F)) islab=$((12 * D * F)) slabs=$((L * E))
mkdir -p "$out"
: > "$out/load.txt"
# before each run: its name, the 1-minute load, the machine's disk KiB read and written so far
load() { echo "$1 $(cut -d' ' -f1 /proc/loadavg) $(awk '/^pgpg(in|out) / { print $2 }' /proc/vmstat | paste -sd' ')" >> "$out/load.txt"; }

# dd's last line: "N bytes (...) copied, S s, ..." -> "name bytes/s"
rate() { LC_ALL=C dd "${@:2}" 2>&1 | tail -1 | awk -v n="$1" '{ printf "%s %.0f\n", n, $1 / $(NF-3) }'; }
n=$(( (256 << 20) / slab ))
head -c $((n * slab)) /dev/urandom > "$out/bw.src"
{
    rate disk_write if="$out/bw.src" of="$out/bw.tmp" bs=$slab oflag=direct
    rate disk_read if="$out/bw.tmp" of=/dev/null bs=$slab iflag=direct
    cat "$out/bw.src" > /dev/null
    rate cache_read if="$out/bw.src" of=/dev/null bs=$slab
    rate cache_write if=/dev/zero of="$out/bw.src" bs=$slab count=$n conv=notrunc
    echo "slab_bytes $slab"
    echo "inference_slab_bytes $islab"
    echo "slabs $slabs"
    echo "steps $steps"
    echo "mem_available $(awk '/MemAvailable/ { print $2 * 1024 }' /proc/meminfo)"
} > "$out/bandwidth.txt"
rm -f "$out/bw.src" "$out/bw.tmp"

train() {  # name, extra options
    local dir="$out/$1"
    load "$1"
    timeout 900 ./moelua recipes/longctx.lua "${model[@]}" --steps "$steps" --warmup 1 --ckpt-every 0 \
        --run-dir "$dir" --overwrite "${@:2}" > "$dir.log" 2>&1 || echo "$1: no result (see $dir.log)" >&2
}
[ "$part" = generate ] || train all
[ "$part" = generate ] || for b in 100:$((slabs * slab)) 50:$((slabs * slab / 2)) 25:$((slabs * slab / 4)) two:$((2 * slab)); do
    for pf in 2 0; do
        train "b${b%%:*}_pf$pf" --expert-budget "${b#*:}" --expert-prefetch $pf --expert-store "$out/train.store"
    done
done

# generation: a short resident run's final checkpoint, then each budget
[ -e "$out/gen_ckpt/ckpt/latest" ] || train gen_ckpt --steps 60
for b in all 100:$((slabs * islab)) 50:$((slabs * islab / 2)) 25:$((slabs * islab / 4)) one:$islab; do
    budget=()
    [ "$b" != all ] && budget=(--expert-budget "${b#*:}" --expert-store "$out/gen.store")
    load "gen_${b%%:*}"
    for i in 1 2 3; do   # a run takes about a second: three runs, the summary takes the median
        timeout 600 ./moelua recipes/generate.lua --ckpt "$out/gen_ckpt/ckpt" --prompt "int main(int argc, char **argv)" \
            --n 1024 --seq-len 2048 --temperature 0.8 --seed 1 --threads 2 "${budget[@]}" > "$out/gen_${b%%:*}_$i.log" 2>&1 \
            || echo "generation $b: no result (see $out/gen_${b%%:*}_$i.log)" >&2
    done
done
load end
./moelua recipes/bench/store_summary.lua "$out"
