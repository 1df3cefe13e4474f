#!/usr/bin/env bash
# Move the pins: install the newest releases pyproject.toml allows in a separate environment, run the
# suite there, and report what moved (not part of CI).
#
#   bash scripts/update_pins.sh                # newest releases; the whole suite; report only
#   bash scripts/update_pins.sh --write        # ... and, when the suite passes, write constraints.txt
#   bash scripts/update_pins.sh -- -x -k thd   # arguments after `--` go to pytest (a subset: a rehearsal;
#                                              # --write needs the whole suite and refuses a subset)
#
# - Creates a fresh virtual environment (~/.cache/automodel-pins/venv, or $AUTOMODEL_PINS_CACHE/venv) each
#   time, so that nothing of an earlier resolution stays, and installs this checkout (editable; the dev,
#   tensorboard and wandb extras) from pyproject.toml's ranges alone, with no pin file: pip resolves the
#   newest release of everything. torch stays at its pin (UPDATE_PINS_TORCH=VERSION moves it too; other
#   torch releases come from PyPI as CUDA builds of several GB: see scripts/compat.sh for those).
# - Writes the candidate pin file (~/.cache/automodel-pins/constraints.txt) and prints what moved against
#   constraints.txt, then runs lint and the suite there (AUTOMODEL_REQUIRE_EXTRAS=1, as scripts/test.sh), then
#   regenerates the family x method table there into ~/.cache/automodel-pins/support_matrix.md and says whether
#   it differs from docs/support_matrix.md.
# - With --write and a passing suite, copies the candidate over constraints.txt. Then commit the pins on
#   their own, with the table (cp ~/.cache/automodel-pins/support_matrix.md docs/) and docs/compat.md's
#   tested range updated.
#
# The machine-wide pip constraint (a cap on torch) is replaced for these installs by a file pinning torch
# alone, as scripts/compat.sh does.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${AUTOMODEL_PINS_CACHE:-$HOME/.cache/automodel-pins}"
write=0
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --write) write=1; shift ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (usage: bash scripts/update_pins.sh [--write] [-- PYTEST_ARGS...])" >&2; exit 2 ;;
  esac
done
if [ "$write" = 1 ] && [ ${#pytest_args[@]} -gt 0 ]; then
  echo "error: --write moves the pins only after the whole suite passed; drop the pytest arguments (${pytest_args[*]})" >&2
  exit 2
fi
torch_pin="${UPDATE_PINS_TORCH:-$(sed -n 's/^torch==\([^ #]*\).*/\1/p' "$root/constraints.txt")}"
venv="$cache/venv"
py="$venv/bin/python"
mkdir -p "$cache"
echo "torch==$torch_pin" > "$cache/torch.constraint"
export PIP_CONSTRAINT="$cache/torch.constraint" PIP_DISABLE_PIP_VERSION_CHECK=1

echo "[pins] fresh environment $venv (torch==$torch_pin, everything else the newest pyproject.toml allows)"
rm -rf "$venv"
python3 -m venv "$venv"
"$py" -m pip install --quiet "torch==$torch_pin"
"$py" -m pip install --quiet -e "$root[dev,tensorboard,wandb]"
"$py" "$root/scripts/pins.py" write "$cache/constraints.txt" | sed 's/^/[pins] /'
echo "[pins] what moved against constraints.txt:"
"$py" "$root/scripts/pins.py" diff "$root/constraints.txt" "$cache/constraints.txt"

cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
source "$root/scripts/hash_seed.sh"  # PYTHONHASHSEED: drawn unless given, exported, printed
start=$SECONDS
set +e
"$py" -m ruff check automodel recipes scripts tests examples && \
  AUTOMODEL_REQUIRE_EXTRAS=1 AUTOMODEL_PINS_FILE="$cache/constraints.txt" "$py" -m pytest "${pytest_args[@]}"
rc=$?
echo "[pins] regenerating the support table in that environment"
"$py" scripts/support_table.py --out "$cache/support_matrix.md" > "$cache/support_table.log" 2>&1
table_rc=$?
set -e
if [ "$table_rc" -ne 0 ]; then
  echo "[pins] support_table.py failed (exit $table_rc): $cache/support_table.log"
elif cmp -s "$cache/support_matrix.md" docs/support_matrix.md; then
  echo "[pins] the support table is unchanged"
else
  echo "[pins] the support table changed: diff docs/support_matrix.md $cache/support_matrix.md"
fi
echo "[pins] $("$py" -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'): suite exit status $rc in $((SECONDS - start)) s"
if [ "$rc" -ne 0 ]; then
  echo "[pins] the suite failed on the newest releases: constraints.txt stays; fix the failures (or cap the range in pyproject.toml) first"
  exit "$rc"
fi
if [ "$write" = 1 ]; then
  cp "$cache/constraints.txt" constraints.txt
  echo "[pins] wrote constraints.txt; commit it on its own with the table and docs/compat.md's tested range"
else
  echo "[pins] the suite passed; run again with --write to move the pins"
fi
