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
set +e
pins="${AUTOMODEL_PINS:-$root/constraints.txt}"
[ "$pins" = none ] && pins=""
# tests/test_pins.py checks that the environment holds the versions setup.sh pinned (none: AUTOMODEL_PINS=none)
AUTOMODEL_REQUIRE_EXTRAS=1 AUTOMODEL_PINS_FILE="$pins" "$py" -m pytest "$@"  # setup.sh installed the tracker extras: their tests must run
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "[test] pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
