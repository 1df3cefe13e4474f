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
