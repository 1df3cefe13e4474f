#!/usr/bin/env python
"""Kill one rank mid-step and check that the run fails cleanly and resumes exactly (issue 27 item 7).

    python scripts/fault_kill.py                                  # configs/cp.yaml, 2 ranks, kill rank 1
    python scripts/fault_kill.py --nproc 4 --kill-rank 2 --config configs/cp.yaml distributed.cp_size=4
    python scripts/fault_kill.py --json out.json -- distributed.cp_method=ulysses

Three launches of the ``automodel`` command (``python -m automodel.cli finetune``) with the tiny
overrides below and ``--max-steps`` steps, a checkpoint every ``--ckpt-every``:

1. **killed**: once ``metrics.jsonl`` holds step ``--kill-after``, wait a random fraction of a step
   and SIGKILL the rank ``--kill-rank`` (found by its ``RANK`` environment variable among the
   command's descendants). Checked: the command exits within ``--exit-within`` seconds (default 60),
   with exactly one ``error:`` line on the terminal, naming ``rank <kill-rank>``, and no traceback.
2. **resumed**: the same command with ``checkpoint.resume=auto``; it must finish (exit 0).
3. **reference**: an uninterrupted run in another directory (``--no-reference`` skips it: then the
   resumed steps are compared with the killed run's steps they repeat).

Checked: every step's loss of the resumed run equals the reference's (exactly, unless ``--rtol``).
Prints the figures (time to exit, the line, the resume step, the losses compared) and exits 0 if
every check passed, 1 otherwise. ``--json PATH`` writes them as JSON. Extra arguments are Hydra
overrides for all three launches.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.dtype=float32",
    "fsdp.param_dtype=float32",
    "data.seq_len=128",
    "step_scheduler.global_batch_size=8",
    "step_scheduler.local_batch_size=2",
    "step_scheduler.val_every_steps=null",
    "lr_scheduler.warmup_steps=2",
    "checkpoint.keep_last=null",
    "export.enabled=false",
    "logging.progress_bar=false",
    "logging.plot=false",
    "recipe.cp_self_check=false",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def _command(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "automodel.cli", "finetune", "--config", args.config, "--nproc-per-node",
        str(args.nproc), *TINY, f"step_scheduler.max_steps={args.max_steps}",
        f"step_scheduler.ckpt_every_steps={args.ckpt_every}", *args.overrides,
        f"recipe.output_dir={run_dir}", *extra,
    ]  # fmt: skip


def _losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs its steps again)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("type") == "train":
            out[int(r["step"])] = float(r["loss"])
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _rank_pid(root: int, rank: int) -> int | None:
    for pid in _descendants(root):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK" in b"".join(env):
            return pid
    return None


def _run(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/cp.yaml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--kill-after", type=int, default=5, help="kill once this step is logged (mid-next-step)")
    p.add_argument("--exit-within", type=float, default=60.0)
    p.add_argument("--rtol", type=float, default=0.0)
    p.add_argument("--no-reference", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="per launch")
    p.add_argument("--workdir", default=None, help="kept if given (default: a temporary directory, deleted)")
    p.add_argument("--json", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="automodel-fault-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir, ref_dir = work / "run", work / "reference"
    for d in (run_dir, ref_dir):
        shutil.rmtree(d, ignore_errors=True)
    figures: dict = {"config": args.config, "nproc": args.nproc, "kill_rank": args.kill_rank, "checks": {}}
    checks = figures["checks"]

    # 1. the killed run
    killed = subprocess.Popen(
        _command(args, run_dir, []), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + args.timeout
    step_t: list[float] = []
    while killed.poll() is None and time.monotonic() < deadline:
        losses = _losses(run_dir)
        if len(losses) > len(step_t):
            step_t += [time.monotonic()] * (len(losses) - len(step_t))
        if args.kill_after in losses:
            break
        time.sleep(0.05)
    if killed.poll() is not None or args.kill_after not in _losses(run_dir):
        out = killed.communicate()[0] if killed.poll() is None else killed.stdout.read()
        print(f"fault_kill: the run never reached step {args.kill_after}:\n{out[-4000:]}")
        return 1
    victim = _rank_pid(killed.pid, args.kill_rank)
    if victim is None:
        killed.kill()
        print(f"fault_kill: no process with RANK={args.kill_rank} under pid {killed.pid}")
        return 1
    step_s = (step_t[-1] - step_t[0]) / max(1, len(step_t) - 1) if len(step_t) > 1 else 0.5
    time.sleep(random.uniform(0.2, 0.8) * step_s)  # mid-step
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    try:
        out = killed.communicate(timeout=args.timeout)[0]
    except subprocess.TimeoutExpired:
        killed.kill()
        out = killed.communicate()[0]
    exit_s = time.monotonic() - t_kill
    killed_losses = _losses(run_dir)
    errors = [line for line in out.splitlines() if "error:" in line]
    figures.update(
        kill_after_step=args.kill_after,
        steps_logged_before_exit=max(killed_losses),
        killed_rc=killed.returncode,
        exit_s=round(exit_s, 2),
        error_lines=errors,
        killed_output_lines=len(out.splitlines()),
    )
    checks["exit_within"] = exit_s <= args.exit_within
    checks["one_error_line_naming_rank"] = len(errors) == 1 and f"rank {args.kill_rank} " in errors[0]
    checks["no_traceback"] = "Traceback" not in out
    checks["exit_code_4"] = killed.returncode == 4
    if not all(checks.values()):
        figures["killed_output_tail"] = out[-3000:]

    # 2. resume=auto
    rc, out, secs = _run(_command(args, run_dir, ["checkpoint.resume=auto"]), args.timeout)
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    resumed = _losses(run_dir)
    figures.update(resumed_rc=rc, resumed_s=round(secs, 1), resumed_from=summary.get("resumed_from"))
    checks["resume_ok"] = rc == 0 and bool(summary.get("resumed_from"))
    if rc != 0:
        figures["resumed_output_tail"] = out[-3000:]
    resume_step = int(Path(summary["resumed_from"]).name.split("_")[1]) if summary.get("resumed_from") else 0

    # 3. the reference (or the killed run's own steps)
    if args.no_reference:
        reference = {s: v for s, v in killed_losses.items() if s > resume_step}
    else:
        rc_ref, out_ref, secs_ref = _run(_command(args, ref_dir, []), args.timeout)
        figures.update(reference_rc=rc_ref, reference_s=round(secs_ref, 1))
        reference = _losses(ref_dir)
    compared = {s: (resumed.get(s), reference[s]) for s in sorted(reference) if s > resume_step}
    figures["losses_after_resume"] = {s: {"resumed": a, "reference": b} for s, (a, b) in compared.items()}

    def close(a: float | None, b: float) -> bool:
        return a is not None and (a == b if args.rtol == 0 else abs(a - b) <= args.rtol * abs(b))

    checks["losses_equal"] = bool(compared) and all(close(a, b) for a, b in compared.values())
    checks["all_steps"] = sorted(resumed) == list(range(1, args.max_steps + 1))

    ok = all(checks.values())
    print(f"fault_kill: {'PASS' if ok else 'FAIL'} {json.dumps(checks)}")
    print(
        f"fault_kill: SIGKILL of rank {args.kill_rank} after step {args.kill_after}: the command exited "
        f"{figures['exit_s']}s later with rc {figures['killed_rc']} and {len(errors)} error line(s):"
    )
    for line in errors:
        print(f"  {line}")
    print(
        f"fault_kill: resume=auto from {figures['resumed_from']} (rc {figures['resumed_rc']}, {figures['resumed_s']}s); "
        f"steps {min(compared) if compared else '-'}..{max(compared) if compared else '-'} compared with the "
        f"{'killed run' if args.no_reference else 'uninterrupted run'}: "
        + ", ".join(f"{s}: {a} vs {b}" for s, (a, b) in compared.items())
    )
    if not ok:
        for key in ("killed_output_tail", "resumed_output_tail"):
            if key in figures:
                print(f"--- {key}\n{figures[key]}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
