#!/usr/bin/env bash
# Where the machine's CPU goes in the steady state of an 8-rank run of the training command
# (issue 31): samples every CPU with `perf record -a` for SECONDS seconds, starting WARM
# seconds after launch (past start-up: imports, data loading, the first steps), and counts
# the system's epoll_wait calls over the same window (gloo's event-loop threads).
#
#   bench/hook_breakdown/cpu_profile.sh OUT_DIR [training command flags...]
#   e.g. bench/hook_breakdown/cpu_profile.sh /tmp/cpu_normal --method slimdp --comm-thread-priority normal
#
# Writes OUT_DIR/dso.txt (share of samples per binary), OUT_DIR/symbols.txt (top 40
# symbols) and OUT_DIR/epoll.txt (perf stat of the epoll_wait system call), and prints the
# training command's ms/step. Needs perf and root (system-wide sampling); run it on an
# otherwise idle machine.
set -euo pipefail
out=${1:?usage: cpu_profile.sh OUT_DIR [training flags...]}
shift
WARM=${WARM:-25}
SECONDS_=${SECONDS_:-12}
PY=${PY:-.venv/bin/python}
mkdir -p "$out"
"$PY" -m slimcomm.train --world-size 8 --steps 300 --batch-size 32 --train-subset 60000 \
    --eval-every 1000 --no-progress --quiet --out "$out/run.json" "$@" > "$out/train.log" 2>&1 &
pid=$!
sleep "$WARM"
perf record -a -F 499 -o "$out/perf.data" -- sleep "$SECONDS_" 2> /dev/null
perf stat -a -e syscalls:sys_enter_epoll_wait -o "$out/epoll.txt" -- sleep "$SECONDS_"
wait "$pid"
perf report -i "$out/perf.data" --sort dso --stdio 2> /dev/null | grep -v '^#' | grep -v '^$' | head -12 \
    > "$out/dso.txt"
perf report -i "$out/perf.data" --sort dso,sym --stdio 2> /dev/null | grep -v '^#' | grep -v '^$' \
    | cut -c1-160 | head -40 > "$out/symbols.txt"
"$PY" - "$out/run.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"{d['final']['train_time_s'] / d['steps'] * 1000:.1f} ms/step over {d['steps']} steps, "
      f"gloo loop threads {d['config']['comm_thread_priority']}")
EOF
