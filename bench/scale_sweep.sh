#!/usr/bin/env bash
# The 2/4/8-rank scaling sweep (bench/results/scale/): every method at 100 Mbit/s and 1 Gbit/s per
# link, the MLP at 2, 4 and 8 ranks and the GPT at 4 and 8 ranks, then the cost model fitted on the
# 2-rank runs and checked on the 4- and 8-rank ones. Needs root (network namespaces).
#
# Per-rank work is fixed across world sizes (weak scaling): MLP batch 32 per rank and a 7,500-sample
# shard per rank (so 8 ranks use all 60,000 Fashion-MNIST images and the global batch, 256, is the
# one the learning rates were tuned for at 2 ranks x 128); GPT batch 4 sequences per rank, 500 steps.
# Full trajectories run at 1 Gbit/s; at 100 Mbit/s every run trains a fixed number of timed steps and
# its row is projected from the 1 Gbit/s trajectory (bench/netbench_projection.py, marked in the
# tables). ddp/fp16 need few timed steps (no periodic structure); 120 is a multiple of every H.
#
# Usage: sudo bench/scale_sweep.sh [OUT_DIR]   (default bench/results/scale; reruns reuse finished jobs)
#        PARTS=mlp sudo bench/scale_sweep.sh    (only the MLP runs and the cost model; PARTS=gpt: only the GPT)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/results/scale}
PY=${PYTHON:-.venv/bin/python}
MLP_METHODS=ddp,fp16,powersgd,topk,slimdp,ist,diloco,sparseloco,slimdp-local
GPT_METHODS=ddp,slimdp-local,diloco,sparseloco

mlp() {  # world size, port, extra netbench flags...
  local w=$1 port=$2; shift 2
  "$PY" bench/netbench.py --world-size "$w" --rates 1gbit,100mbit --timed-rates 100mbit \
    --timed-steps 120,ddp=24,fp16=24 --methods "$MLP_METHODS" --reuse --port "$port" --timeout 2400 \
    --results-dir "$OUT" --name "mlp_${w}ranks" "$@" \
    -- --epochs 2 --batch-size 32 --train-subset $((7500 * w)) --eval-every 20
}
gpt() {
  local w=$1 port=$2; shift 2
  "$PY" bench/netbench.py --world-size "$w" --rates 1gbit,100mbit --timed-rates 100mbit \
    --timed-steps 120,ddp=48 --methods "$GPT_METHODS" --reuse --port "$port" --timeout 2400 \
    --results-dir "$OUT" --name "gpt_${w}ranks" "$@" -- --model gpt --steps 500 --eval-every 25
}

PARTS=${PARTS:-mlp gpt}
for part in $PARTS; do
  case $part in mlp|gpt) ;; *) echo "PARTS: unknown part '$part' (use mlp, gpt or both)" >&2; exit 2 ;; esac
done
want() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

if want mlp; then
  mlp 2 29610
  mlp 8 29630 --method-args ist='--lr 0.01'   # IST diverges (NaN) at 4 and 8 ranks with its default lr 0.05
  mlp 4 29620 --method-args ist='--lr 0.01'   # and at 4 ranks (NaN at step 21)
fi
if want gpt; then
  gpt 8 29650
  gpt 4 29640
fi
want mlp || exit 0   # the cost model is fitted on the MLP runs
"$PY" bench/costmodel.py --runs "$OUT/mlp_2ranks" "$OUT/mlp_4ranks" "$OUT/mlp_8ranks" --cores "$(nproc)" \
  --note "MLP 784-2048-2048-10 (5.8M params), batch 32/rank, 1 thread/rank on a $(nproc)-core machine; netbench $OUT/mlp_*ranks" \
  --out "$OUT/costmodel"
