#!/usr/bin/env python
"""The one-command GPU check: driven by scripts/gpu_check.sh (read its header first). Not part of CI.

    python scripts/gpu_check.py [--out DIR_OR_FILE] [--dry] [--budget-s 480] [--only NAME,...] [--skip NAME,...]

Runs every check in its own try/except under a per-check time budget and a total wall limit, prints ONE line
per check (``PASS`` / ``FAIL`` / ``SKIP`` / ``INFO``, its name, the figures, and for a skip the reason), and
writes a JSON summary (``gpu_check.json`` under ``--out``, or ``$OUT``, or the current directory). Exit code:
1 if any check failed, else 0. ``--dry`` is the CPU smoke mode (seconds): the backend checks with the
FlexAttention and math blocks on CPU, everything that needs CUDA reported as skipped.

Checks (docs/gpu.md says what each line means):

- ``env``: GPU, capability, torch / transformers versions, which fused ops the installed torch has.
- ``blocks/<kernel>/<kind>/<dtype>``: each CUDA block kernel (SDPA flash, SDPA efficient, FlexAttention)
  against the fp32 math blocks on random inputs, forward (output, LSE) and backward (merged-LSE explicit
  backward): causal, per-document, window, chunk, sinks, softcap, MLA, GQA; fp32 (bar 1e-5 on outputs)
  and bf16 (bar 2e-2). Also ``blocks/select``: the kernel the CUDA slot picks per kind.
- ``kernels/<kernel>/<shape>/<dtype>``: each kernel the GPU has (cuDNN, flash, memory-efficient, FlexAttention) on
  each block shape the methods use (causal square, full, causal rectangle, GQA; ``varlen``: Ulysses' whole
  documents in one call; ``packed``: thd's prefix and diagonal blocks in one packed-row cuDNN call each, two ranks'
  shares) against the fp32 math blocks, forward and backward; ``kernels/<kernel>/speed/<32k|128k>``: its causal forward+backward TFLOP/s against what
  the step estimate assumes; ``kernels/paste/<kernel>``: a row for docs/gpu.md.
- ``varlen``: one ``varlen_attn`` call against per-document blocks (causal and a window).
- ``methods/<method>/ws1``: thd, thd_docs, ulysses and ring through the recipe at world size 1 on CUDA
  (a tiny Llama, a few steps, finite loss); ``methods/ws2``: what ran for 2 processes on the one GPU.
- ``recipe/<model>/<tokens>``: the recipe at cp=1 in bf16 on random weights shaped like Llama-3.2-1B and
  Qwen3-1.7B at 8K and 32K tokens: tokens/s, MFU and peak memory against the dry run's plan.
- ``throughput/doc_blocks``: our causal per-document blocks against one SDPA flash call on the same tokens.
- ``thd_kernel/<kernel>``: thd's portable kernel (our blocks) and its ``flash_attn`` / ``te`` kernels, where they
  import, in bf16 against the portable kernel in fp32 at world size 1.
- ``te_partition``: Transformer Engine's THD partition against ours, or one line saying TE is missing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

FP32_BAR = 1e-5
BF16_BAR = 2e-2
GRAD_BARS = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
KINDS = ("causal", "per-document", "window", "chunk", "sinks", "softcap", "mla", "gqa")
#: bf16 dense peak of the GPUs lent here (H100 / H200 SXM), for the MFU
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclass
class Result:
    """One check's outcome (one printed line, one JSON entry)."""

    name: str
    status: str  # PASS | FAIL | SKIP | INFO
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        figs = " ".join(f"{k}={_fmt(v)}" for k, v in self.figures.items())
        return f"{self.status:4s} {self.name:40s} {figs} {self.detail}".rstrip()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


class Runner:
    """Runs checks with a per-check budget and a total wall limit; collects :class:`Result` s."""

    def __init__(self, budget_s: float, only: set[str] | None = None, skip: set[str] | None = None) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.only, self.skip = only, skip or set()
        self.results: list[Result] = []

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def selected(self, group: str) -> bool:
        return (self.only is None or group in self.only) and group not in self.skip

    def add(self, result: Result) -> Result:
        self.results.append(result)
        print(result.line(), flush=True)
        return result

    def run(self, group: str, name: str, fn: Callable[[], Result | list[Result] | None], budget_s: float) -> None:
        """Run ``fn`` (which returns its results) unless deselected or out of time; an exception is a FAIL line."""
        if not self.selected(group):
            self.add(Result(name, "SKIP", f"not selected (--only/--skip {group})"))
            return
        if self.left() < min(budget_s, 30.0):
            self.add(Result(name, "SKIP", f"total wall limit: {self.left():.0f} s left, this check needs ~{budget_s:.0f} s"))
            return
        t0 = time.monotonic()
        try:
            got = fn()
        except Exception as e:  # noqa: BLE001 - every failure is one line, the run goes on
            tb = traceback.format_exc().strip().splitlines()
            got = Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:300]} [{tb[-3].strip() if len(tb) > 2 else ''}]")
        took = time.monotonic() - t0
        for r in [got] if isinstance(got, Result) else list(got or []):
            r.seconds = r.seconds or took
            if took > budget_s and r.status == "PASS":
                r.detail = (r.detail + f" (over its {budget_s:.0f} s budget: {took:.0f} s)").strip()
            self.add(r)

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        return {
            "ok": counts.get("FAIL", 0) == 0,
            "counts": counts,
            "wall_s": round(time.monotonic() - self.start, 1),
            "results": [asdict(r) for r in self.results],
        }


# ---------------------------------------------------------------------------------------------------------
# arguments and output


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description="One-command GPU check (scripts/gpu_check.sh).")
    p.add_argument("--out", default=None, help="JSON summary: a directory (gpu_check.json inside) or a .json path; default $OUT or .")
    p.add_argument("--dry", action="store_true", help="CPU smoke mode: the backend checks with flex/math blocks on CPU")
    p.add_argument("--budget-s", type=float, default=480.0, help="total wall limit in seconds (default 480: 8 minutes)")
    p.add_argument("--only", default=None, help="comma-separated groups: env,blocks,kernels,varlen,methods,recipe,throughput,te,memory")
    p.add_argument("--skip", default="", help="comma-separated groups to skip")
    p.add_argument("--recipe-steps", type=int, default=4, help="training steps per recipe check (the first is warm-up)")
    p.add_argument("--memory-budget-s", type=float, default=180.0,
                   help="time of the memory check (the plan's longest row; a fraction of it when too slow)")
    args = p.parse_args(argv)
    args.only = set(filter(None, args.only.split(","))) if args.only else None
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def summary_path(out: str | None) -> Path:
    """Where the JSON summary goes: ``out`` (a ``.json`` file or a directory), else ``$OUT``, else ``.``."""
    target = out or os.environ.get("OUT") or "."
    path = Path(target)
    return path if path.suffix == ".json" else path / "gpu_check.json"


def write_summary(runner: Runner, env: dict[str, Any], path: Path) -> dict[str, Any]:
    """Write the JSON summary (``env`` + :meth:`Runner.summary`) to ``path``; returns it."""
    data = {"env": env, **runner.summary()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return data


# ---------------------------------------------------------------------------------------------------------
# env


def environment(device: torch.device) -> dict[str, Any]:
    """Versions and what the installed torch offers on ``device``."""
    from automodel.distributed.cp import cuda_blocks

    env: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(device)}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        env["transformers"] = f"unavailable: {e}"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["caps"] = asdict(cuda_blocks.cuda_caps(device))
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    env["flex"] = cuda_blocks.flex_available(device.type)
    env["varlen"] = cuda_blocks.varlen_available()
    for mod in ("flash_attn", "transformer_engine"):
        try:
            __import__(mod)
            env[mod] = True
        except Exception:  # noqa: BLE001
            env[mod] = False
    return env


# ---------------------------------------------------------------------------------------------------------
# block kernels against the fp32 math blocks


def _case(kind: str, device: torch.device, dtype: torch.dtype, n: int = 256, seed: int = 0):
    """Random ``q, k, v`` and the block keywords of one layer kind."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hq, hkv, d, dv = 8, 8, 64, 64
    if kind == "gqa":
        hkv = 2
    if kind == "mla":
        d, dv = 96, 64
    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    q, k, v = rnd(1, hq, n, d), rnd(1, hkv, n, d), rnd(1, hkv, n, dv)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None]
    kw: dict[str, Any] = {"causal": True}
    if kind == "per-document":
        doc = i // (n // 3 + 1) == j // (n // 3 + 1)
        kw = {"causal": True, "allowed": doc}
    elif kind == "window":
        kw = {"allowed": (j <= i) & (j > i - n // 4)}
    elif kind == "chunk":
        kw = {"allowed": (j <= i) & (i // (n // 3) == j // (n // 3))}
    elif kind == "sinks":
        kw = {"causal": True, "sinks": torch.randn(hq, generator=g).to(device)}
    elif kind == "softcap":
        kw = {"causal": True, "softcap": 20.0}
    return q, k, v, kw


def _kernel_takes(kernel: str, kind: str, dtype: torch.dtype) -> str | None:
    """Why ``kernel`` does not take the case (None: it does) - the selection table's rules."""
    if kernel in ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn") and kind in ("sinks", "softcap"):
        return "sinks/softcap: FlexAttention only"
    if kernel in ("sdpa_flash", "sdpa_cudnn") and kind in ("per-document", "window", "chunk"):
        return f"a mask: not the {kernel} op"
    if kernel in ("sdpa_flash", "sdpa_cudnn") and dtype == torch.float32:
        return f"fp32: not the {kernel} op"
    return None


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_block(kernel: str, kind: str, dtype: torch.dtype, device: torch.device) -> Result:
    """One kernel on one layer kind in one dtype against the fp32 math blocks (forward and backward)."""
    from automodel.distributed.cp import blocks

    name = f"blocks/{kernel}/{kind}/{str(dtype).replace('torch.', '')}"
    why = _kernel_takes(kernel, kind, dtype)
    if why:
        return Result(name, "SKIP", why)
    q, k, v, kw = _case(kind, device, dtype, n=256 if device.type == "cuda" else 48)
    q32, k32, v32 = q.float(), k.float(), v.float()
    kw32 = dict(kw)
    scale = 0.125
    ref_out, ref_lse = blocks.block_forward(q32, k32, v32, scale=scale, backend="math", **kw32)
    got = blocks.block_forward(q, k, v, scale=scale, kernel=kernel, **kw)
    out, lse = got
    e_out, e_lse = _err(out, ref_out), _err(lse, ref_lse)
    dout = torch.randn_like(ref_out)
    bw = {key: val for key, val in kw.items() if key != "sinks"}
    ref_g = blocks.block_backward(dout, q32, k32, v32, ref_out, ref_lse, scale=scale, backend="math", **bw)
    got_g = blocks.block_backward(
        dout.to(dtype), q, k, v, ref_out.to(dtype), ref_lse, scale=scale, kernel=kernel, **bw
    )
    e_grad = max(_rel(a, b) for a, b in zip(got_g, ref_g))
    bar = FP32_BAR if dtype == torch.float32 else BF16_BAR
    ok = e_out <= bar and e_grad <= GRAD_BARS[dtype] and math.isfinite(e_lse)
    return Result(name, "PASS" if ok else "FAIL", "" if ok else f"bars: out {bar}, grad {GRAD_BARS[dtype]}",
                  {"out_err": e_out, "lse_err": e_lse, "grad_rel": e_grad})


def check_selection(device: torch.device) -> Result:
    """The kernel the CUDA slot picks per layer kind (bf16): no kind may pick exact math on a GPU."""
    from automodel.distributed.cp import block_backend as bb
    from automodel.distributed.cp import cuda_blocks

    picks = {}
    for kind in KINDS:
        q, k, v, kw = _case(kind, device, torch.bfloat16, n=16)
        spec = cuda_blocks._spec(q, k, v, kw.get("causal", False), kw.get("allowed"), kw.get("sinks"), kw.get("softcap"))
        picks[kind] = bb.select_backend(device.type, spec, cuda_blocks.cuda_caps(device)).kernel
    math_kinds = [k for k, v in picks.items() if v == bb.MATH]
    status = "INFO" if device.type != "cuda" else ("FAIL" if math_kinds else "PASS")
    return Result("blocks/select", status, f"math for {math_kinds}" if math_kinds else "", picks)


def block_checks(device: torch.device, dry: bool, budget_s: float = 1e9) -> list[Result]:
    """Every available kernel x kind x dtype (``dry``: FlexAttention on CPU, fp32 only, small blocks); the SDPA
    kernels first, FlexAttention (compiled per block shape) last; past ``budget_s`` the rest is skipped."""
    deadline = time.monotonic() + budget_s
    out: list[Result] = [check_selection(device)]
    from automodel.distributed.cp import cuda_blocks

    if dry:
        try:
            import torch.nn.attention.flex_attention as fa

            fa._validate_device = lambda *a, **k: None  # CPU smoke: the eager reference supports backward
        except ImportError:
            return [*out, Result("blocks/flex", "SKIP", "torch has no FlexAttention")]
        kernels, dtypes = ["flex"], [torch.float32]
    else:
        caps = cuda_blocks.cuda_caps(device)
        kernels = [k for k, ok in (("sdpa_cudnn", caps.cudnn_op), ("sdpa_flash", caps.flash_op),
                                   ("sdpa_efficient", caps.efficient_op), ("flex", caps.flex)) if ok]
        dtypes = [torch.float32, torch.bfloat16]
    for kernel in kernels:
        for kind in KINDS:
            for dtype in dtypes:
                if time.monotonic() > deadline:
                    out.append(Result(f"blocks/{kernel}/{kind}/{str(dtype).replace('torch.', '')}", "SKIP",
                                      f"the blocks' budget ({budget_s:.0f} s) is spent"))
                    continue
                try:
                    out.append(check_block(kernel, kind, dtype, device))
                except Exception as e:  # noqa: BLE001
                    out.append(Result(f"blocks/{kernel}/{kind}/{str(dtype).replace('torch.', '')}", "FAIL",
                                      f"{type(e).__name__}: {str(e)[:200]}"))
    return out


# ---------------------------------------------------------------------------------------------------------
# each kernel the GPU has: exact against fp32 math per block shape, and its forward+backward speed

#: the block shapes the CP methods hand the kernels: ring's diagonal block (causal square), its off-diagonal
#: blocks (full), head-tail chunks and halos (a causal rectangle, lower-right aligned), GQA on the diagonal (K/V
#: grouped: cuDNN takes them as they are, the others repeated), and ``varlen``: all documents of a packed row in one
#: call (Ulysses' document blocks: cuDNN's packed-row op or flash's varlen_attn, with GQA), and ``packed``: thd's
#: gathered-K/V kernel with its prefix blocks (full) and diagonal blocks (causal) each in one packed-row cuDNN call
#: (what thd and thd_docs run where torch runs that call: block_backend.packed_choice), two ranks' shares, GQA
KERNEL_SHAPES = ("causal", "full", "rect", "gqa", "varlen", "packed")
#: the documents of the packed shape, split over 2 ranks: head-tail chunks of 150, 130 and 260 tokens (past 128)
PACKED_DOC_LENS = (600, 520, 1040)
#: the documents of the varlen shape (each past 128 tokens: cuDNN's packed-row call takes them)
VARLEN_DOC_LENS = (300, 500, 224)
#: tokens of the speed check (one row, causal): 32K and 128K on a GPU, a few hundred in --dry
SPEED_TOKENS, DRY_SPEED_TOKENS = (32768, 131072), (64, 128)
#: the speed check's heads: 16 query heads of 128 over 4 KV heads (a CP rank's share of an 8B model's 32 / 8)
SPEED_HEADS, SPEED_KV_HEADS, SPEED_HEAD_DIM = 16, 4, 128


def _shape_case(shape: str, device: torch.device, dtype: torch.dtype, n: int, seed: int = 0):
    """``q, k, v, causal`` of one block shape: ``n`` queries (``2 n`` keys for the rectangle)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hq, hkv, d = 8, (2 if shape == "gqa" else 8), 128 if device.type == "cuda" else 16
    m = 2 * n if shape == "rect" else n

    def rnd(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    return rnd(1, hq, n, d), rnd(1, hkv, m, d), rnd(1, hkv, m, d), shape != "full"


def _kernel_caps(device: torch.device, dry: bool):
    from automodel.distributed.cp import block_backend as bb
    from automodel.distributed.cp import cuda_blocks

    if dry:  # the CPU smoke mode: FlexAttention's eager form is the one kernel that runs here
        return bb.CudaCaps((9, 0), flash_op=False, efficient_op=False, flex=True, cudnn_op=False)
    return cuda_blocks.cuda_caps(device)


def kernels_of(device: torch.device, dry: bool) -> list[str]:
    """The kernels this GPU and torch have (``--dry``: FlexAttention on CPU), in the selection's order."""
    from automodel.distributed.cp import block_backend as bb

    caps = _kernel_caps(device, dry)
    have = ((bb.CUDNN, caps.cudnn_op), (bb.FLASH, caps.flash_op), (bb.EFFICIENT, caps.efficient_op), (bb.FLEX, caps.flex))
    return [k for k, ok in have if ok]


def check_kernel_exact(kernel: str, shape: str, dtype: torch.dtype, device: torch.device, dry: bool) -> Result:
    """One kernel on one block shape: forward (output, LSE) and the explicit backward (given the block's own output
    and LSE, as a merged block) against the fp32 math blocks; SKIP where the kernel does not take the shape."""
    from automodel.distributed.cp import block_backend as bb
    from automodel.distributed.cp import blocks

    name = f"kernels/{kernel}/{shape}/{str(dtype).replace('torch.', '')}"
    if shape == "varlen":
        return check_kernel_varlen(kernel, dtype, device, dry)
    if shape == "packed":
        return check_kernel_packed(kernel, dtype, device, dry)
    q, k, v, causal = _shape_case(shape, device, dtype, 512 if device.type == "cuda" and not dry else 32)
    spec = bb.BlockSpec(dtype, q.shape[-1], v.shape[-1], causal=causal, square=q.shape[2] == k.shape[2],
                        grouped=q.shape[1] != k.shape[1])  # fmt: skip
    why = bb.pin_problem(kernel, spec, _kernel_caps(device, dry))
    if why:
        return Result(name, "SKIP", why)
    scale = q.shape[-1] ** -0.5
    q32, k32, v32 = q.float(), k.float(), v.float()
    ref_out, ref_lse = blocks.block_forward(q32, k32, v32, causal=causal, scale=scale, backend="math")
    out, lse = blocks.block_forward(q, k, v, causal=causal, scale=scale, kernel=kernel)
    dout = torch.randn_like(ref_out)
    ref_g = blocks.block_backward(dout, q32, k32, v32, ref_out, ref_lse, causal=causal, scale=scale, backend="math")
    got_g = blocks.block_backward(dout.to(dtype), q, k, v, ref_out.to(dtype), ref_lse, causal=causal, scale=scale,
                                  kernel=kernel)  # fmt: skip
    e_out, e_lse = _err(out, ref_out), _err(lse, ref_lse)
    e_grad = max(_rel(a, b) for a, b in zip(got_g, ref_g))
    bar = FP32_BAR if dtype == torch.float32 else BF16_BAR
    ok = e_out <= bar and e_grad <= GRAD_BARS[dtype] and e_lse <= max(bar, 1e-4)
    return Result(name, "PASS" if ok else "FAIL", "" if ok else f"bars: out {bar}, lse {max(bar, 1e-4)}, grad {GRAD_BARS[dtype]}",
                  {"out_err": e_out, "lse_err": e_lse, "grad_rel": e_grad})


def check_kernel_varlen(kernel: str, dtype: torch.dtype, device: torch.device, dry: bool) -> Result:
    """One packed row of three causal documents (:data:`VARLEN_DOC_LENS`, 8 query heads over 2 KV heads) in ONE call
    of ``kernel`` (``cuda_blocks.varlen_documents`` with the kernel pinned: cuDNN's packed-row op or flash's
    ``varlen_attn``), forward and backward (autograd, the call's own backward) against per-document fp32 math; SKIP
    with the selection's reason where the kernel has no packed-row call here."""
    from automodel.distributed.cp import attention_kernels as ak
    from automodel.distributed.cp import block_backend as bb
    from automodel.distributed.cp import blocks, cuda_blocks

    name = f"kernels/{kernel}/varlen/{str(dtype).replace('torch.', '')}"
    if dry:
        return Result(name, "SKIP", "a packed-row call needs CUDA (--dry runs FlexAttention only)")
    d, hq, hkv, lens = 128, 8, 2, VARLEN_DOC_LENS
    caps = _kernel_caps(device, dry)
    spec = bb.BlockSpec(dtype, d, d, causal=True, grouped=True)
    choice = bb.varlen_choice(spec, caps, kernel, max_len=max(lens))
    if choice is None or choice.kernel != kernel:
        return Result(name, "SKIP", bb.varlen_refusal(spec, caps, kernel, max_len=max(lens)))
    g = torch.Generator(device="cpu").manual_seed(0)
    t = sum(lens)
    q32 = torch.randn(t, hq, d, generator=g)
    k32, v32 = (torch.randn(t, hkv, d, generator=g) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = d**-0.5
    leaves = [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (q32, k32, v32)]
    ak._PINNED.append(kernel)  # what attention_backend_context pushes for model.attention_backend=<kernel>
    try:
        out = cuda_blocks.varlen_documents(*leaves, cu, max(lens), True, None, scale)
    finally:
        ak._PINNED.pop()
    if out is None:
        return Result(name, "SKIP", "varlen_documents took no packed-row call (see the log line of this layer kind)")
    refs = [x.to(device).requires_grad_(True) for x in (q32, k32, v32)]
    ref = torch.cat([blocks.block_forward(*(x[a:b].transpose(0, 1)[None] for x in refs), causal=True, scale=scale,
                                          backend="math")[0][0].transpose(0, 1)
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])  # fmt: skip
    dout = torch.randn(ref.shape, generator=g).to(device)
    got_g = torch.autograd.grad(out, leaves, dout.to(dtype))
    ref_g = torch.autograd.grad(ref, refs, dout)
    e_out = _err(out, ref)
    e_grad = max(_rel(a, b) for a, b in zip(got_g, ref_g))
    bar = FP32_BAR if dtype == torch.float32 else BF16_BAR
    ok = e_out <= bar and e_grad <= GRAD_BARS[dtype]
    return Result(name, "PASS" if ok else "FAIL", choice.reason if ok else f"bars: out {bar}, grad {GRAD_BARS[dtype]}",
                  {"out_err": e_out, "grad_rel": e_grad})


def check_kernel_packed(kernel: str, dtype: torch.dtype, device: torch.device, dry: bool) -> Result:
    """thd's gathered-K/V kernel (``gathered_attention._portable_forward`` / ``_backward``) on both ranks' shares of a
    row of three documents (:data:`PACKED_DOC_LENS`, 8 query heads over 2 KV heads; over 8 where the packed call
    takes equal heads only, torch 2.14) with ``kernel`` pinned: its
    prefix and diagonal blocks each in ONE packed-row call where ``block_backend.packed_choice`` takes them (cuDNN,
    torch >= 2.14; the diagonal blocks from 2.15), the other set per block; output and dQ / dK / dV against each
    document's causal fp32 math alone. SKIP with the reason where neither set takes the packed call."""
    from automodel.distributed.cp import attention_kernels as ak
    from automodel.distributed.cp import block_backend as bb
    from automodel.distributed.cp import blocks
    from automodel.distributed.cp import gathered_attention as ga
    from automodel.distributed.cp.layout import head_tail_indices

    name = f"kernels/{kernel}/packed/{str(dtype).replace('torch.', '')}"
    if dry:
        return Result(name, "SKIP", "a packed-row call needs CUDA (--dry runs FlexAttention only)")
    caps = _kernel_caps(device, dry)
    # 8 query heads over 2 KV heads where the packed call takes grouped K/V (torch 2.15), else 8 over 8 (2.14's gate)
    d, hq, hkv, lens, world = 128, 8, 2 if caps is not None and caps.cudnn_varlen_gqa else 8, PACKED_DOC_LENS, 2
    max_q = max(lens) // (2 * world)
    taken = [what for what, causal in (("prefix", False), ("diagonal", True))
             if bb.packed_choice(bb.BlockSpec(dtype, d, d, causal=causal, grouped=hkv < hq), caps, kernel,
                                 causal=causal, max_q=max_q)]  # fmt: skip
    if not taken:
        spec = bb.BlockSpec(dtype, d, d, grouped=hkv < hq)
        return Result(name, "SKIP", bb.packed_refusal(spec, caps, kernel, causal=False, max_q=max_q))
    g = torch.Generator(device="cpu").manual_seed(0)
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    t, scale = cu[-1], d**-0.5
    q32 = torch.randn(t, hq, d, generator=g).to(device)
    k32, v32 = (torch.randn(t, hkv, d, generator=g).to(device) for _ in range(2))
    refs = [x.clone().requires_grad_(True) for x in (q32, k32, v32)]
    ref = torch.cat([blocks.block_forward(*(x[a:b].transpose(0, 1)[None] for x in refs), causal=True, scale=scale,
                                          backend="math")[0][0].transpose(0, 1)
                     for a, b in zip(cu[:-1], cu[1:])])  # fmt: skip
    e_out = e_grad = 0.0
    for rank in range(world):
        plan = ga.THDPlan(None, world, rank, cu, cu, max(lens))
        local = head_tail_indices(torch.tensor(cu), world, rank).to(device)
        q = q32[local].to(dtype).transpose(0, 1).unsqueeze(0)
        kh, vh = (x.to(dtype).transpose(0, 1).unsqueeze(0) for x in (k32, v32))
        dout = torch.zeros_like(q32)
        dout[local] = torch.randn(len(local), hq, d, generator=g).to(device)
        ak._PINNED.append(kernel)  # what attention_backend_context pushes for model.attention_backend=<kernel>
        try:
            out, lse = ga._portable_forward(q, kh, vh, plan, scale)
            got = ga._portable_backward(dout[local].to(dtype).transpose(0, 1).unsqueeze(0), q, kh, vh, out, lse, plan,
                                        scale)  # fmt: skip
        finally:
            ak._PINNED.pop()
        want = torch.autograd.grad(ref, refs, dout, retain_graph=True)
        e_out = max(e_out, _err(out[0].transpose(0, 1), ref[local].detach()))
        pairs = zip((got[0][0].transpose(0, 1), got[1][0].transpose(0, 1), got[2][0].transpose(0, 1)),
                    (want[0][local], want[1], want[2]))  # fmt: skip
        e_grad = max(e_grad, *(_rel(a, b) for a, b in pairs))
    bar = FP32_BAR if dtype == torch.float32 else BF16_BAR
    ok = e_out <= bar and e_grad <= GRAD_BARS[dtype]
    detail = f"packed-row calls: {', '.join(taken)} blocks"
    return Result(name, "PASS" if ok else "FAIL", detail if ok else f"{detail}; bars: out {bar}, grad {GRAD_BARS[dtype]}",
                  {"out_err": e_out, "grad_rel": e_grad})


def kernel_tflops(kernel: str, tokens: int, device: torch.device, iters: int = 3) -> tuple[float, float]:
    """``(TFLOP/s, seconds)`` of one causal forward+backward over one row of ``tokens`` with ``kernel`` (our block
    glue under autograd, as the methods run it), bf16 on a GPU (fp32 on CPU), FLOPs counted as the estimate counts
    them: causal halved, backward twice the forward (``3 x 2 S^2 H D``)."""
    from automodel.distributed.cp import blocks

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    d = SPEED_HEAD_DIM if device.type == "cuda" else 16
    q = torch.randn(1, SPEED_HEADS, tokens, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, SPEED_KV_HEADS, tokens, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, SPEED_HEADS, tokens, d, device=device, dtype=dtype)

    def step() -> None:
        out, _ = blocks.block_forward(q, k, v, causal=True, kernel=kernel)
        torch.autograd.backward(out, dout)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / iters
    flops = 3 * 2.0 * tokens * tokens * SPEED_HEADS * d
    return flops / seconds / 1e12, seconds


def _estimate_tflops(kernel: str, gpu_name: str) -> float | None:
    """What the step estimate assumes for ``kernel`` on this GPU (forward + backward, no recompute), TFLOP/s."""
    from automodel.config.gpu_specs import GPU_SPECS
    from automodel.training.attention_speed import kernel_speed

    if not gpu_name:  # no GPU (--dry): the estimate is for GPUs
        return None
    key = gpu_type_for(gpu_name)
    if key not in GPU_SPECS:
        return None
    spec = GPU_SPECS[key]
    return kernel_speed(kernel, spec).fraction(False) * spec.bf16_tflops


#: the header of docs/gpu.md's "Attention kernels measured" table, whose rows kernel_checks prints
PASTE_HEADER = ("| date | GPU | torch | kernel | against fp32 math (bf16 and fp32 where taken) | TFLOP/s 32K | "
                "TFLOP/s 128K | the estimate's |")


def paste_row(kernel: str, exact: list[Result], speed: dict[int, float], env: dict[str, Any]) -> str:
    """One markdown row for docs/gpu.md's "Attention kernels measured" table (:data:`PASTE_HEADER`)."""
    ran = [r for r in exact if r.status in ("PASS", "FAIL")]
    verdict = "exact" if ran and all(r.status == "PASS" for r in ran) else ("NOT exact" if ran else "not run")
    shapes = ", ".join(sorted({r.name.split("/")[2] for r in ran}))
    worst = max((r.figures.get("grad_rel", 0.0) for r in ran), default=float("nan"))
    figs = " | ".join(f"{speed[t]:.3g}" if t in speed else "-" for t in sorted(speed) or SPEED_TOKENS)
    est = _estimate_tflops(kernel, env.get("gpu", ""))
    return (f"| {time.strftime('%Y-%m-%d')} | {env.get('gpu', env.get('device'))} | {env.get('torch')} | {kernel} | "
            f"{verdict} ({shapes}; worst grad_rel {worst:.2g}) | {figs} | {f'{est:.0f}' if est else '-'} |")


def kernel_checks(device: torch.device, dry: bool, budget_s: float = 1e9, env: dict[str, Any] | None = None) -> list[Result]:
    """Per kernel the GPU has: exactness on every block shape in bf16 (and fp32 where the kernel takes it), then
    forward+backward TFLOP/s at 32K and 128K tokens (``dry``: FlexAttention on CPU, small blocks, a few hundred
    tokens), then one ``kernels/paste/<kernel>`` line: a docs/gpu.md table row. FlexAttention compiles per shape,
    so it goes last; past ``budget_s`` the rest is skipped with the reason."""
    deadline = time.monotonic() + budget_s
    env = env or {"device": str(device), "torch": torch.__version__}
    out: list[Result] = []
    dtypes = [torch.float32] if dry else [torch.bfloat16, torch.float32]
    tokens = DRY_SPEED_TOKENS if dry else SPEED_TOKENS
    if dry:
        import torch.nn.attention.flex_attention as fa

        fa._validate_device = lambda *a, **k: None  # CPU smoke: the eager reference supports backward
    for kernel in kernels_of(device, dry):
        exact: list[Result] = []
        speed: dict[int, float] = {}
        for shape in KERNEL_SHAPES:
            for dtype in dtypes:
                name = f"kernels/{kernel}/{shape}/{str(dtype).replace('torch.', '')}"
                if time.monotonic() > deadline:
                    exact.append(Result(name, "SKIP", f"the kernels' budget ({budget_s:.0f} s) is spent"))
                    continue
                try:
                    exact.append(check_kernel_exact(kernel, shape, dtype, device, dry))
                except Exception as e:  # noqa: BLE001
                    exact.append(Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:200]}"))
        out += exact
        for t in tokens:
            name = f"kernels/{kernel}/speed/{t // 1024}k" if t >= 1024 else f"kernels/{kernel}/speed/{t}"
            if time.monotonic() > deadline:
                out.append(Result(name, "SKIP", f"the kernels' budget ({budget_s:.0f} s) is spent"))
                continue
            try:
                tf, sec = kernel_tflops(kernel, t, device, iters=1 if dry else 3)
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: one line, the next kernel goes on
                out.append(Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            speed[t] = tf
            est = _estimate_tflops(kernel, env.get("gpu", ""))
            figs = {"tflops": tf, "s_per_fwd_bwd": sec} | ({"estimate_tflops": est, "vs_estimate": tf / est} if est else {})
            out.append(Result(name, "INFO", "causal fwd+bwd, 1 row, 16 heads / 4 KV heads" + (" (dry: CPU)" if dry else ""), figs))
        out.append(Result(f"kernels/paste/{kernel}", "INFO", paste_row(kernel, exact, speed, env)))
    if out:
        out.append(Result("kernels/paste/header", "INFO", PASTE_HEADER))
    return out


def check_varlen(device: torch.device) -> list[Result]:
    """One varlen_attn call over 3 documents against per-document blocks (causal, and a 64-token window)."""
    from automodel.distributed.cp import blocks, cuda_blocks

    if not cuda_blocks.varlen_available():
        return [Result("varlen", "SKIP", "torch.nn.attention.varlen.varlen_attn not in this torch")]
    lens = [300, 500, 224]
    t = sum(lens)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, 8, 64, generator=g).to(device, torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    res = []
    for window in (None, 64):
        got = cuda_blocks.varlen_documents(q, k, v, cu, max(lens), True, window, 0.125)
        if got is None:
            res.append(Result(f"varlen/window={window}", "SKIP", "varlen_applies() is False on this device"))
            continue
        refs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = (x[a:b].transpose(0, 1)[None].float() for x in (q, k, v))
            allowed = None
            if window is not None:
                i = torch.arange(b - a, device=device)[:, None]
                allowed = torch.arange(b - a, device=device)[None] > i - window
            refs.append(blocks.block_forward(qs, ks, vs, causal=True, scale=0.125, allowed=allowed, backend="math")[0][0].transpose(0, 1))
        e = _err(got, torch.cat(refs))
        res.append(Result(f"varlen/window={window}", "PASS" if e <= BF16_BAR else "FAIL", "", {"out_err": e}))
    return res


# ---------------------------------------------------------------------------------------------------------
# the recipe


def _recipe(config: str, overrides: list[str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, str(ROOT / "recipes" / "finetune.py"), "--config", str(ROOT / config), *overrides]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


def _tail(text: str, n: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[-n:])[-400:]


_STEP = re.compile(r"step (\d+)/\d+ \| loss ([\d.naninf]+) .*?\| ([\d.]+) tokens/s .*?\| ([\d.]+) s/step \| peak mem ([\d.]+) GiB")


def parse_steps(text: str) -> list[dict[str, float]]:
    """The recipe's step lines as ``{step, loss, tokens_per_s, step_time_s, peak_mem_gib}`` records."""
    return [
        {"step": int(m[1]), "loss": float(m[2]), "tokens_per_s": float(m[3]), "step_time_s": float(m[4]), "peak_mem_gib": float(m[5])}
        for m in _STEP.finditer(text)
    ]


def parse_plan(text: str) -> dict[str, float]:
    """From a dry run's report: the planned total memory per rank (GiB), the estimated step time (s) and the
    compute per step (TFLOP), where it states them."""
    plan: dict[str, float] = {}
    units = {"ms": 1e-3, "s": 1.0, "MiB": 1 / 1024, "GiB": 1.0, "TiB": 1024.0}
    for key, pattern in (
        ("plan_total_gib", r"total ([\d.]+) (MiB|GiB|TiB) per rank"),
        ("plan_step_s", r"estimated step time: ([\d.]+) (ms|s)\b"),
        ("plan_tflop", r"compute: ([\d.]+) TFLOP per rank per step"),
    ):
        m = re.search(pattern, text)
        if m:
            plan[key] = float(m[1]) * (units[m[2]] if m.lastindex == 2 else 1.0)
    return plan


_MODELS = {"llama3.2-1b": "configs/llama3_2_1b_32k_cp4.yaml", "qwen3-1.7b": "configs/qwen3_1_7b_64k_cp8.yaml"}


def _common_overrides(out_root: str, steps: int) -> list[str]:
    return [
        "model.pretrained_model_name_or_path=null", "data.tokenizer=null", "distributed.cp_size=1",
        "recipe.gpus=1", "recipe.cp_self_check=false", f"recipe.output_root={out_root}",
        "step_scheduler.global_batch_size=1", "step_scheduler.local_batch_size=1", f"step_scheduler.max_steps={steps}",
        "step_scheduler.val_every_steps=null", "step_scheduler.ckpt_every_steps=null", "checkpoint.enabled=false",
        "export.enabled=false", "logging.progress_bar=false", "logging.plot=false", "lr_scheduler.warmup_steps=0", "loss.chunk_tokens=4096",
    ]


def _flops_per_token(cfg_path: str, seq: int) -> float | None:
    """6 N (dense parameters, embeddings excluded) + causal attention's 6 * L * S * H * Dh per token."""
    try:
        import yaml

        m = yaml.safe_load((ROOT / cfg_path).read_text())["model"]["config"]
        h, layers, inter = m["hidden_size"], m["num_hidden_layers"], m["intermediate_size"]
        dh = m.get("head_dim") or h // m["num_attention_heads"]
        nq, nkv = m["num_attention_heads"], m["num_key_value_heads"]
        per_layer = h * dh * (2 * nq + 2 * nkv) + 3 * h * inter
        return 6.0 * layers * per_layer + 6.0 * layers * seq * nq * dh + 6.0 * h * m["vocab_size"]
    except Exception:  # noqa: BLE001
        return None


def check_recipe(model: str, seq: int, steps: int, budget: float, gpu_name: str) -> Result:
    """The recipe at cp=1, bf16, random weights: tokens/s, MFU, peak memory against the dry run's plan."""
    name = f"recipe/{model}/{seq // 1024}k"
    cfg = _MODELS[model]
    with tempfile.TemporaryDirectory() as tmp:
        over = [*_common_overrides(tmp, steps), f"data.seq_len={seq}", "logging.log_every_steps=1"]
        rc_plan, plan_text = _recipe(cfg, [*over, "recipe.dry_run=true", "recipe.dry_run_world_size=1"], min(120.0, budget / 3))
        rc, text = _recipe(cfg, over, budget)
    steps_seen = parse_steps(text)
    if rc != 0 or not steps_seen:
        return Result(name, "FAIL", f"rc={rc}: {_tail(text)}")
    last = steps_seen[-1]
    figs: dict[str, Any] = {"tokens_per_s": last["tokens_per_s"], "peak_gib": last["peak_mem_gib"], "loss": last["loss"]}
    plan = parse_plan(plan_text) if rc_plan == 0 else {}
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in gpu_name), None)
    if peak and "plan_tflop" in plan:  # the dry run's FLOP count over the measured step time
        figs["mfu"] = plan["plan_tflop"] * 1e12 / last["step_time_s"] / peak
    elif peak and (fpt := _flops_per_token(cfg, seq)):
        figs["mfu"] = last["tokens_per_s"] * fpt / peak
    figs.update(plan)
    if "plan_total_gib" in plan:
        figs["peak_vs_plan"] = last["peak_mem_gib"] / max(plan["plan_total_gib"], 1e-9)
    if "plan_step_s" in plan:
        figs["step_vs_plan"] = last["step_time_s"] / max(plan["plan_step_s"], 1e-9)
    ok = math.isfinite(last["loss"])
    detail = "" if rc_plan == 0 else f"dry run rc={rc_plan}: {_tail(plan_text, 1)}"
    return Result(name, "PASS" if ok else "FAIL", detail, figs)


def _tiny_llama(device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def _doc_batch(lengths: list[int], device: torch.device) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 256, (n + 1,), generator=g) for n in lengths]
    batch = {"input_ids": torch.cat([d[:-1] for d in docs]).unsqueeze(0),
             "labels": torch.cat([d[1:] for d in docs]).unsqueeze(0),
             "position_ids": torch.cat([torch.arange(len(d) - 1) for d in docs]).unsqueeze(0)}
    return batch, docs


def _method_api(method: str):
    """``(switch(model), make_batch_and_ctx(mesh, batch))`` of a method's own-loop API (world size 1: mesh None)."""
    if method == "thd":
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        return set_thd_attention, make_thd_batch_and_ctx
    if method == "thd_docs":
        from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention

        return set_doc_attention, make_doc_batch_and_ctx
    if method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        return set_ulysses_attention, make_ulysses_batch_and_ctx
    from automodel.distributed.cp.ring.batch import make_cp_batch_and_ctx

    return (lambda model: None), make_cp_batch_and_ctx


def check_method(method: str, device: torch.device, dtype: torch.dtype) -> Result:
    """One CP method's attention at world size 1 (its own-loop API, no process group) on ``device``: the loss and
    every parameter gradient against the model run on each document alone (ring: one document per row)."""
    name = f"methods/{method}/ws1/{str(dtype).replace('torch.', '')}"
    lengths = [1000] if method == "ring" else [300, 18, 640, 90]
    batch, docs = _doc_batch(lengths, device)
    if method != "ring":
        batch["seq_lens"] = batch["seq_lens_padded"] = torch.tensor([lengths])
    ref_model = _tiny_llama(device, dtype)
    total = sum(lengths)
    ref_loss = 0.0
    for d in docs:
        logits = ref_model(input_ids=d[:-1][None].to(device)).logits.float()
        part = torch.nn.functional.cross_entropy(logits[0], d[1:].to(device), reduction="sum") / total
        part.backward()
        ref_loss += float(part.detach())
    model = _tiny_llama(device, dtype)
    switch, make = _method_api(method)
    switch(model)
    ctx, local = make(None, batch)
    with ctx():
        logits = model(input_ids=local["input_ids"].to(device), position_ids=local["position_ids"].to(device)).logits
    loss = torch.nn.functional.cross_entropy(logits[0].float(), local["labels"][0].to(device), reduction="sum",
                                             ignore_index=-100) / total
    loss.backward()
    e_loss = abs(float(loss.detach()) - ref_loss) / abs(ref_loss)
    e_grad = max(_rel(p.grad, r.grad) for p, r in zip(model.parameters(), ref_model.parameters()))
    bars = (1e-5, 1e-4) if dtype == torch.float32 else (2e-2, 5e-2)
    ok = e_loss <= bars[0] and e_grad <= bars[1]
    return Result(name, "PASS" if ok else "FAIL", "" if ok else f"bars: loss {bars[0]}, grads {bars[1]}",
                  {"loss_rel": e_loss, "grad_rel": e_grad})


def ws2_worker(method: str, backend: str, port: int, rank: int, out: str) -> int:
    """One of 2 processes on the one GPU: ``method`` through ``context_parallel`` over a 2-rank group of
    ``backend``; rank 0 writes the loss / gradient errors against each document alone to ``out`` (JSON)."""
    import torch.distributed as dist

    from automodel.distributed.cp import context_parallel

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # cpu: a dry test
    if device.type == "cuda":
        torch.cuda.set_device(device)
    lengths = [1000] if method == "ring" else [300, 18, 640, 90]
    batch, docs = _doc_batch(lengths, device)
    if method != "ring":
        batch["seq_lens"] = batch["seq_lens_padded"] = torch.tensor([lengths])
    model = _tiny_llama(device, torch.float32)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (2,), mesh_dim_names=("cp",))
    cp = context_parallel(model, mesh, method=method)
    ctx, local = cp.shard(batch)
    local = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in local.items()}
    with ctx():
        loss = model(**local).loss
        loss.backward()
    cp.reduce_gradients()
    loss = float(cp.reduce_loss(loss.detach()))
    if rank == 0:
        ref_model, total, ref_loss = _tiny_llama(device, torch.float32), sum(lengths), 0.0
        for d in docs:
            logits = ref_model(input_ids=d[:-1][None].to(device)).logits.float()
            part = torch.nn.functional.cross_entropy(logits[0], d[1:].to(device), reduction="sum") / total
            part.backward()
            ref_loss += float(part.detach())
        e_grad = max(_rel(p.grad, r.grad) for p, r in zip(model.parameters(), ref_model.parameters()))
        Path(out).write_text(json.dumps({"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": e_grad}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def check_ws2(method: str, timeout: float, backends: list[str]) -> Result:
    """``method`` with 2 processes on the one GPU: the first of ``backends`` that runs (NCCL if it allows two
    ranks on one device, else gloo with CUDA tensors); the line says which ran. A backend that failed is
    removed from ``backends`` (mutated), so the next method does not try it again."""
    tried = []
    for backend in list(backends):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            port = 29600 + (os.getpid() + len(tried) * 7) % 300
            env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
            procs = [subprocess.Popen([sys.executable, __file__, "--ws2-worker", method, backend, str(port), str(r), str(out)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for r in range(2)]
            logs = []
            for p in procs:
                try:
                    logs.append(p.communicate(timeout=timeout / 2)[0])
                except subprocess.TimeoutExpired:
                    p.kill()
                    logs.append(f"timed out after {timeout / 2:.0f} s")
            if out.exists() and all(p.returncode == 0 for p in procs):
                figs = json.loads(out.read_text())
                ok = figs["loss_rel"] <= 1e-5 and figs["grad_rel"] <= 1e-4
                ran = f"ran: {backend}" + (f" (after {', '.join(tried)})" if tried else "")
                return Result(f"methods/{method}/ws2", "PASS" if ok else "FAIL", ran, figs)
            tried.append(f"{backend} failed: {_tail(' '.join(logs), 1)[:160]}")
            if len(backends) > 1:
                backends.remove(backend)
    return Result(f"methods/{method}/ws2", "FAIL", "; ".join(tried))


def check_methods(device: torch.device) -> list[Result]:
    """thd, thd_docs, ulysses and ring at world size 1 on ``device`` (fp32 and bf16)."""
    res = []
    for method in ("thd", "thd_docs", "ulysses", "ring"):
        for dtype in (torch.float32, torch.bfloat16):
            try:
                res.append(check_method(method, device, dtype))
            except Exception as e:  # noqa: BLE001
                res.append(Result(f"methods/{method}/ws1/{str(dtype).replace('torch.', '')}", "FAIL",
                                  f"{type(e).__name__}: {str(e)[:300]}"))
    return res


def check_methods_ws2(budget: float) -> list[Result]:
    """The four methods with 2 processes on the one GPU, within ``budget`` seconds."""
    backends, res, deadline = ["nccl", "gloo"], [], time.monotonic() + budget
    for i, method in enumerate(("thd_docs", "ring", "ulysses", "thd")):
        left = deadline - time.monotonic()
        if left < 20:
            res.append(Result(f"methods/{method}/ws2", "SKIP", "the 2-process checks' budget is spent"))
            continue
        res.append(check_ws2(method, left / (4 - i), backends))
    return res


# ---------------------------------------------------------------------------------------------------------
# throughput and TE


def _time(fn: Callable[[], Any], iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def check_throughput(device: torch.device) -> list[Result]:
    """Forward+backward of causal attention over 32K packed tokens (8 documents of 4K): our per-document blocks
    (blocks.block_forward per document, and varlen_documents) against one SDPA flash call on one 4K row x 8."""
    from automodel.distributed.cp import blocks, cuda_blocks

    h, d, docs, length = 16, 64, 8, 4096
    q, k, v = (torch.randn(1, h, docs * length, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    flops = 4 * docs * length * length * h * d / 2 * 3.5  # causal fwd + bwd (~2.5x fwd)

    def ours():
        outs = [blocks.block_forward(q[:, :, i * length:(i + 1) * length], k[:, :, i * length:(i + 1) * length],
                                     v[:, :, i * length:(i + 1) * length], causal=True)[0] for i in range(docs)]
        torch.autograd.backward(torch.cat(outs, 2), dout)

    def sdpa():
        qs, ks, vs = (x.view(1, h, docs, length, d).transpose(1, 2).reshape(docs, h, length, d) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        torch.autograd.backward(o, dout.view(1, h, docs, length, d).transpose(1, 2).reshape(docs, h, length, d))

    res = []
    t_ours, t_sdpa = _time(ours), _time(sdpa)
    res.append(Result("throughput/doc_blocks", "INFO", "our per-document blocks vs one SDPA call (same tokens)",
                      {"ours_tflops": flops / t_ours / 1e12, "sdpa_tflops": flops / t_sdpa / 1e12, "ratio": t_sdpa / t_ours}))
    if cuda_blocks.varlen_available():
        qt, kt, vt = (x.detach()[0].transpose(0, 1).contiguous().requires_grad_(True) for x in (q, k, v))
        cu = torch.arange(0, docs + 1, device=device, dtype=torch.int32) * length

        def varlen():
            o = cuda_blocks.varlen_documents(qt, kt, vt, cu, length, True, None, None)
            torch.autograd.backward(o, dout[0].transpose(0, 1))

        t_var = _time(varlen)
        res.append(Result("throughput/varlen", "INFO", "one varlen_attn call vs one SDPA call",
                          {"varlen_tflops": flops / t_var / 1e12, "ratio": t_sdpa / t_var}))
    return res


def check_thd_kernels(device: torch.device) -> list[Result]:
    """thd's kernels at world size 1 in bf16 against its portable kernel in fp32 (our blocks, now fused on CUDA):
    the portable kernel itself, and ``flash_attn`` / ``te`` where their packages import (else one SKIP line)."""
    from automodel.distributed.cp.gathered_attention import THDPlan, thd_attention

    lens = [1, 22, 13, 7, 40]
    padded = [-(-n // 2) * 2 for n in lens]
    cu_p, cu = [0], [0]
    for n, p in zip(lens, padded):
        cu_p.append(cu_p[-1] + p)
        cu.append(cu[-1] + n)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, h, cu_p[-1], 64, generator=g).to(device) for h in (8, 2, 2)]
    dout = torch.randn(1, 8, cu_p[-1], 64, generator=g).to(device)

    def run(kernel: str, dtype: torch.dtype) -> list[torch.Tensor]:
        plan = THDPlan(None, 1, 0, cu_p, cu, max(padded), kernel=kernel)
        q, k, v = (t.to(dtype).detach().requires_grad_() for t in full)
        out = thd_attention(q, k, v, plan)
        out.backward(dout.to(out.dtype))
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    ref = run("portable", torch.float32)
    res = []
    for kernel, package in (("portable", None), ("flash_attn", "flash_attn"), ("te", "transformer_engine")):
        name = f"thd_kernel/{kernel}/bfloat16"
        if package is not None:
            try:
                __import__(package)
            except Exception as e:  # noqa: BLE001
                res.append(Result(name, "SKIP", f"{package} not importable ({type(e).__name__})"))
                continue
        try:
            errs = [_rel(a, b) for a, b in zip(run(kernel, torch.bfloat16), ref)]
            res.append(Result(name, "PASS" if max(errs) <= BF16_BAR else "FAIL", "vs portable fp32",
                              dict(zip(("out_rel", "dq_rel", "dk_rel", "dv_rel"), errs))))
        except Exception as e:  # noqa: BLE001
            res.append(Result(name, "FAIL", f"{type(e).__name__}: {str(e)[:200]}"))
    return res


def check_te_partition() -> Result:
    """TE's THD partition indices against ours, if Transformer Engine imports."""
    try:
        import transformer_engine.pytorch as te  # noqa: F401
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001
        return Result("te_partition", "SKIP", f"Transformer Engine not importable ({type(e).__name__}); ours is tested on CPU")
    from automodel.distributed.thd_utils import thd_partition_indices

    bad = 0
    for world in (1, 2, 4, 8):
        lens = torch.tensor([0, 4 * world, 12 * world, 20 * world], dtype=torch.int32)
        cu = lens.cumsum(0).to(torch.int32).cuda()
        for rank in range(world):
            theirs = tex.thd_get_partitioned_indices(cu, int(cu[-1]), world, rank).cpu()
            ours = thd_partition_indices(cu.cpu(), int(cu[-1]), world, rank)
            bad += int(not torch.equal(theirs.long(), torch.as_tensor(ours).long()))
    return Result("te_partition", "PASS" if bad == 0 else "FAIL", "", {"mismatches": bad})


# ---------------------------------------------------------------------------------------------------------
# memory: the plan's longest row for this GPU, measured


MEMORY_CONFIG = "configs/llama3_2_1b_32k_cp4.yaml"  # the Llama-3.2-1B shape (model.config), random weights
MEMORY_SKIP_ENV = "GPU_CHECK_SKIP_MEMORY"  # set to 1 to skip the memory check
#: the measured allocated peak may exceed the plan (persistent + step peak) by this fraction before a FAIL
MEMORY_TOLERANCE = 0.10
_MEMORY_OVERRIDES = ["model.pretrained_model_name_or_path=null", "data.tokenizer=null", "recipe.gpus=1",
                     "distributed.cp_size=1"]  # fmt: skip


def gpu_type_for(name: str) -> str:
    """The plan's GPU type for a device name (``"NVIDIA H200"`` -> ``"h200"``); ``"h100"`` when unknown (its
    spec gives the step estimate; the capacity comes from the device itself)."""
    from automodel.training.plan_search import DEVICE_MEMORY_MIB

    low = name.lower()
    return next((k for k in DEVICE_MEMORY_MIB if k in low), "h100")


def memory_row(gpu_type: str, capacity_gib: float | None, steps: int, time_s: float) -> dict[str, Any]:
    """CPU-side: the longest row ``automodel plan`` finds for one GPU of ``capacity_gib`` (all technique sets),
    and the row length the check runs: the whole row when ``steps`` steps of it fit ``time_s`` by the plan's
    step estimate, else the longest fraction (1/2, 1/4, ...) that does, with the plan computed for that length.

    Returns: ``row`` (tokens), ``seq`` (tokens run), ``fraction``, ``techniques`` (the set's short form),
    ``overrides`` (the recipe's keys for the layout and the set), ``plan_persistent_gib``,
    ``plan_step_peak_gib``, ``plan_total_gib``, ``plan_host_gib``, ``est_step_s`` (at ``seq``) and
    ``row_step_s`` (at the whole row).
    """
    from automodel.training.memory_plan import plan_memory
    from automodel.training.plan_search import build_search, longest_row

    search, _, _, _ = build_search(str(ROOT / MEMORY_CONFIG), list(_MEMORY_OVERRIDES), 1, gpu_type, capacity_gib)
    best = longest_row(search.search())
    if best.tokens <= 0:
        raise ValueError(f"the plan fits no row of {MEMORY_CONFIG} on one {gpu_type} ({capacity_gib} GiB)")
    layout, t = best.layout, best.techniques
    m = max(search.row_multiple(layout), 1024)
    seq, fraction = best.tokens, 1
    while seq > m and steps * search.estimate(layout, t, seq)[0] > time_s:
        fraction *= 2
        seq = max(m, best.tokens // fraction // m * m)
    plan = plan_memory(search.d, search.shape(layout, t, seq))
    gib = 2**30
    return {
        "row": best.tokens, "seq": seq, "fraction": fraction, "techniques": t.text(layout.tp),
        "overrides": [*layout.overrides(), *t.overrides(layout.tp)],
        "plan_persistent_gib": plan.persistent_bytes / gib, "plan_step_peak_gib": plan.step_peak_bytes / gib,
        "plan_total_gib": plan.total_bytes / gib, "plan_host_gib": plan.host_bytes / gib,
        "est_step_s": search.estimate(layout, t, seq)[0], "row_step_s": best.step_s,
    }  # fmt: skip


_REPORT_PEAKS = (
    "import atexit, runpy, sys, torch\n"
    "def _peaks():\n"
    "    if torch.cuda.is_available():\n"
    "        print(f'gpu_check peaks: allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB, '\n"
    "              f'reserved {torch.cuda.max_memory_reserved() / 2**30:.3f} GiB', flush=True)\n"
    "atexit.register(_peaks)\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
_PEAKS = re.compile(r"gpu_check peaks: allocated ([\d.]+) GiB, reserved ([\d.]+) GiB")


def parse_peaks(text: str) -> dict[str, float]:
    """The wrapper's last ``gpu_check peaks`` line: ``{"allocated_gib", "reserved_gib"}`` (empty if none)."""
    found = _PEAKS.findall(text)
    return {"allocated_gib": float(found[-1][0]), "reserved_gib": float(found[-1][1])} if found else {}


def check_memory(gpu_name: str, capacity_gib: float, budget: float, steps: int = 2) -> Result:
    """The plan's longest row for this GPU (Llama-3.2-1B shape, bf16, random weights, the row's techniques),
    ``steps`` recipe steps: torch's peak allocated and reserved memory against the plan, and tokens/s. FAIL
    when the allocated peak exceeds the plan's persistent state + step peak by more than
    :data:`MEMORY_TOLERANCE`; a row too slow for the budget runs at a fraction, planned at that length."""
    name = "memory/llama3.2-1b"
    if os.environ.get(MEMORY_SKIP_ENV, "").strip() not in ("", "0"):
        return Result(name, "SKIP", f"{MEMORY_SKIP_ENV} is set")
    gpu_type = gpu_type_for(gpu_name)
    row = memory_row(gpu_type, capacity_gib, steps, time_s=0.5 * budget)
    note = (f"plan's longest row on one {gpu_type} ({capacity_gib:.1f} GiB): {row['row']} tokens, {row['techniques']}"
            + ("" if row["fraction"] == 1 else
               f"; one step there is ~{row['row_step_s']:.0f} s by the plan's estimate, too slow for the budget: "
               f"run at 1/{row['fraction']} of the row ({row['seq']} tokens), planned at that length"))  # fmt: skip
    print(f"INFO {name:40s} {note}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        over = [*_common_overrides(tmp, steps), *_MEMORY_OVERRIDES, *row["overrides"], f"data.seq_len={row['seq']}",
                "logging.log_every_steps=1"]  # fmt: skip
        env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
        cmd = [sys.executable, "-c", _REPORT_PEAKS, str(ROOT / "recipes" / "finetune.py"),
               "--config", str(ROOT / MEMORY_CONFIG), *over]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(budget, 10.0), env=env, cwd=ROOT)
    text = p.stdout + p.stderr
    steps_seen, peaks = parse_steps(text), parse_peaks(text)
    if p.returncode != 0 or not steps_seen or not peaks:
        return Result(name, "FAIL", f"rc={p.returncode}: {_tail(text)}")
    plan_total = row["plan_total_gib"]
    figs: dict[str, Any] = {
        "seq": row["seq"], "allocated_gib": peaks["allocated_gib"], "reserved_gib": peaks["reserved_gib"],
        "plan_gib": plan_total, "plan_persistent_gib": row["plan_persistent_gib"],
        "plan_step_peak_gib": row["plan_step_peak_gib"], "allocated_vs_plan": peaks["allocated_gib"] / plan_total,
        "reserved_vs_plan": peaks["reserved_gib"] / plan_total, "tokens_per_s": steps_seen[-1]["tokens_per_s"],
        "step_s": steps_seen[-1]["step_time_s"], "est_step_s": row["est_step_s"], "loss": steps_seen[-1]["loss"],
    }  # fmt: skip
    ok = peaks["allocated_gib"] <= plan_total * (1 + MEMORY_TOLERANCE) and math.isfinite(steps_seen[-1]["loss"])
    return Result(name, "PASS" if ok else "FAIL", note, figs)


# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ws2-worker"]:
        method, backend, port, rank, out = argv[1:6]
        return ws2_worker(method, backend, int(port), int(rank), out)
    args = parse_args(argv)
    runner = Runner(args.budget_s, args.only, args.skip)
    cuda = torch.cuda.is_available() and not args.dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    env = environment(device)
    env["mode"] = "dry (CPU smoke)" if args.dry else ("cuda" if cuda else "cpu (no CUDA device)")
    runner.add(Result("env", "INFO", "", {k: env[k] for k in ("torch", "transformers", "device") if k in env}
                      | ({"gpu": env["gpu"], "cc": tuple(env["capability"])} if cuda else {})))
    if cuda:  # FlexAttention compiles per block shape and dtype: room for all of them
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
    runner.run("blocks", "blocks", lambda: block_checks(device, not cuda, 120.0), 130)
    if cuda or args.dry:
        runner.run("kernels", "kernels", lambda: kernel_checks(device, not cuda, 90.0, env), 100)
    else:
        runner.add(Result("kernels", "SKIP", "needs a CUDA device (or --dry)"))
    if not cuda:
        for group in ("varlen", "methods", "recipe", "throughput", "memory"):
            runner.add(Result(group, "SKIP", "needs a CUDA device" + (" (--dry)" if args.dry else "")))
        runner.add(Result("te_partition", "SKIP", "needs a CUDA device"))
    else:
        runner.run("varlen", "varlen", lambda: check_varlen(device), 30)
        runner.run("throughput", "throughput", lambda: check_throughput(device), 45)
        runner.run("te", "te_partition", check_te_partition, 20)
        runner.run("methods", "thd_kernels", lambda: check_thd_kernels(device), 20)
        runner.run("methods", "methods/ws1", lambda: check_methods(device), 40)
        gpu = env.get("gpu", "")
        for model in _MODELS:
            for seq in (8192, 32768):
                runner.run("recipe", f"recipe/{model}/{seq // 1024}k",
                           lambda m=model, s=seq: check_recipe(m, s, args.recipe_steps, min(90.0, runner.left() - 5), gpu), 45)
        capacity = torch.cuda.get_device_properties(device).total_memory / 2**30
        runner.run("memory", "memory/llama3.2-1b",
                   lambda: check_memory(gpu, capacity, min(args.memory_budget_s, runner.left() - 5)), 60)
        runner.run("methods", "methods/ws2", lambda: check_methods_ws2(runner.left() - 5), 40)
    path = summary_path(args.out)
    data = write_summary(runner, env, path)
    print(f"summary: {data['counts']} in {data['wall_s']} s -> {path}", flush=True)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
