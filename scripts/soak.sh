#!/usr/bin/env bash
# Soak the recipe across CP methods, configs and tp x cp layouts to catch rare crashes (e.g. the
# `malloc(): unaligned tcache chunk detected` seen once in 18 runs, issue 7), and optionally inject
# faults (a rank SIGKILLed mid-step, issue 27). Not run in CI.
#
#   bash scripts/soak.sh                                  # 30 runs of configs/cp.yaml (ring, cp=2)
#   bash scripts/soak.sh --runs 100 --methods ring,ulysses,thd_docs,usp --cp 4 --tp 2 --max-steps 3
#   bash scripts/soak.sh --runs 40 --configs configs/cp.yaml,configs/cp_packed.yaml --methods ring,thd_docs
#   bash scripts/soak.sh --max-seconds 1500 --methods ring,usp --fault-every 10 -- step_scheduler.max_steps=6
#
# Options (the environment variables of the older interface still work: RUNS, BURNERS, NICE,
# RUN_TIMEOUT, MAX_SECONDS, CONFIG, SOAK_DIR, NPROC):
#   --runs N            runs in all (default 30), cycling through the combinations below
#   --methods a,b       distributed.cp_method values (default: none given = the config's own method)
#   --configs a,b       recipe configs (default: each method's own config: ring configs/cp.yaml,
#                       ulysses configs/cp_ulysses.yaml, thd/thd_docs configs/cp_packed.yaml,
#                       usp configs/cp_usp.yaml; with --configs, every config runs every method)
#   --cp N              distributed.cp_size of the method runs (default: the config's; ranks = cp x tp)
#   --tp N              also run tp N x cp --tp-cp (default 2) with the --tp-methods (default ring)
#   --max-steps N       step_scheduler.max_steps (default 3: short runs)
#   --full-model        keep the config's model (default: a tiny one, 2 layers of width 64)
#   --fault-every K     every K-th run is a fault run instead: scripts/fault_kill.py SIGKILLs the last
#                       rank mid-step, checks the exit (<= 60 s, one line naming the rank, no traceback)
#                       and that checkpoint.resume=auto continues with the same losses
#   --max-seconds S     no run starts after S seconds (the one running finishes)
#   --burners N         busy-loop processes competing for the cores (default 1; 0 on a loaded machine)
#   -- OVERRIDES        Hydra overrides for every run (also accepted without the --)
#
# Every run is a fresh `torchrun --standalone --nproc-per-node <cp x tp> recipes/finetune.py --config
# <config>` with the combination's overrides, under PYTHONFAULTHANDLER=1 (Python stacks of every thread
# on a fatal signal) and glibc's malloc checks (GLIBC_TUNABLES=glibc.malloc.check=3 plus
# MALLOC_PERTURB_, which fills freed and fresh chunks with a byte pattern so that a use-after-free reads
# garbage instead of stale values). A run fails on a non-zero exit, a timeout (RUN_TIMEOUT seconds,
# default 1800) or a malloc/fault message in its log; the logs of failing runs are kept under
# $SOAK_DIR/failed/, the others deleted. Prints one line per run and a summary per combination (runs,
# failures, mean seconds) and in all; exits 1 if any run failed. Ctrl-C / SIGTERM stop the run in
# progress (not counted) and print the summary so far.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${RUNS:-30}"
burners="${BURNERS:-1}"
nice_level="${NICE:-0}"
run_timeout="${RUN_TIMEOUT:-1800}"
max_seconds="${MAX_SECONDS:-0}"
configs="${CONFIG:-}"
methods=""
cp=""
tp=1
tp_cp=2
tp_methods="ring"
max_steps=3
tiny=1
fault_every=0
overrides=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --methods) methods="$2"; shift 2 ;;
    --configs|--config) configs="$2"; shift 2 ;;
    --cp) cp="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --tp-cp) tp_cp="$2"; shift 2 ;;
    --tp-methods) tp_methods="$2"; shift 2 ;;
    --max-steps) max_steps="$2"; shift 2 ;;
    --full-model) tiny=0; shift ;;
    --fault-every) fault_every="$2"; shift 2 ;;
    --max-seconds) max_seconds="$2"; shift 2 ;;
    --burners) burners="$2"; shift 2 ;;
    --) shift; overrides+=("$@"); break ;;
    -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
    --*) echo "soak: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) overrides+=("$1"); shift ;;
  esac
done
soak_dir="${SOAK_DIR:-$(mktemp -d /tmp/automodel-soak.XXXXXX)}"
venv="${AUTOMODEL_VENV:-$root/.venv}"
python="$venv/bin/python"
[ -x "$python" ] || python="$(command -v python3)"
mkdir -p "$soak_dir/failed" "$soak_dir/runs"

tiny_args=()
if [ "$tiny" -eq 1 ]; then
  tiny_args=(model.config.hidden_size=64 model.config.intermediate_size=128 model.config.num_hidden_layers=2
             model.config.num_attention_heads=4 model.config.num_key_value_heads=2 model.dtype=float32
             fsdp.param_dtype=float32 step_scheduler.global_batch_size=8 step_scheduler.local_batch_size=2)
fi
short_args=(step_scheduler.max_steps="$max_steps" step_scheduler.val_every_steps=null
            step_scheduler.ckpt_every_steps=null lr_scheduler.warmup_steps=1 recipe.cp_self_check=false
            logging.progress_bar=false logging.plot=false export.enabled=false)

default_config() {  # the shipped config of a method
  case "$1" in
    ulysses) echo configs/cp_ulysses.yaml ;;
    thd|thd_docs) echo configs/cp_packed.yaml ;;
    usp) echo configs/cp_usp.yaml ;;
    *) echo configs/cp.yaml ;;
  esac
}

# the combinations: "label|config|ranks|overrides (space separated)"
combos=()
add_combo() {  # config method cp tp
  local config="$1" method="$2" c="$3" t="$4" label args ranks
  args=""
  [ -n "$method" ] && args="distributed.cp_method=$method"
  [ -n "$c" ] && args="$args distributed.cp_size=$c"
  [ "$method" = usp ] && [ -n "$c" ] && args="$args distributed.ulysses_size=2"
  args="$args distributed.tp_size=$t"
  ranks=$(( ${c:-2} * t ))
  label="${method:-default} $(basename "$config" .yaml) cp${c:-2}"
  [ "$t" -gt 1 ] && label="$label tp$t"
  combos+=("$label|$config|$ranks|$args")
}
IFS=',' read -r -a method_list <<<"${methods}"
IFS=',' read -r -a config_list <<<"${configs}"
IFS=',' read -r -a tp_method_list <<<"${tp_methods}"
[ "${#method_list[@]}" -eq 0 ] && method_list=("")
for m in "${method_list[@]}"; do
  if [ "${#config_list[@]}" -eq 0 ]; then
    add_combo "$(default_config "$m")" "$m" "$cp" 1
  else
    for c in "${config_list[@]}"; do add_combo "$c" "$m" "$cp" 1; done
  fi
done
if [ "$tp" -gt 1 ]; then
  for m in "${tp_method_list[@]}"; do
    if [ "${#config_list[@]}" -eq 0 ]; then
      add_combo "$(default_config "$m")" "$m" "$tp_cp" "$tp"
    else
      for c in "${config_list[@]}"; do add_combo "$c" "$m" "$tp_cp" "$tp"; done
    fi
  done
fi

export PYTHONFAULTHANDLER=1
export GLIBC_TUNABLES="glibc.malloc.check=3"
export MALLOC_PERTURB_="${MALLOC_PERTURB_:-165}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1
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

echo "soak: $runs runs over ${#combos[@]} combination(s), max_steps=$max_steps, fault every ${fault_every:-0};" \
  "overrides: ${overrides[*]:-none}; burners=$burners nice=$nice_level timeout=${run_timeout}s"
for c in "${combos[@]}"; do echo "soak:   ${c%%|*}: ${c#*|}"; done
echo "soak: logs in $soak_dir; load at start: $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A n_runs n_fail n_secs
fails=0
done_runs=0
faults=0
fault_fails=0
loads=()
start=$(date +%s)
for i in $(seq 1 "$runs"); do
  if [ "$max_seconds" -gt 0 ] && [ $(( $(date +%s) - start )) -ge "$max_seconds" ]; then
    echo "soak: max seconds $max_seconds reached, no more runs"
    break
  fi
  combo="${combos[$(( (i - 1) % ${#combos[@]} ))]}"
  IFS='|' read -r label config ranks args <<<"$combo"
  read -r -a combo_args <<<"$args"
  log="$soak_dir/runs/run_$i.log"
  kind=run
  t0=$(date +%s)
  if [ "$fault_every" -gt 0 ] && [ $(( i % fault_every )) -eq 0 ]; then
    kind=fault
    timeout --signal=TERM --kill-after=60 "$run_timeout" nice -n "$nice_level" \
      "$python" "$root/scripts/fault_kill.py" --config "$config" --nproc "$ranks" --kill-rank $(( ranks - 1 )) \
      --max-steps 8 --ckpt-every 4 --kill-after 5 --no-reference --json "$soak_dir/runs/fault_$i.json" -- \
      "${combo_args[@]}" recipe.cp_self_check=false "${overrides[@]}" >"$log" 2>&1 &
  else
    timeout --signal=TERM --kill-after=60 "$run_timeout" nice -n "$nice_level" \
      "$python" -m torch.distributed.run --standalone --nproc-per-node "$ranks" "$root/recipes/finetune.py" \
      --config "$root/$config" recipe.output_root="$soak_dir/outputs" "${tiny_args[@]}" "${short_args[@]}" \
      "${combo_args[@]}" "${overrides[@]}" >"$log" 2>&1 &
  fi
  run_pid=$!
  wait "$run_pid"
  rc=$?
  [ "$stop" -eq 1 ] && wait "$run_pid" 2>/dev/null
  run_pid=""
  if [ "$stop" -eq 1 ]; then
    echo "run $i/$runs ($label): interrupted (not counted)"
    rm -rf "$soak_dir/outputs"
    break
  fi
  secs=$(( $(date +%s) - t0 ))
  done_runs=$((done_runs + 1))
  load="$(cut -d' ' -f1-3 /proc/loadavg)"
  loads+=("$(cut -d' ' -f1 /proc/loadavg)")
  status=ok
  if [ "$rc" -ne 0 ]; then
    status="FAIL rc=$rc"
  elif [ "$kind" = run ] && grep -qiE 'malloc\(\)|free\(\)|tcache|corrupted|double free|Fatal Python error|Segmentation fault' "$log"; then
    status="FAIL (malloc/fault message, rc=0)"
  fi
  key="$label"
  if [ "$kind" = fault ]; then
    key="fault: $label"
    faults=$((faults + 1))
    status="$status; $(grep -m1 'SIGKILL of rank' "$log" | sed 's/^fault_kill: //')"
  fi
  n_runs[$key]=$(( ${n_runs[$key]:-0} + 1 ))
  n_secs[$key]=$(( ${n_secs[$key]:-0} + secs ))
  if [ "$rc" -eq 0 ] && [ "${status%%;*}" = ok ]; then
    rm -f "$log"
  else
    fails=$((fails + 1))
    [ "$kind" = fault ] && fault_fails=$((fault_fails + 1))
    n_fail[$key]=$(( ${n_fail[$key]:-0} + 1 ))
    mv "$log" "$soak_dir/failed/"
  fi
  rm -rf "$soak_dir/outputs"
  echo "run $i/$runs ($key): $status, ${secs}s, load $load"
done
mean_load=$(printf '%s\n' "${loads[@]}" | awk '{s+=$1} END {if (NR) printf "%.2f", s/NR; else print "n/a"}')
max_load=$(printf '%s\n' "${loads[@]}" | sort -g | tail -1)
echo "soak summary per combination:"
for key in "${!n_runs[@]}"; do
  printf '  %-40s %3d runs, %d failed, mean %ds\n' "$key" "${n_runs[$key]}" "${n_fail[$key]:-0}" \
    $(( ${n_secs[$key]} / ${n_runs[$key]} ))
done | sort
echo "soak summary: $done_runs runs ($faults fault runs), $fails failed ($fault_fails fault runs)," \
  "$(( $(date +%s) - start ))s, 1-min load mean $mean_load max $max_load (at run ends), burners=$burners"
[ "$fails" -eq 0 ] && echo "soak: no failures" || echo "soak: failing logs in $soak_dir/failed/"
[ "$fails" -eq 0 ]
