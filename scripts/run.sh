#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run the default CP fine-tune with the `automodel`
# console command (installed by setup): configs/cp.yaml, a tiny
# Llama on the shipped offline dataset, context parallel over 2 ranks (CPU/gloo when no GPU).
# Extra arguments are Hydra overrides, e.g. `bash scripts/run.sh step_scheduler.max_steps=20`.
# NPROC (default 2) sets the number of processes.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTOMODEL_VENV:-$root/.venv}"
automodel="$venv/bin/automodel"; [ "$venv" = "none" ] && automodel="$(command -v automodel)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$automodel" finetune --nproc-per-node "${NPROC:-2}" --config "$root/configs/cp.yaml" "$@"
