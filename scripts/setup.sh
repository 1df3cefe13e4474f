#!/usr/bin/env bash
# Set up a working environment for automodel in ./.venv (created if missing).
#
# - Installs torch==2.13.0 only when no torch is importable: on our CPU machines that resolves to a
#   local CPU build, and an unpinned `torch` would pull gigabytes of CUDA wheels. A torch that is
#   already installed (e.g. a CUDA build on a GPU host, such as 2.11.0+cu130) is left alone; one outside
#   the tested range (torch>=2.11,<2.16, pyproject.toml) is an error rather than replaced. Other tested releases:
#   scripts/compat.sh.
# - Installs the package in editable mode with the `dev` extra (pytest, ruff) and the tracker extras
#   (`tensorboard`, `wandb`: logging.tensorboard / logging.wandb, which the tests exercise).
# - Idempotent and fast on a second run: a stamp records the hash of pyproject.toml.
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
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
cmd_ok=1  # the `automodel` console command (scripts/run.sh uses it) is installed with the package
[ "$venv" != "none" ] && [ ! -x "$venv/bin/automodel" ] && cmd_ok=0
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ "$cmd_ok" = 1 ] && "$py" -c "import torch, transformers, automodel" 2>/dev/null; then
  echo "[setup] environment up to date ($py)"
  exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "[setup] no torch found: installing torch==2.13.0"
  "$py" -m pip install --quiet "torch==2.13.0"
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
fi
echo "[setup] installing automodel (editable, with the dev, tensorboard and wandb extras)"
"$py" -m pip install --quiet -e "$root[dev,tensorboard,wandb]"
echo "$want" > "$stamp"
echo "[setup] done: $("$py" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
