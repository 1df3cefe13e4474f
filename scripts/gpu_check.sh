#!/usr/bin/env bash
# The one-command GPU check, for ONE lent GPU (an H100 or an H200). Not part of CI.
#
#   bash scripts/gpu_check.sh                 # all checks, <= 8 minutes, JSON summary to $OUT (or .)
#   bash scripts/gpu_check.sh --dry           # CPU smoke mode (seconds): flex/math block checks only
#   bash scripts/gpu_check.sh --only blocks   # groups: env,blocks,kernels,varlen,methods,recipe,throughput,te,memory
#   bash scripts/gpu_check.sh --only env,kernels  # each attention kernel: exact per block shape, TFLOP/s at 32K/128K,
#                                                 # rows for docs/gpu.md (~2 minutes)
#   bash scripts/gpu_check.sh --only env,memory   # the memory check alone (~3 minutes)
#
# What the GPU machine has: Python 3.12, torch 2.11.0+cu130, transformers 5.17.0, triton, pyyaml, peft,
# numpy, safetensors, tqdm, matplotlib, jinja2. Nothing can be fetched there. What it lacks, and the
# recipe checks need, travels as wheels (about 0.4 MiB, far under the 60 MiB allowance), downloaded HERE
# (a machine with PyPI) into .whl/ at the repository root, which git ignores locally:
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       hydra-core==1.3.2 omegaconf==2.3.0
#   python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # sdist only: built here, pure Python
#
# Then run this script on the GPU machine with .whl carried next to the checkout (the device tool's
# `carry: [".whl"]`); it installs them into /tmp/automodel-site (no network, no effect on the image) and
# puts that and the checkout on PYTHONPATH. Without .whl/ the block, varlen, throughput and TE checks
# still run; the methods and recipe checks then fail with the missing module named.
#
# Environment variables:
#   OUT                     where gpu_check.json goes (the device tool sets it; else --out or .)
#   GPU_CHECK_BUDGET_S      total wall limit in seconds (default 480 = 8 minutes); every check also has
#                           its own budget and is skipped, with the reason, when too little time is left
#   PYTHON                  the interpreter (default python3, the image's torch)
#   GPU_CHECK_SKIP_MEMORY   1: skip the memory check (its time: --memory-budget-s, default 180 s)
# Expected run time (estimated: never run on a GPU yet): up to 2 minutes for the block checks
# (FlexAttention compiles per block shape; a budget of 120 s, the rest skipped with the reason), up to 1.5
# minutes for the per-kernel checks (exactness per block shape, forward+backward at 32K and 128K tokens), under a
# minute for varlen / throughput / TE / thd kernels / the methods at world size 1, ~4 minutes for the four
# recipe runs (Llama-3.2-1B and Qwen3-1.7B shapes, random weights, 8K and 32K tokens, bf16, cp=1, chunked
# loss), up to 3 minutes for the memory check (the plan's longest row), then the 2-process method checks in what is left; 8 minutes at most (the wall limit), plus the
# machine's start (a minute or two). Order: env, blocks, kernels, varlen, throughput, te, thd kernels, methods at
# world size 1, recipe, memory, methods with 2 processes. Prints one line per check (PASS/FAIL/SKIP/INFO) and
# exits 1 if any check failed. docs/gpu.md says what each line means and holds the results.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
site=/tmp/automodel-site
if compgen -G "$root/.whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$root"/.whl/*.whl \
    || echo "[gpu_check] installing .whl/ failed: the recipe checks will name what is missing" >&2
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
budget="${GPU_CHECK_BUDGET_S:-480}"
# the driver keeps its own wall limit; this outer one is a last resort 30 s later
exec timeout --kill-after=10 $((${budget%.*} + 30)) "$py" "$root/scripts/gpu_check.py" --budget-s "$budget" "$@"
