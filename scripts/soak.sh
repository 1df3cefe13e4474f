#!/usr/bin/env bash
# Soak the default recipe (configs/cp.yaml: ring CP over 2 CPU ranks, gloo) to catch rare crashes,
# e.g. the `malloc(): unaligned tcache chunk detected` seen once in 18 runs (issue 7). Not run in CI.
#
#   bash scripts/soak.sh                       # 30 runs of the default recipe, one CPU burner
#   RUNS=50 BURNERS=0 bash scripts/soak.sh step_scheduler.max_steps=60
#   NICE=19 MAX_SECONDS=3600 SOAK_DIR=/tmp/soak bash scripts/soak.sh   # no new run after an hour
#
# Every run is a fresh `torchrun --standalone --nproc-per-node ${NPROC:-2} recipes/finetune.py
# --config ${CONFIG:-configs/cp.yaml}` with the extra arguments as Hydra overrides, under
# PYTHONFAULTHANDLER=1 (Python stacks of every thread on a fatal signal) and glibc's malloc checks
# (GLIBC_TUNABLES=glibc.malloc.check=3 plus MALLOC_PERTURB_, which fills freed and fresh chunks with a
# byte pattern so that a use-after-free reads garbage instead of stale values). BURNERS busy-loop
# processes (default 1; 0 on an already loaded machine) compete for the cores to shake out timing
# races. A run fails on a non-zero exit, a timeout (RUN_TIMEOUT seconds, default 1800) or a
# malloc/fault message in its log; the logs of failing runs are kept under $SOAK_DIR/failed/, the
# others deleted. MAX_SECONDS bounds the soak: no run starts after it (the one running finishes).
# Prints one line per run and a summary (runs, failures, load averages); exits 1 if any run failed.
# Ctrl-C / SIGTERM stop the run in progress (not counted) and print the summary so far.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${RUNS:-30}"
burners="${BURNERS:-1}"
nice_level="${NICE:-0}"
run_timeout="${RUN_TIMEOUT:-1800}"
max_seconds="${MAX_SECONDS:-0}"
config="${CONFIG:-$root/configs/cp.yaml}"
soak_dir="${SOAK_DIR:-$(mktemp -d /tmp/automodel-soak.XXXXXX)}"
venv="${AUTOMODEL_VENV:-$root/.venv}"
torchrun="$venv/bin/torchrun"
[ -x "$torchrun" ] || torchrun="$(command -v torchrun)"
mkdir -p "$soak_dir/failed" "$soak_dir/runs"

export PYTHONFAULTHANDLER=1
export GLIBC_TUNABLES="glibc.malloc.check=3"
export MALLOC_PERTURB_="${MALLOC_PERTURB_:-165}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

burner_pids=()
run_pid=""
stop=0
cleanup() {
  for pid in "${burner_pids[@]}"; do kill "$pid" 2>/dev/null; done
}
interrupt() {
  stop=1
  [ -n "$run_pid" ] && kill -TERM "$run_pid" 2>/dev/null
}
trap cleanup EXIT
trap interrupt INT TERM
for _ in $(seq 1 "$burners"); do
  nice -n 19 bash -c 'while :; do :; done' &
  burner_pids+=("$!")
done

echo "soak: $runs runs of $config $*; burners=$burners nice=$nice_level timeout=${run_timeout}s"
echo "soak: logs in $soak_dir; load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
fails=0
done_runs=0
loads=()
start=$(date +%s)
for i in $(seq 1 "$runs"); do
  if [ "$max_seconds" -gt 0 ] && [ $(( $(date +%s) - start )) -ge "$max_seconds" ]; then
    echo "soak: MAX_SECONDS=$max_seconds reached, no more runs"
    break
  fi
  log="$soak_dir/runs/run_$i.log"
  t0=$(date +%s)
  timeout --signal=TERM --kill-after=60 "$run_timeout" nice -n "$nice_level" \
    "$torchrun" --standalone --nproc-per-node "${NPROC:-2}" "$root/recipes/finetune.py" \
    --config "$config" recipe.output_root="$soak_dir/outputs" logging.progress_bar=false \
    logging.plot=false export.enabled=false "$@" >"$log" 2>&1 &
  run_pid=$!
  wait "$run_pid"
  rc=$?
  [ "$stop" -eq 1 ] && wait "$run_pid" 2>/dev/null
  run_pid=""
  if [ "$stop" -eq 1 ]; then
    echo "run $i/$runs: interrupted (not counted)"
    rm -rf "$soak_dir/outputs"
    break
  fi
  done_runs=$((done_runs + 1))
  load="$(cut -d' ' -f1-3 /proc/loadavg)"
  loads+=("$(cut -d' ' -f1 /proc/loadavg)")
  status=ok
  if [ "$rc" -ne 0 ]; then
    status="FAIL rc=$rc"
  elif grep -qiE 'malloc\(\)|free\(\)|tcache|corrupted|double free|Fatal Python error|Segmentation fault' "$log"; then
    status="FAIL (malloc/fault message, rc=0)"
  fi
  if [ "$status" = ok ]; then
    rm -f "$log"
  else
    fails=$((fails + 1))
    mv "$log" "$soak_dir/failed/"
  fi
  rm -rf "$soak_dir/outputs"
  echo "run $i/$runs: $status, $(( $(date +%s) - t0 ))s, load $load"
done
mean_load=$(printf '%s\n' "${loads[@]}" | awk '{s+=$1} END {if (NR) printf "%.2f", s/NR; else print "n/a"}')
max_load=$(printf '%s\n' "${loads[@]}" | sort -g | tail -1)
echo "soak summary: $done_runs runs, $fails failed, $(( $(date +%s) - start ))s," \
  "1-min load mean $mean_load max $max_load (at run ends), burners=$burners"
[ "$fails" -eq 0 ] && echo "soak: no failures" || echo "soak: failing logs in $soak_dir/failed/"
[ "$fails" -eq 0 ]
