#!/usr/bin/env python
"""Every family of the support matrix plans and trains, FSDP2 on, with the default ``loss.chunk_tokens`` (issue 41).

For each row of tests/family_matrix.py (the families of docs/support_matrix.md): its recipe config
(tests/test_plan_families.py:family_config: ``configs/cp.yaml`` with the family's tiny ``model.config`` and
attention implementation, ``loss.chunk_tokens: auto``), then

1. ``automodel plan --config <it> --gpus 2 --gpu-type h100`` in this process: planned (exit 0 and a ``longest:``
   line), refused (exit 2, one ``error:`` line) or crashed (anything else);
2. 2 recipe steps on 2 gloo ranks at ``distributed.cp_size=1`` (FSDP2 over both ranks; tests/workers/
   family_train_worker.py): trained, refused (a ``UserInputError``: the recipe's one ``error:`` line) or crashed.

Families train in batches of ``--batch`` per launch; a batch whose launch fails (a rank stuck or killed) is rerun
one family per launch. Prints one line per family and the counts; exits 1 when anything crashed.

    PYTHONPATH=. python scripts/family_sweep.py                       # every family (~15-25 min on 2 busy cores)
    PYTHONPATH=. python scripts/family_sweep.py --families mamba,gemma2 --traceback
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.dist_harness import run_distributed  # noqa: E402
from tests.family_matrix import FAMILIES  # noqa: E402

WORKER = "tests.workers.family_train_worker:main"


def plan_family(config: str) -> dict:
    """``automodel plan`` on ``config`` (2 H100s), in this process."""
    from automodel.cli import main as cli

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli(["plan", "--config", config, "--gpus", "2", "--gpu-type", "h100"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 - a crash of the planner is what the sweep reports
        return {"status": "crashed", "error": f"{type(e).__name__}: {e}"}
    lines = out.getvalue().strip().splitlines()
    errors = [line for line in err.getvalue().splitlines() if line.startswith("error:")]
    if code == 0 and lines and lines[-1].startswith("longest:"):
        return {"status": "planned", "longest": lines[-1]}
    if code == 2 and len(errors) == 1:
        return {"status": "refused", "reason": errors[0]}
    return {"status": "crashed", "error": f"exit {code}: {(err.getvalue() or out.getvalue())[-2000:]}"}


def train_families(configs: list[tuple[str, str]], out: str, batch: int, timeout: float) -> dict:
    """name -> the worker's answer (rank 0's; a rank that disagrees makes it ``crashed``)."""
    results: dict = {}
    for i in range(0, len(configs), batch):
        group = configs[i:i + batch]
        try:
            ranks = run_distributed(WORKER, world_size=2, timeout=timeout * len(group), configs=group, out=out)
        except RuntimeError as e:
            if len(group) == 1:
                results[group[0][0]] = {"status": "crashed", "error": str(e)[-2000:]}
                continue
            results.update(train_families(group, out, 1, timeout))  # one per launch: find the one that hung
            continue
        for name, _ in group:
            got = [r[name] for r in ranks]
            if len({g["status"] for g in got}) > 1:
                got[0] = {"status": "crashed", "error": f"ranks disagree: {[g['status'] for g in got]}", **got[0]}
            results[name] = got[0]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=None, help="comma-separated family names (default: all)")
    parser.add_argument("--batch", type=int, default=12, help="families per 2-rank launch")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per family before a launch is killed")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of every crash")
    args = parser.parse_args(argv)

    from tests.test_plan_families import family_config

    wanted = set(args.families.split(",")) if args.families else None
    families = [f for f in FAMILIES if wanted is None or f.name in wanted]
    if wanted and len(families) != len(wanted):
        print(f"error: unknown families {sorted(wanted - {f.name for f in families})}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        configs = [(f.name, family_config(f, directory)) for f in families]
        plans = {name: plan_family(config) for name, config in configs}
        trains = train_families(configs, str(directory / "runs"), args.batch, args.timeout)
    counts: dict[str, int] = {}
    for name, _ in configs:
        plan, train = plans[name], trains[name]
        for key in (f"plan {plan['status']}", f"train {train['status']}"):
            counts[key] = counts.get(key, 0) + 1
        detail = plan.get("reason") or plan.get("error") or ""
        line = f"{name}: plan {plan['status']}{': ' + detail if detail else ''}; train {train['status']}"
        if train["status"] == "trained":
            line += f" (losses {[round(v, 4) for v in train['losses'].values()]}, chunk_tokens {train['chunk_tokens']})"
        else:
            line += f": {train.get('reason') or train.get('error')}"
        print(line)
        if args.traceback and train.get("traceback"):
            print(train["traceback"])
    print(f"{len(configs)} families in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))  # fmt: skip
    crashed = sum(v for k, v in counts.items() if k.endswith("crashed"))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
