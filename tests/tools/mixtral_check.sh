#!/usr/bin/env bash
# tests/tools/mixtral_check.sh: cross-check moelua's Mixtral forward against an
# independent plain-PyTorch reference (tests/tools/mixtral_check.py).
#
#   tests/tools/mixtral_check.sh            # from the repository root, after make
#
# Trains a tiny model (recipes/tiny.lua, 3 steps, seq-len 64) into a temporary
# run directory, then for two data files (exactly one window; four windows plus
# a partial one that both sides leave out) runs
#   ./moelua recipes/eval.lua --ckpt RUN/ckpt --data FILE --seq-len 64 --json
#   /usr/bin/python3 tests/tools/mixtral_check.py --ckpt RUN/ckpt --data FILE --seq-len 64
# and requires |a - b| / |b| <= TOL (default 1e-6; measured differences are about 1e-7) for loss, aux_loss and
# z_loss, and equal token counts. Exits non-zero, printing both outputs, on a
# mismatch. Needs Debian's python3-torch at $PYTHON (default /usr/bin/python3);
# not part of make test (torch is a bench-only dependency).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-/usr/bin/python3}
TOL=${TOL:-1e-6}
STEPS=${STEPS:-3}
SEQ=64
W=$((SEQ + 1))

"$PYTHON" -c 'import torch' 2>/dev/null || { echo "mixtral_check.sh: $PYTHON has no torch (apt install python3-torch)" >&2; exit 2; }
[ -x ./moelua ] || { echo "mixtral_check.sh: ./moelua not built (run make)" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
./moelua recipes/tiny.lua --steps "$STEPS" --seq-len "$SEQ" --run-dir "$tmp/run" > "$tmp/train.log" 2>&1 ||
  { cat "$tmp/train.log" >&2; echo "mixtral_check.sh: training failed" >&2; exit 1; }

# Fixed, tracked source text as data (bytes < 256 = vocab_size).
head -c "$W" lua/moelua/ckpt.lua > "$tmp/one.txt"                    # exactly one window
tail -c $((4 * W + 10)) lua/moelua/ckpt.lua > "$tmp/four.txt"      # 4 windows + 10 left over

status=0
for f in "$tmp/one.txt" "$tmp/four.txt"; do
  ./moelua recipes/eval.lua --ckpt "$tmp/run/ckpt" --data "$f" --seq-len "$SEQ" --json > "$tmp/moelua.json"
  "$PYTHON" tests/tools/mixtral_check.py --ckpt "$tmp/run/ckpt" --data "$f" --seq-len "$SEQ" > "$tmp/torch.json"
  "$PYTHON" - "$tmp/moelua.json" "$tmp/torch.json" "$TOL" "$(basename "$f")" <<'EOF' || status=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
tol, name = float(sys.argv[3]), sys.argv[4]
bad = []
for k in ("loss", "aux_loss", "z_loss"):
    rel = abs(a[k] - b[k]) / max(abs(b[k]), 1e-30)
    print(f"{name}: {k:8s} moelua {a[k]:.10f}  torch {b[k]:.10f}  rel diff {rel:.2e}")
    if not rel <= tol:
        bad.append(f"{k} rel diff {rel:.3e} > {tol:g}")
for k in ("tokens", "windows"):
    if a[k] != b[k]:
        bad.append(f"{k}: moelua {a[k]} vs torch {b[k]}")
if bad:
    print(f"MISMATCH on {name}: " + "; ".join(bad))
    print("moelua:", json.dumps(a))
    print("torch: ", json.dumps(b))
    sys.exit(1)
EOF
done
if [ "$status" -ne 0 ]; then echo "mixtral_check.sh: FAILED" >&2; exit 1; fi
echo "mixtral_check.sh: ok (tol $TOL)"
