#!/usr/bin/env python
"""Launch the same input mistake many times; count the launches that showed exactly the error line.

    nice python scripts/stress_errors.py                        # 50 x a config typo through `automodel finetune`
    nice python scripts/stress_errors.py --case glob -n 13      # a data glob matching nothing (found by the ranks)
    nice python scripts/stress_errors.py --case typo --launcher torchrun -n 20   # the ranks' agreement path

Each launch runs 2 ranks of recipes/finetune.py on CPU (configs/cp.yaml plus the mistake) through the
``automodel`` command (``python -m automodel.cli``) or through torchrun itself, and is "clean" when its
terminal output (stdout and stderr together) is exactly one ``error: ...`` line and its exit code is 2
(through torchrun the launcher's own report follows, so only "the error line is there and no rank died
of a signal" is checked). A launch that is not clean is printed in full. Cases:

- ``typo``: ``step_scheduler.max_step=10`` (a config error: the command catches it before the ranks start;
  under torchrun every rank finds it and they agree before exiting);
- ``glob``: an ``HFDataset`` whose ``path`` glob matches no file (found by the ranks during setup);
- ``jsonl``: a ``.jsonl`` file with a broken line (found by the ranks during setup).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def case_overrides(case: str, tmp: Path) -> list[str]:
    if case == "typo":
        return ["step_scheduler.max_step=10"]
    if case == "glob":
        return [
            "data.dataset._target_=automodel.data.hf_dataset.HFDataset",
            f"+data.dataset.path={tmp}/nothing_here_*.jsonl",
            "~data.dataset.val_fraction",
        ]
    if case == "jsonl":
        bad = tmp / "bad.jsonl"
        bad.write_text('{"text": "one good line"}\n{"text": broken\n')
        return [f"data.dataset.path={bad}"]
    raise SystemExit(f"unknown case {case!r}")


def command(launcher: str, overrides: list[str], out: Path) -> list[str]:
    recipe = ["--config", str(ROOT / "configs/cp.yaml"), *overrides, f"recipe.output_root={out}"]
    if launcher == "cli":
        return [sys.executable, "-m", "automodel.cli", "finetune", "--nproc-per-node", "2", *recipe]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "recipes/finetune.py"), *recipe]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=50, help="launches (default 50)")
    ap.add_argument("--case", choices=["typo", "glob", "jsonl"], default="typo")
    ap.add_argument("--launcher", choices=["cli", "torchrun"], default="cli")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    clean = lost = signalled = 0
    times = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        overrides = case_overrides(args.case, tmp)
        for i in range(args.n):
            t0 = time.perf_counter()
            p = subprocess.run(
                command(args.launcher, overrides, tmp / "out"),
                capture_output=True,
                text=True,
                env=env,
                cwd=tmp,
                timeout=args.timeout,
            )
            times.append(time.perf_counter() - t0)
            text = p.stdout + p.stderr
            lines = [ln for ln in text.splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("error: ")]
            died = re.findall(r"exitcode\s*:\s*(-\d+)", text)  # torchrun's failure table
            if not errors:
                lost += 1
            if died:
                signalled += 1
            if args.launcher == "cli":
                ok = p.returncode == 2 and len(lines) == 1 and len(errors) == 1
            else:
                ok = len(errors) == 1 and not died
            clean += ok
            if not ok:
                print(f"--- launch {i + 1}: exit code {p.returncode}, {len(lines)} lines:\n{text}---", flush=True)
            print(f"launch {i + 1}/{args.n}: exit {p.returncode}, {len(lines)} line(s), {times[-1]:.1f}s", flush=True)
    rule = "exactly the error line, exit 2" if args.launcher == "cli" else "the error line, no rank killed"
    print(
        f"{args.case} via {args.launcher}: {clean}/{args.n} launches clean ({rule}); "
        f"{lost} without an error line; {signalled} with a rank killed by a signal; "
        f"median {sorted(times)[len(times) // 2]:.1f}s per launch"
    )
    return 0 if clean == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
