#!/usr/bin/env python
"""The memory plan against the measured step peak for every family of the support matrix under CP (not part of CI).

:mod:`scripts.bench_plan_families` audits every family at cp=1 (one process, the model alone);
:mod:`scripts.bench_plan_cases` audits a dozen hand-written shapes under CP through the recipe. This script does the
second for every family of ``tests/family_matrix.py``: each family's tiny config (with ``--sizes`` set where it has
them, its position table raised to the row) is written as a recipe config (``tests/test_plan_families.py``'s
``family_config``: ``configs/cp.yaml`` with the family's ``model.config`` and attention implementation) and trained by
:class:`automodel.training.trainer.FinetuneTrainer` on 2 gloo ranks at cp=2 (FSDP2 over both; ``--cp 4``: 4 ranks,
with usp as 2 x 2, ``--ulysses-size``) with each CP method of ``--methods``, activation checkpointing
(``--no-checkpointing``: without), ``loss.chunk_tokens=256``, fp32, one row of ``--seq-len`` tokens per step, for 3
steps. Steps 2 and 3 are measured on each rank exactly as
:func:`scripts.bench_plan_cases.case_worker` measures its cases (the live tensor storages a step creates: a device
allocator's view) and set beside the planner's step peak for the same validated config with torch's CPU kernels.

A row under-counted by more than ``--tolerance`` (5%, as the cp=1 audit) is marked ``UNDER`` and makes the script exit
1; one over-counted by more than ``--over`` (15%) is marked ``over``. A family the config or the model refuses under a
method is printed as ``refused`` with the first line of the reason (a refusal is the contract, not a failure); one
that fails otherwise is ``failed`` and makes the script exit 1.

What a CPU measures is the CPU kernels' memory: where a family's attention or mixer takes a path on CPU that a GPU
does not (the reference PyTorch kernels of linear attention and Mamba, which the CUDA kernels replace), the measured
peak holds tensors a GPU run does not make (the cp=1 audit's notes in docs/benchmarks.md say which families).

    PYTHONPATH=. nice python scripts/bench_plan_families_cp.py                 # every family, ring and ulysses
    PYTHONPATH=. nice python scripts/bench_plan_families_cp.py --families llama,gemma2 --methods ring
    PYTHONPATH=. nice python scripts/bench_plan_families_cp.py --sizes hidden_size=256,intermediate_size=768
    PYTHONPATH=. nice python scripts/bench_plan_families_cp.py --cp 4 --methods ring,ulysses,usp --families llama4_text

Some configs do not take every size: MLA's head sizes, Falcon's multi-query heads and the validators of Bamba,
dots3 and Qwen4-Exp make those models fail (or fail the chunked loss's probe) at sizes their tiny configs do not
have; run them without ``--sizes``. The first audit's rows and what they changed: docs/benchmarks.md, "Every family
under CP".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.launch import run_on_ranks  # noqa: E402
from scripts.bench_plan_cases import measured_vs_planned_phases  # noqa: E402

#: families per launch: a launch that dies or passes its time-out loses only these rows
GROUP = 6
#: the first line of these errors is a refusal (the config's or the model's rule), not a failure of the harness
REFUSALS = ("ConfigError", "ValueError", "NotImplementedError", "TypeError", "UserInputError", "CPUnsupportedError")


def write_configs(names: list[str], directory: Path, sizes: dict[str, int], seq: int) -> dict[str, str]:
    """``{family: recipe config path}``: each family's tiny config with ``sizes`` and its position table raised to
    ``seq`` (:func:`scripts.bench_plan_families.sized_config`), written by ``family_config``; where that fails (a
    config whose sizes are per layer), ``"error: <the reason>"``."""
    from scripts.bench_plan_families import sized_config
    from tests.family_matrix import family_by_name
    from tests.test_plan_families import family_config

    out = {}
    for name in names:
        fam = family_by_name(name)
        try:
            out[name] = family_config(fam, directory, sized_config(fam, sizes, seq))
        except Exception as e:  # noqa: BLE001 - printed as the family's row
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return out


def _reason(error: str) -> tuple[str, str]:
    """``("refused" | "failed", one line)`` of a case's traceback: its last exception line."""
    lines = [x for x in error.strip().splitlines() if x and not x.startswith(" ")]
    last = lines[-1] if lines else error.strip()[-200:]
    kind = last.split(":", 1)[0].rsplit(".", 1)[-1]
    return ("refused" if kind in REFUSALS else "failed"), last[:220]


def main() -> int:
    from tests.family_matrix import FAMILIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="", help="comma-separated names (default: every family)")
    parser.add_argument("--methods", default="ring,ulysses", help="comma-separated CP methods at --cp")
    parser.add_argument("--cp", type=int, default=2, help="distributed.cp_size: one gloo rank each (2, or 4 for usp)")
    parser.add_argument("--ulysses-size", type=int, default=2, help="usp's distributed.ulysses_size (cp 4: 2 x ring 2)")
    parser.add_argument("--seq-len", type=int, default=2048, help="data.seq_len: global tokens of the one row")
    parser.add_argument("--sizes", default="", help="config sizes to set where a family has them, e.g. "
                        "hidden_size=256,intermediate_size=768,num_attention_heads=8,num_key_value_heads=4,head_dim=32")
    parser.add_argument("--no-checkpointing", action="store_true", help="model.activation_checkpointing=false")
    parser.add_argument("--tolerance", type=float, default=0.05, help="an under-count past this fails the row")
    parser.add_argument("--over", type=float, default=0.15, help="an over-count past this is marked")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per launch of --group families")
    parser.add_argument("--group", type=int, default=GROUP, help="families per launch")
    parser.add_argument("--snapshots", metavar="DIR", help="write the live storages at each phase's peak (slower)")
    args = parser.parse_args()
    names = args.families.split(",") if args.families else [f.name for f in FAMILIES]
    if args.snapshots:
        Path(args.snapshots).mkdir(parents=True, exist_ok=True)
    methods = [m for m in args.methods.split(",") if m]
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in args.sizes.split(",") if kv)}
    ac = not args.no_checkpointing
    common = [f"model.activation_checkpointing={str(ac).lower()}", "loss.chunk_tokens=256",
              f"distributed.cp_size={args.cp}"]
    if "usp" in methods and args.cp <= args.ulysses_size:
        parser.error(f"usp needs --cp above --ulysses-size (got {args.cp} and {args.ulysses_size}): e.g. --cp 4")
    print(f"Plan against the tracked step peak at cp={args.cp} through the recipe ({args.cp} gloo ranks, FSDP2 over "
          f"all, fp32, "
          f"{args.seq_len} tokens, loss.chunk_tokens=256, checkpointing {'on' if ac else 'off'}"
          f"{'; ' + args.sizes if sizes else ''}); MiB, the largest of {args.cp} ranks x steps 2-3\n")  # fmt: skip
    print("| family | method | planned | measured | error | forward+loss planned / measured | backward planned / "
          "measured | optimizer planned / measured | |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    ok, under, notes = True, [], []
    with tempfile.TemporaryDirectory() as root:
        configs = write_configs(names, Path(root), sizes, args.seq_len)
        for name, path in configs.items():
            if path.startswith("error: "):
                ok = False
                print(f"| {name} | | - | - | not run | - | - | - | {path.removeprefix('error: ')} |")
        runnable = [n for n in names if not configs[n].startswith("error: ")]
        for start in range(0, len(runnable), args.group):
            group = runnable[start : start + args.group]
            cases = [{"name": f"{n.replace('@', '_')}-{m}", "config": configs[n],
                      "overrides": [*common, f"distributed.cp_method={m}",
                                    *([f"distributed.ulysses_size={args.ulysses_size}"] if m == "usp" else [])]}
                     for n in group for m in methods]  # fmt: skip
            try:
                per_rank = run_on_ranks("scripts.bench_plan_cases:case_worker", args.cp, args.timeout, cases=cases,
                                        out_root=str(Path(root) / "runs"), seq_len=args.seq_len,
                                        snapshots=str(Path(args.snapshots).resolve()) if args.snapshots else None)
            except RuntimeError as e:  # the launch died or timed out: its rows are not run
                ok = False
                for case in cases:
                    print(f"| {case['name']} | | - | - | not run | - | - | - | {str(e).splitlines()[0][:120]} |")
                continue
            for i, case in enumerate(cases):
                fam, method = case["name"].rsplit("-", 1)
                got = [r[i] for r in per_rank]
                errors = [g["error"] for g in got if "error" in g]
                if errors:
                    kind, why = _reason(errors[0])
                    ok &= kind == "refused"
                    print(f"| {fam} | {method} | - | - | {kind} | - | - | - | {why} |", flush=True)
                    continue
                plan = got[0]["plan"]
                steps = [s for g in got for s in g["steps"]]
                measured = max(s["peak_mib"] for s in steps)
                planned = plan["step_peak_mib"]
                err = (planned - measured) / measured
                mark = "UNDER" if err < -args.tolerance else ("over" if err > args.over else "")
                ok &= mark != "UNDER"
                if mark == "UNDER":
                    under.append(f"{fam} {method}")
                cells = []
                for phase, pmib in measured_vs_planned_phases(plan["phases_mib"]).items():
                    mmib = max(s["phases_mib"].get(phase, 0.0) for s in steps)
                    cells.append(f"{pmib:.1f} / {mmib:.1f}")
                print(f"| {fam} | {method} | {planned:.1f} | {measured:.1f} | {err:+.1%} | {' | '.join(cells)} | "
                      f"{mark} |", flush=True)  # fmt: skip
                terms = ", ".join(f"{k} {v:.1f}" for k, v in plan["terms_mib"].items() if v)
                notes.append(f"{fam} {method}: planned peak {plan['peak_phase']} = {terms}")
    print()
    for n in notes:
        print(f"- {n}")
    if under:
        print(f"\nUNDER by more than {args.tolerance:.0%}: {', '.join(under)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
