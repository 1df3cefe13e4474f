"""The dry run leads with the plan (issue 22, item 10): the resolved config only behind a flag, one
logits figure, and a step-time / communication estimate for a named GPU labelled an estimate."""

from __future__ import annotations

import re

import pytest

from automodel.config import ConfigError, load_config
from automodel.config.gpu_specs import GPU_SPECS
from automodel.training.dry_run import dry_run_report

LLAMA = "configs/llama3_2_1b_32k_cp4.yaml"


@pytest.fixture(scope="module")
def report() -> str:
    return dry_run_report(load_config(["--config", LLAMA, "recipe.dry_run=true"]))


def test_plan_first_config_behind_a_flag(report):
    assert report.startswith("=== dry run: ") and "(planned for world size 8) ===" in report.splitlines()[0]
    assert "--- resolved config" not in report and "recipe.dry_run_print_config=true prints it" in report
    shown = dry_run_report(load_config(["--config", LLAMA, "recipe.dry_run=true", "recipe.dry_run_print_config=true"]))
    assert shown.index("--- predicted memory per rank") < shown.index("--- resolved config") < shown.index("name: llama3.2")


def test_one_logits_figure(report):
    shape_line = next(ln for ln in report.splitlines() if ln.startswith("logits "))
    term_line = next(ln for ln in report.splitlines() if ln.strip().startswith("logits and loss"))
    figure = re.search(r"with the loss: ([\d.]+ \w+)", shape_line).group(1)
    assert term_line.split()[3:5] == figure.split(), (shape_line, term_line)
    assert "fp32 copy" not in report


def test_step_time_estimate_for_a_named_gpu(report):
    spec = GPU_SPECS["h100"]
    assert f"--- step-time ESTIMATE on {spec.name} (data-sheet peaks x the achieved fractions" in report
    # 16 rows x 32768 tokens over 8 ranks, activation checkpointing: matrix products 6 N + 2 N_layers per
    # token, causal attention 8 L S d per token (6 + the recomputed forward), d = 32 heads x 64
    got = re.search(r"compute: ([\d.]+) TFLOP per rank per step = matrix products ([\d.]+) \(6N \+ the recomputed "
                    r"forward, N = ([\d.]+)B\) \+ causal attention ([\d.]+)", report)  # fmt: skip
    tokens = 16 * 32768 / 8
    assert float(got.group(4)) == pytest.approx(8 * 16 * 32768 * 32 * 64 * tokens / 1e12, rel=1e-3)
    assert float(got.group(1)) == pytest.approx(float(got.group(2)) + float(got.group(4)), abs=0.11)
    assert "communication, FSDP over 8:" in report and "communication, CP attention over 4 (ring):" in report
    assert "estimated step time:" in report and re.search(r"estimated throughput: [\d,]+ tokens/s/GPU", report)
    cpu = dry_run_report(load_config(["--config", "configs/cp.yaml", "recipe.dry_run=true"]))
    assert "set recipe.gpu_type" in cpu and "ESTIMATE" not in cpu
    with pytest.raises(ConfigError, match=r"recipe.gpu_type='v100' is not a known GPU; use one of"):
        load_config(["--config", LLAMA, "recipe.dry_run=true", "recipe.gpu_type=v100"])


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"ms": 1e-3, "s": 1.0, "min": 60.0}[unit]


def test_host_memory_per_node_and_the_step_per_row_beside_the_global_batch(report):
    """The dry run prints what automodel plan limits and prints: host memory per node, and the step of one row per
    data-parallel rank (the plan's step column) next to the step of the config's global batch."""
    host = re.search(r"^host memory per node: (\S+ \w+) = 8 rank\(s\) x .*; automodel plan's usual limit 2048 GiB "
                     r"per node of 8 GPUs \(256 GiB per GPU; --gpus-per-node, --host-memory-gib\) -> fits$", report,
                     re.M)  # fmt: skip
    assert host, report
    glob = re.search(r"^estimated step time: ([\d.]+ m?s)", report, re.M).group(1)
    row = re.search(r"^estimated step per row: ([\d.]+ m?s) for one row of 32768 tokens per data-parallel rank \(2 "
                    r"row\(s\); automodel plan's step column.*global batch of 16 rows$", report, re.M)  # fmt: skip
    assert row, report
    assert _seconds(row.group(1)) < _seconds(glob) / 4  # 16 rows over dp 2: 8 micro-batches per rank


def test_gpus_per_node_are_the_plans():
    """As automodel plan --gpus 4 [--gpus-per-node M]: the run's ranks on a node (the estimate's node) are the world
    up to M, and the host limit is 256 GiB per GPU of the node (M = 8 unless the config or the launch says)."""
    base = ["--config", "configs/cp.yaml", "recipe.dry_run=true", "recipe.gpu_type=h100"]
    four = dry_run_report(load_config(base, world_size=4))
    assert "4 GPUs per node assumed" in four and "= 4 rank(s) x" in four and "limit 2048 GiB per node of 8 GPUs" in four
    two = dry_run_report(load_config([*base, "recipe.plan_nproc_per_node=2"], world_size=4))
    assert "2 GPUs per node assumed" in two and "= 2 rank(s) x" in two and "limit 512 GiB per node of 2 GPUs" in two
