"""scripts/gpu_check.py's CPU-runnable parts: arguments, the JSON summary, the step-line parser, the per-check
budget / failure handling, and the --dry smoke mode's block check (FlexAttention on CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from automodel.training.step_log import format_step_line

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_arguments_and_summary_path(gc, monkeypatch, tmp_path):
    a = gc.parse_args(["--dry", "--only", "env,blocks", "--skip", "recipe", "--budget-s", "60"])
    assert a.dry and a.only == {"env", "blocks"} and a.skip == {"recipe"} and a.budget_s == 60.0
    assert gc.parse_args([]).only is None and gc.parse_args([]).budget_s == 480.0
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gc.summary_path(None) == tmp_path / "gpu_check.json"
    assert gc.summary_path(str(tmp_path / "x.json")) == tmp_path / "x.json"
    assert gc.summary_path(str(tmp_path / "d")) == tmp_path / "d" / "gpu_check.json"


def test_runner_budget_failures_and_json(gc, tmp_path, capsys):
    r = gc.Runner(budget_s=100.0, only={"a", "b"})
    r.run("a", "a/ok", lambda: gc.Result("a/ok", "PASS", "", {"x": 1.5}), 10)
    r.run("a", "a/boom", lambda: 1 / 0, 10)
    r.run("c", "c/off", lambda: gc.Result("c/off", "PASS"), 10)
    r.budget_s = 0.0
    r.run("b", "b/late", lambda: gc.Result("b/late", "PASS"), 10)
    data = gc.write_summary(r, {"torch": torch.__version__}, tmp_path / "s.json")
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(json.dumps(data, default=str))
    status = {x["name"]: x["status"] for x in data["results"]}
    assert status == {"a/ok": "PASS", "a/boom": "FAIL", "c/off": "SKIP", "b/late": "SKIP"}
    assert not data["ok"] and data["counts"] == {"PASS": 1, "FAIL": 1, "SKIP": 2}
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[1].startswith("FAIL a/boom") and "ZeroDivisionError" in out[1]
    assert "total wall limit" in out[3]


def test_step_lines_parse(gc):
    rec = {"step": 3, "loss": 7.25, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 12345.0,
           "tokens_per_s_per_device": 12345.0, "step_time_s": 0.66, "peak_mem_gib": 21.5, "mem_kind": "cuda"}
    text = "noise\n" + format_step_line(rec, 4) + "\n" + format_step_line(dict(rec, step=4, loss=7.0), 4)
    got = gc.parse_steps(text)
    assert [g["step"] for g in got] == [3, 4] and got[1]["loss"] == 7.0
    assert got[0]["tokens_per_s"] == 12345.0 and got[0]["peak_mem_gib"] == 21.5 and got[0]["step_time_s"] == 0.66


def test_dry_run_plan_parses(gc):
    text = ("step peak 13.34 GiB above the persistent state; total 27.15 GiB per rank; dominant term: logits\n"
            "compute: 89.8 TFLOP per rank per step -> 90.8 ms at the BF16 peak\n"
            "estimated step time: 227.0 ms (communication fully overlapped) to 227.0 ms (not overlapped)")
    assert gc.parse_plan(text) == {"plan_total_gib": 27.15, "plan_step_s": 0.227, "plan_tflop": 89.8}
    assert gc.parse_plan("total 512.00 MiB per rank; estimated step time: 1.5 s (x)") == {
        "plan_total_gib": 0.5, "plan_step_s": 1.5}
    assert gc.parse_plan("nothing planned") == {}


def test_dry_mode_runs_the_cpu_block_check(gc, tmp_path, capsys):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    rc = gc.main(["--dry", "--only", "env", "--out", str(tmp_path)])  # the smoke mode's frame, no block check
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert rc == 0 and data["env"]["mode"].startswith("dry")
    assert {x["name"] for x in data["results"] if x["status"] == "SKIP"} >= {"blocks", "recipe", "te_partition"}
    validate = flex._validate_device
    try:
        flex._validate_device = lambda *a, **k: None
        res = gc.check_block("flex", "sinks", torch.float32, torch.device("cpu"))
        assert res.status == "PASS", res
        assert res.figures["out_err"] <= gc.FP32_BAR
        assert gc.check_block("sdpa_flash", "window", torch.bfloat16, torch.device("cpu")).status == "SKIP"
    finally:
        flex._validate_device = validate


def test_memory_check_cpu_parts(gc, monkeypatch):
    assert gc.parse_args([]).memory_budget_s == 180.0 and gc.parse_args(["--memory-budget-s", "60"]).memory_budget_s == 60
    assert gc.gpu_type_for("NVIDIA H200") == "h200" and gc.gpu_type_for("NVIDIA H100 80GB HBM3") == "h100"
    assert gc.gpu_type_for("Some GPU") == "h100"
    text = "x\ngpu_check peaks: allocated 1.000 GiB, reserved 2.000 GiB\ngpu_check peaks: allocated 10.500 GiB, reserved 12.250 GiB"
    assert gc.parse_peaks(text) == {"allocated_gib": 10.5, "reserved_gib": 12.25} and gc.parse_peaks("none") == {}
    monkeypatch.setenv(gc.MEMORY_SKIP_ENV, "1")
    res = gc.check_memory("NVIDIA H100", 79.2, 180.0)
    assert res.status == "SKIP" and gc.MEMORY_SKIP_ENV in res.detail


def test_memory_row_is_the_plans_longest_row_or_a_planned_fraction(gc):
    from automodel.training.memory_plan import plan_memory
    from automodel.training.plan_search import build_search, longest_row

    whole = gc.memory_row("h100", 79.2, 2, time_s=1e9)  # no time limit: the whole row
    search, _, _, _ = build_search(str(ROOT / gc.MEMORY_CONFIG), list(gc._MEMORY_OVERRIDES), 1, "h100", 79.2)
    best = longest_row(search.search())
    assert whole["row"] == whole["seq"] == best.tokens > 500_000 and whole["fraction"] == 1
    assert whole["plan_total_gib"] <= 79.2 - 1.0 and whole["techniques"] == best.techniques.text(1)
    assert "model.activation_checkpointing=true" in whole["overrides"]
    part = gc.memory_row("h100", 79.2, 2, time_s=60.0)  # too slow for a minute: a fraction, planned there
    assert part["row"] == best.tokens and part["fraction"] > 1 and part["seq"] <= best.tokens // part["fraction"]
    assert 2 * part["est_step_s"] <= 60.0 or part["seq"] == 1024
    plan = plan_memory(search.d, search.shape(best.layout, best.techniques, part["seq"]))
    assert part["plan_total_gib"] == plan.total_bytes / 2**30 < whole["plan_total_gib"]


def test_kernels_group_in_dry_mode(gc, tmp_path, monkeypatch):
    """--dry runs the per-kernel group on CPU (FlexAttention's eager form): every block shape the methods use
    against fp32 math, the forward+backward speed at a few hundred tokens, and the docs/gpu.md rows."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(flex, "_validate_device", flex._validate_device)  # the dry mode patches it; restored after
    assert gc.main(["--dry", "--only", "env,kernels", "--out", str(tmp_path)]) == 0
    res = {x["name"]: x for x in json.loads((tmp_path / "gpu_check.json").read_text())["results"]}
    for shape in gc.KERNEL_SHAPES:
        got = res[f"kernels/flex/{shape}/float32"]
        if shape in ("varlen", "packed"):  # FlexAttention has no packed-row call (and --dry has no CUDA)
            assert got["status"] == "SKIP" and "needs CUDA" in got["detail"], got
            continue
        assert got["status"] == "PASS" and got["figures"]["out_err"] <= gc.FP32_BAR, got
    for tokens in gc.DRY_SPEED_TOKENS:
        got = res[f"kernels/flex/speed/{tokens}"]
        assert got["status"] == "INFO" and got["figures"]["tflops"] > 0 and "estimate_tflops" not in got["figures"]
    row = res["kernels/paste/flex"]["detail"]
    assert row.count("|") == gc.PASTE_HEADER.count("|") and "| flex | exact (causal, full, gqa, rect;" in row
    assert res["kernels/paste/header"]["detail"] == gc.PASTE_HEADER
    assert gc.PASTE_HEADER in (ROOT / "docs" / "gpu.md").read_text()


def test_kernel_exactness_skips_what_the_selection_refuses_and_rows_say_failures(gc, monkeypatch):
    from automodel.distributed.cp import block_backend as bb

    h100 = bb.caps_for(bb.GpuInfo.named("h100"), "2.11.0", 91900)
    monkeypatch.setattr(gc, "_kernel_caps", lambda device, dry: h100)
    assert gc.kernels_of(torch.device("cpu"), False) == [bb.CUDNN, bb.FLASH, bb.EFFICIENT, bb.FLEX]
    skip = gc.check_kernel_exact(bb.CUDNN, "rect", torch.bfloat16, torch.device("cpu"), False)
    assert skip.status == "SKIP" and "takes no mask" in skip.detail
    assert gc.check_kernel_exact(bb.FLASH, "causal", torch.float32, torch.device("cpu"), False).status == "SKIP"
    failed = [gc.Result("kernels/sdpa_cudnn/causal/bfloat16", "FAIL", figures={"grad_rel": 0.5})]
    row = gc.paste_row(bb.CUDNN, failed, {32768: 480.0, 131072: 500.0}, {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"})
    assert "| NOT exact (causal; worst grad_rel 0.5) | 480 | 500 | 474 |" in row  # the estimate: 0.4796 x 989


def test_the_varlen_kernel_check_runs_the_packed_row_call(gc, monkeypatch):
    """The kernels group's ``varlen`` and ``packed`` shapes end to end on CPU: cuDNN's packed-row call (stand-in ops
    bound to the installed torch's schemas, tests/test_aten_meta.py) with H100 / torch 2.15 / cuDNN 9.19 caps, in
    bf16 against per-document fp32 math (Ulysses' whole documents; thd's prefix and diagonal blocks on two ranks'
    shares); on torch 2.14 the causal documents SKIP with the reason (its varlen_attn runs cuDNN for full rows only)
    and thd's prefix blocks alone take the call."""
    from automodel.distributed.cp import block_backend as bb
    from automodel.distributed.cp import cuda_blocks
    from tests.test_aten_meta import _CudnnVarlenStandIn

    def caps_of(version):
        caps = bb.caps_for(bb.GpuInfo.named("h100"), version, 91900)
        monkeypatch.setattr(gc, "_kernel_caps", lambda device, dry: caps)
        monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: caps)
        # the CPU stands in for the GPU's bf16 blocks with its own flash kernel's numbers: the per-block path of
        # the set the packed call does not take runs the math blocks here
        monkeypatch.setattr(cuda_blocks, "select_backend", lambda *a, **k: bb.Choice(bb.MATH, "CPU stand-in"))
        return caps

    monkeypatch.setattr(cuda_blocks, "_op", _CudnnVarlenStandIn())
    caps_of("2.15.0")
    got = gc.check_kernel_exact(bb.CUDNN, "varlen", torch.bfloat16, torch.device("cpu"), False)
    assert got.status == "PASS" and got.figures["out_err"] <= gc.BF16_BAR and "cum_seq_q" in got.detail, got
    _CudnnVarlenStandIn.calls.clear()
    got = gc.check_kernel_exact(bb.CUDNN, "packed", torch.bfloat16, torch.device("cpu"), False)
    assert got.status == "PASS" and got.detail == "packed-row calls: prefix, diagonal blocks", got
    assert got.figures["out_err"] <= gc.BF16_BAR and got.figures["grad_rel"] <= gc.GRAD_BARS[torch.bfloat16], got
    assert ("_cudnn_attention_forward", True) in _CudnnVarlenStandIn.calls
    assert gc.check_kernel_exact(bb.CUDNN, "varlen", torch.float32, torch.device("cpu"), False).status == "SKIP"
    assert gc.check_kernel_exact(bb.FLASH, "packed", torch.bfloat16, torch.device("cpu"), False).status == "SKIP"
    caps_of("2.14.1")
    skip = gc.check_kernel_exact(bb.CUDNN, "varlen", torch.bfloat16, torch.device("cpu"), False)
    assert skip.status == "SKIP" and "full attention only" in skip.detail, skip
    _CudnnVarlenStandIn.calls.clear()
    got = gc.check_kernel_exact(bb.CUDNN, "packed", torch.bfloat16, torch.device("cpu"), False)
    assert got.status == "PASS" and got.detail == "packed-row calls: prefix blocks", got
    assert {c for c in _CudnnVarlenStandIn.calls} == {("_cudnn_attention_forward", False),
                                                       ("_cudnn_attention_backward", False)}
