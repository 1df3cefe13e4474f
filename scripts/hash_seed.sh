# Sourced by scripts/test.sh and scripts/update_pins.sh before pytest. The string hash seed decides the order of sets,
# and so any choice a test or a script makes by iterating one: drawn here unless PYTHONHASHSEED is given, exported to
# every pytest worker and launched rank, and printed, so that a failure that depends on it can be repeated (a set's
# first element chose the support matrix's cp 4 column on some seeds and failed CI on 2026-12-07).
export PYTHONHASHSEED="${PYTHONHASHSEED:-$(( (RANDOM << 15 | RANDOM) % 4294967295 + 1 ))}"
echo "[seed] PYTHONHASHSEED=$PYTHONHASHSEED (set it to repeat this run's set orders)"
