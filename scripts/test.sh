#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh) and run lint + the whole test suite on CPU.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k thd -x`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
venv="${AUTOMODEL_VENV:-$root/.venv}"
py="$venv/bin/python"; [ "$venv" = "none" ] && py="$(command -v python3)"
cd "$root"
echo "[test] ruff"
"$py" -m ruff check automodel recipes scripts tests examples
echo "[test] pytest"
# pytest-xdist (the dev extra) on 2 workers: each module whole on one worker, the longest first (tests/conftest.py);
# AUTOMODEL_TEST_WORKERS=0 (or a later -n 0) runs serially
workers="${AUTOMODEL_TEST_WORKERS:-2}"
xdist=()
if [ "$workers" != 0 ] && "$py" -c "import xdist" 2>/dev/null; then
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
source "$root/scripts/hash_seed.sh"  # PYTHONHASHSEED: drawn unless given, exported, printed
set +e
pins="${AUTOMODEL_PINS:-$root/constraints.txt}"
[ "$pins" = none ] && pins=""
# tests/test_pins.py checks that the environment holds the versions setup.sh pinned (none: AUTOMODEL_PINS=none);
# setup.sh installed the tracker extras: their tests must run. --durations prints the 25 slowest tests, the figures
# that keep CI under its 20-minute budget
AUTOMODEL_REQUIRE_EXTRAS=1 AUTOMODEL_PINS_FILE="$pins" "$py" -m pytest --durations=25 ${xdist[@]+"${xdist[@]}"} "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
