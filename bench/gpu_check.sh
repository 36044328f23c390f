#!/usr/bin/env bash
# One-call check of the whole product on one GPU (issues 5 and 12).
#
#   bench/gpu_check.sh OUTDIR [--device cuda|cpu]      (or GPU_CHECK_OUT=OUTDIR)
#
# Stages, each with its own time limit (`timeout`), each run whatever happened
# to the ones before, full output in OUTDIR/<stage>.log:
#   env         GPU name, driver, python/torch/CUDA versions, nvcc (OUTDIR/env.log)
#   build       the extension in place with the machine's own python3 and torch
#   info        python -m slimcomm.info (the build's CUDA flag)
#   test_cuda   CPU == CUDA on every op (tests/test_ops_cuda.py, the fused step and codec ops:
#               tests/test_ops_step_cuda.py, tests/test_ops_codec_cuda.py; every failure listed),
#               also with the device-side fallbacks forced (tests/test_cuda_fallbacks.py)
#   host_sync   tests/test_host_sync.py: hook (shared, local), SlimDPOptimizer and
#               ISTTrainer.synchronize under torch.cuda.set_sync_debug_mode("error")
#               (NCCL, world size 1)
#   host_2proc  the hook / IST on CUDA tensors over gloo with 2 processes on the one GPU
#   dev_traps   a bad index under device-side checks stops the stream (one process each)
#   hook_gloo2  bench/hook_overhead.py: 2 ranks on the one GPU over gloo
#   hook_nccl1  bench/hook_overhead.py: NCCL at world size 1
#               (both: step times, hook ms/step from CUDA events, ops, host syncs)
#   train_mlp   python -m slimcomm.train --device cuda (Slim-DP, MLP), 300 steps
#   train_gpt   the same with --model gpt, 200 steps
#   train_ist   the same with --method ist (MLP), 300 steps
#   bench_1e8   bench/kernels.py, N=1e8 fp32 k=1% (ours, the torch.topk path, a
#               device copy of the same bytes; CUB DeviceTopK when the toolkit has it)
#   test_ops    the other op tests (-x -q)
#   bench_grid  bench/kernels.py over sizes and densities, fp32 then bf16
# and OUTDIR/summary.txt: one line per stage (rc, seconds, last pytest line).
#
# --device cpu (a dry run on a machine without a GPU) skips the build and the
# CUDA-only tests and runs every Python piece on CPU (gloo), so the GPU run only
# meets CUDA-specific problems. Data: Fashion-MNIST if installed, else
# scikit-learn's digits, else a small synthetic IDX set written to OUTDIR/data;
# text: this README.
#
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0),
# MAX_JOBS (default 16), GPU_CHECK_BUDGET_S (default 465 on cuda, 1500 on cpu:
# total seconds, the build included; stages that find less than 15 s left are
# skipped), GPU_CHECK_STAGES (a comma list of stage names: run only those, e.g.
# to re-check what failed; the build always runs on cuda).
# Exit status: 0 when the build (cuda) and every test stage passed, 1 otherwise.
set -uo pipefail

OUT=${GPU_CHECK_OUT:-}
DEVICE=cuda
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=${2:?--device needs cuda or cpu}; shift 2 ;;
    --device=*) DEVICE=${1#--device=}; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT=$1; shift ;;
  esac
done
[ -n "$OUT" ] || { echo "usage: bench/gpu_check.sh OUTDIR [--device cuda|cpu]" >&2; exit 2; }
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device must be cuda or cpu" >&2; exit 2 ;; esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-16}
export NVCC_THREADS=${NVCC_THREADS:-2}
export SLIMCOMM_FORCE_CUDA=1
# torch finds the toolkit itself (CUDA_HOME, else nvcc on PATH, else /usr/local/cuda).
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
# A CPU dry run is slower and smaller: stage limits x4, fewer steps, a longer budget.
if [ "$DEVICE" = cpu ]; then SCALE=4; DEF_BUDGET=1500; else SCALE=1; DEF_BUDGET=465; fi
BUDGET=${GPU_CHECK_BUDGET_S:-$DEF_BUDGET}
ONLY=${GPU_CHECK_STAGES:-}
export PYTHONUNBUFFERED=1  # stage logs keep what ran before a timeout
T0=$(date +%s)

names=() ; codes=() ; secs=() ; notes=()

# stage NAME LIMIT_S CMD...: runs CMD with a time limit of min(LIMIT_S, what is
# left of the budget), output to the terminal and OUTDIR/NAME.log.
stage() {
  local name=$1 limit=$(( $2 * SCALE ))
  shift 2
  if [ -n "$ONLY" ] && [ "$name" != build ] && [[ ",$ONLY," != *",$name,"* ]]; then
    names+=("$name"); codes+=("skipped"); secs+=(0); notes+=("not in GPU_CHECK_STAGES")
    return 0
  fi
  local left=$(( BUDGET - ($(date +%s) - T0) ))
  if [ "$left" -lt 15 ]; then
    names+=("$name"); codes+=("skipped"); secs+=(0); notes+=("no time left in the budget")
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== [$name] (limit ${limit} s): $*" | tee "$OUT/$name.log"
  local s=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local d=$(( $(date +%s) - s ))
  local note
  # pytest's summary line, else the stage's last line
  note=$(grep -E "[0-9]+ (passed|failed|errors?|skipped)|no tests ran" "$OUT/$name.log" | tail -1 | cut -c1-90)
  [ -n "$note" ] || note=$(grep -v "^\s*$" "$OUT/$name.log" | tail -1 | cut -c1-90)
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && note="TIMED OUT after ${limit} s; $note"
  names+=("$name"); codes+=("$rc"); secs+=("$d"); notes+=("$note")
  return 0
}

skip() {  # skip NAME WHY
  names+=("$1"); codes+=("skipped"); secs+=(0); notes+=("$2")
}

summary() {
  echo
  echo "=== gpu_check summary (--device $DEVICE, $(date -u +%FT%TZ), total $(( $(date +%s) - T0 )) s, logs in $OUT)"
  head -4 "$OUT/env.log" | sed 's/^/  /'
  printf "%-12s %-8s %-4s %6s  %s\n" stage result rc seconds detail
  for i in "${!names[@]}"; do
    local res=FAIL
    [ "${codes[$i]}" = "0" ] && res=pass
    [ "${codes[$i]}" = "skipped" ] && res=skip
    printf "%-12s %-8s %-4s %6s  %s\n" "${names[$i]}" "$res" "${codes[$i]}" "${secs[$i]}" "${notes[$i]}"
  done
  for f in "$OUT"/bench-*/*-kernels-*.md; do
    [ -f "$f" ] || continue
    echo
    echo "--- $(basename "$(dirname "$f")"): significance_topk / pack / slices rows"
    grep -E "^\|" "$f" | head -2
    grep -E "^\| *(significance_topk|explore_sample|pack|unpack|gather_slices|scatter_slices)" "$f" || true
  done
  for f in "$OUT"/hook_*/hook_overhead.md; do
    [ -f "$f" ] || continue
    echo
    echo "--- $(basename "$(dirname "$f")")"
    grep -E "^\| *(method|dense|powersgd|slim_)" "$f" || true
  done
}

{
  echo "host: $(hostname)  nproc: $(nproc)  device: $DEVICE"
  if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1; else echo "no nvidia-smi"; fi
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| torch CUDA', torch.version.cuda, '| available', torch.cuda.is_available(), '|', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
  nvcc --version 2>/dev/null | tail -2 || echo "no nvcc"
} 2>&1 | tee "$OUT/env.log"

if [ "$DEVICE" = cuda ]; then
  # Only on a machine with a GPU: the in-place build replaces slimcomm/_C*.so,
  # which on a developer machine is the CPU build everyone else is using.
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no usable CUDA device for $PY; nothing built (use --device cpu for a dry run)" >&2
    exit 2
  fi
  stage build 240 "$PY" setup.py build_ext --inplace
  built=0
  [ "${codes[0]}" = "0" ] && "$PY" -c "import json, torch, slimcomm.ops; assert json.loads(torch.ops.slimcomm._build_info())['cuda']" && built=1
  [ "$built" = 1 ] || notes[0]="build failed or has no CUDA: see $OUT/build.log"
else
  skip build "--device cpu: the existing build is used"
  built=1
fi

# Data for the training runs, whatever the machine has.
TRAIN_DATA=()
if "$PY" -c "import os, sys, slimcomm.train.workloads.data as d; sys.exit(0 if os.path.exists(os.path.join(d.FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')) or os.path.exists(os.path.join(d.FASHION_MNIST_DIR, 'train-images-idx3-ubyte')) else 1)" 2>/dev/null; then
  TRAIN_DATA=(--dataset fashion-mnist --train-subset 20000 --test-subset 2000)
elif "$PY" -c "import sklearn.datasets" 2>/dev/null; then
  TRAIN_DATA=(--dataset digits)
else
  "$PY" - "$OUT/data" <<'EOF'
import gzip, os, struct, sys
import torch
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
g = torch.Generator().manual_seed(0)
for split, n in (("train", 6000), ("t10k", 1000)):
    y = torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8)
    proto = torch.rand(10, 784, generator=g)
    x = ((proto[y.long()] + 0.3 * torch.rand(n, 784, generator=g)).clamp(0, 1) * 255).to(torch.uint8)
    with gzip.open(os.path.join(d, f"{split}-images-idx3-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">IIII", 0x803, n, 28, 28) + x.numpy().tobytes())
    with gzip.open(os.path.join(d, f"{split}-labels-idx1-ubyte.gz"), "wb") as f:
        f.write(struct.pack(">II", 0x801, n) + y.numpy().tobytes())
print("synthetic Fashion-MNIST-shaped IDX data in", d)
EOF
  TRAIN_DATA=(--dataset fashion-mnist --data-dir "$OUT/data")
fi
echo "training data: ${TRAIN_DATA[*]}" | tee -a "$OUT/env.log"

XD=()
if [ "$built" = 1 ]; then
  stage info 30 "$PY" -m slimcomm.info
  if [ "$DEVICE" = cuda ]; then
    # CPU == CUDA on every op, every failure listed (not -x: this is the verification).
    # With pytest-xdist (on the GPU image) 8 workers: faster, and a test that crashes
    # its process is reported as failed instead of ending the stage (run 1, 2026-12-04).
    XD=(); "$PY" -c "import xdist" 2>/dev/null && XD=(-n 8)
    stage test_cuda 150 "$PY" -m pytest -q -p no:cacheprovider -rfE --maxfail=30 "${XD[@]}" tests/test_ops_cuda.py \
      tests/test_ops_step_cuda.py tests/test_ops_codec_cuda.py tests/test_cuda_fallbacks.py
  else
    skip test_cuda "--device cpu"
  fi
  # Host syncs of the hot paths (skipped parts without a GPU run their CPU variants).
  # Three stages, so that one hang or crash does not hide the others' results.
  stage host_sync 60 "$PY" -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/test_host_sync.py \
    -k "not two_processes and not stop_the_stream"
  if [ "$DEVICE" = cuda ]; then
    stage host_2proc 60 "$PY" -m pytest -q -p no:cacheprovider -rfEs --tb=long -x tests/test_host_sync.py \
      -k two_processes
    stage dev_traps 90 "$PY" -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/test_host_sync.py \
      -k stop_the_stream
  fi
  HO=(bench/hook_overhead.py --device "$DEVICE" --timeout $(( 120 * SCALE )))
  if [ "$DEVICE" = cpu ]; then HO+=(--sizes 784,256,10 --steps 6 --warmup 3); else HO+=(--steps 20 --warmup 4); fi
  stage hook_gloo2 60 "$PY" "${HO[@]}" --world-size 2 --backend gloo --out "$OUT/hook_gloo2/hook_overhead.md"
  if [ "$DEVICE" = cuda ]; then
    stage hook_nccl1 45 "$PY" "${HO[@]}" --world-size 1 --backend nccl --out "$OUT/hook_nccl1/hook_overhead.md"
  else
    stage hook_gloo1 45 "$PY" "${HO[@]}" --world-size 1 --backend gloo --out "$OUT/hook_gloo1/hook_overhead.md"
  fi
  # NCCL needs one GPU per rank: world size 1 on the one GPU (gloo on CPU: 2 ranks).
  WS=1; [ "$DEVICE" = cpu ] && WS=2
  TR=("$PY" -m slimcomm.train --device "$DEVICE" --world-size "$WS" --timeout $(( 100 * SCALE )))
  S_MLP=300; S_GPT=200; [ "$DEVICE" = cpu ] && { S_MLP=40; S_GPT=20; }
  stage train_mlp 60 "${TR[@]}" --method slimdp --model mlp "${TRAIN_DATA[@]}" --hidden 256,256 \
    --steps $S_MLP --eval-every $(( S_MLP / 2 )) --out "$OUT/train_mlp.json"
  stage train_gpt 75 "${TR[@]}" --method slimdp --model gpt --text-file README.md --steps $S_GPT \
    --n-layer 2 --n-embd 64 --n-head 2 --block-size 64 --out "$OUT/train_gpt.json"
  stage train_ist 45 "${TR[@]}" --method ist --model mlp "${TRAIN_DATA[@]}" --hidden 256,256 \
    --steps $S_MLP --eval-every $(( S_MLP / 2 )) --out "$OUT/train_ist.json"
  if [ "$DEVICE" = cuda ]; then
    # The issue's acceptance case first (N=1e8 fp32, k=1%), then the wider grid.
    stage bench_1e8 45 "$PY" bench/kernels.py --device cuda --sizes 1e8 --densities 0.01 \
      --repeats 9 --out "$OUT/bench-1e8-fp32"
  else
    stage bench_1e6 15 "$PY" bench/kernels.py --device cpu --sizes 1e6 --densities 0.01 \
      --ops significance_topk,pack --repeats 3 --no-peak --tied "" --out "$OUT/bench-1e6-cpu"
  fi
  stage test_ops 60 "$PY" -m pytest -q -p no:cacheprovider --maxfail=10 "${XD[@]}" --continue-on-collection-errors $(ls tests/test_ops*.py | grep -v '_cuda\.py$')
  if [ "$DEVICE" = cuda ]; then
    stage bench_grid 60 "$PY" bench/kernels.py --device cuda --sizes 1e6,1e7,1e8 \
      --densities 0.001,0.1 --repeats 7 --out "$OUT/bench-grid-fp32"
    stage bench_bf16 30 "$PY" bench/kernels.py --device cuda --dtype bfloat16 --sizes 1e7,1e8 \
      --densities 0.01 --repeats 7 --out "$OUT/bench-grid-bf16"
  fi
else
  for st in info test_cuda host_sync host_2proc dev_traps hook_gloo2 hook_nccl1 train_mlp train_gpt train_ist bench_1e8 \
            test_ops bench_grid bench_bf16; do
    skip "$st" "needs the CUDA build (see build.log)"
  done
fi

summary | tee "$OUT/summary.txt"
ok=1
for i in "${!names[@]}"; do
  case "${names[$i]}" in
    build) [ "$DEVICE" = cpu ] || [ "${codes[$i]}" = "0" ] || ok=0 ;;
    test_cuda) [ "$DEVICE" = cpu ] || [ "${codes[$i]}" = "0" ] || ok=0 ;;
    skipped) ;;
    *) [ "${codes[$i]}" = "0" ] || [ "${codes[$i]}" = "skipped" ] || ok=0 ;;
  esac
done
[ "$ok" = 1 ]
