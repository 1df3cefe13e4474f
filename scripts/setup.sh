#!/usr/bin/env bash
# Set up a working environment for automodel in ./.venv (created if missing), at the pinned versions.
#
# - Installs exactly the versions in constraints.txt (pip -c): torch, transformers, peft, datasets, Hydra
#   and everything they pull, as CI last passed with them, so that a clean clone installs today what
#   passed yesterday, whatever was released since. Users who `pip install` the package themselves get
#   pyproject.toml's ranges. AUTOMODEL_PINS=none installs from the ranges here too (the newest releases
#   they allow); AUTOMODEL_PINS=/path/file uses another pin file. Moving the pins: scripts/update_pins.sh.
# - Installs torch (the pinned release: on our CPU machines a local CPU build) only when no torch is
#   importable. A torch that is already installed (e.g. a CUDA build on a GPU host, such as 2.11.0+cu130)
#   is left alone, and its pin is dropped for this install; one outside the tested range
#   (torch>=2.11,<2.16, pyproject.toml) is an error rather than replaced. Other tested releases:
#   scripts/compat.sh.
# - Installs the package in editable mode with the `dev` extra (pytest, ruff) and the tracker extras
#   (`tensorboard`, `wandb`: logging.tensorboard / logging.wandb, which the tests exercise).
# - Idempotent and fast on a second run: a stamp records the hash of pyproject.toml and the pins.
#
# Use AUTOMODEL_VENV=/path to choose another venv, or AUTOMODEL_VENV=none to install into the
# current interpreter (e.g. a GPU container that ships its own torch).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${AUTOMODEL_VENV:-$root/.venv}"

if [ "$venv" = "none" ]; then
  py="$(command -v python3 || command -v python)"
else
  if [ ! -x "$venv/bin/python" ]; then
    if python3 -c "import torch" 2>/dev/null; then
      # A GPU host's torch (often a CUDA build in the system or container Python): let the venv see it.
      echo "[setup] creating virtual environment at $venv (sharing the system's torch)"
      python3 -m venv --system-site-packages "$venv"
    else
      echo "[setup] creating virtual environment at $venv"
      python3 -m venv "$venv"
    fi
  fi
  py="$venv/bin/python"
fi

stamp="$venv/.automodel-setup-stamp"
[ "$venv" = "none" ] && stamp="$root/.setup-stamp"
pins="${AUTOMODEL_PINS:-$root/constraints.txt}"
if [ "$pins" != "none" ] && [ ! -f "$pins" ]; then
  echo "[setup] error: pin file $pins does not exist (AUTOMODEL_PINS=none installs from pyproject.toml's ranges)" >&2
  exit 2
fi
want="$(cat "$root/pyproject.toml" "$([ "$pins" = none ] && echo /dev/null || echo "$pins")" | sha256sum | cut -d' ' -f1) $pins"
cmd_ok=1  # the `automodel` console command (scripts/run.sh uses it) is installed with the package
[ "$venv" != "none" ] && [ ! -x "$venv/bin/automodel" ] && cmd_ok=0
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$cmd_ok" = 1 ] && "$py" -c "import torch, transformers, automodel" 2>/dev/null; then
  echo "[setup] environment up to date ($py)"
  exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
pinned_torch=2.13.0
[ "$pins" != "none" ] && pinned_torch="$(sed -n 's/^torch==\([^ #]*\).*/\1/p' "$pins")"
pin_args=()
kept_torch=0
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "[setup] no torch found: installing torch==${pinned_torch:-2.13.0}"
  "$py" -m pip install --quiet "torch==${pinned_torch:-2.13.0}"
else
  have="$("$py" -c 'import torch; print(torch.__version__)')"
  # pyproject.toml allows torch>=2.11,<2.16 (the tested releases); outside it, pip would replace the
  # installed build (e.g. a GPU host's CUDA torch) with another: stop and say so instead.
  if ! "$py" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(not (2, 11) <= v < (2, 16))'; then
    echo "[setup] error: torch $have is installed, outside automodel's tested range torch>=2.11,<2.16" >&2
    echo "[setup] (2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0); pip would replace it. Install one of those, or try this" >&2
    echo "[setup] one anyway with: $py -m pip install --no-deps -e '$root[dev]'" >&2
    exit 1
  fi
  echo "[setup] keeping installed torch $have"
  [ "${have%%+*}" != "$pinned_torch" ] && kept_torch=1
fi
if [ "$pins" != "none" ]; then
  use="$pins"
  if [ "$kept_torch" = 1 ]; then
    # The host's torch stays: drop the pins of torch and of what only a torch build brings (triton, nvidia-*).
    use="$(mktemp)"; trap 'rm -f "$use"' EXIT
    grep -v -E '^(torch|triton|nvidia-[a-z0-9-]+)==' "$pins" > "$use"
    echo "[setup] the pins say torch==$pinned_torch; keeping the installed torch instead"
  fi
  pin_args=(-c "$use")
  echo "[setup] installing automodel (editable, with the dev, tensorboard and wandb extras) at the versions pinned in $pins"
else
  echo "[setup] installing automodel (editable, with the dev, tensorboard and wandb extras) from pyproject.toml's ranges (AUTOMODEL_PINS=none)"
fi
"$py" -m pip install --quiet "${pin_args[@]}" -e "$root[dev,tensorboard,wandb]"
if [ "$pins" != "none" ]; then
  except=(); [ "$kept_torch" = 1 ] && except=(--except torch)
  "$py" "$root/scripts/pins.py" check "$pins" "${except[@]}" | sed 's/^/[setup] /'
fi
echo "$want" > "$stamp"
echo "[setup] done: $("$py" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
