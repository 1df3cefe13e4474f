"""The attention kernel as a pure function of the GPU, the torch release, the runtime cuDNN and the block
(block_backend.select_kernel), per GPU and version: auto runs cuDNN where torch's SDPA prefers it (Hopper and
B200/B300 with cuDNN > 9.15), flash elsewhere; a block the preferred kernel cannot take falls back with the reason,
logged once per layer kind; the same rule orders SDPA for Ulysses' inner kernel; the run log names the kernels."""

from __future__ import annotations

import logging

import pytest
import torch

from automodel.distributed.cp import attention_kernels as ak
from automodel.distributed.cp import block_backend as bb
from automodel.distributed.cp import cuda_blocks
from automodel.distributed.train_context import get_train_context

BF16, F32 = torch.bfloat16, torch.float32
CUDNN_919, CUDNN_915, CUDNN_91 = 91900, 91500, 90100  # 9.19.0 (torch 2.11's wheel), 9.15.0, 9.1.0


def _spec(dtype=BF16, d=128, dv=128, **kw):
    return bb.BlockSpec(dtype=dtype, head_dim=d, value_dim=dv, **kw)


CAUSAL, FULL, RECT = _spec(causal=True, grouped=True), _spec(grouped=True), _spec(causal=True, square=False)


@pytest.mark.parametrize(
    "gpu, torch_version, cudnn, spec, kernel",
    [
        # Hopper with a cuDNN newer than 9.15.0: cuDNN for the unmasked blocks (the diagonal and full blocks)
        ("h100", "2.11.0+cu130", CUDNN_919, CAUSAL, bb.CUDNN),
        ("h200", "2.15.0", CUDNN_919, FULL, bb.CUDNN),
        ("b200", "2.13.0", CUDNN_919, CAUSAL, bb.CUDNN),
        ("b300", "2.14.1", CUDNN_919, CAUSAL, bb.CUDNN),
        # cuDNN 9.15.0 is not newer than 9.15.0; an old cuDNN; none: flash
        ("h100", "2.12.1", CUDNN_915, CAUSAL, bb.FLASH),
        ("h100", "2.13.0", CUDNN_91, CAUSAL, bb.FLASH),
        ("h100", "2.13.0", None, CAUSAL, bb.FLASH),
        # where cuDNN is slower or even (transformers PR #48163): flash
        ("a100", "2.11.0", CUDNN_919, CAUSAL, bb.FLASH),
        ("l40s", "2.11.0", CUDNN_919, CAUSAL, bb.FLASH),
        ("rtx pro 6000", "2.15.0", CUDNN_919, CAUSAL, bb.FLASH),
        ("a10g", "2.15.0", CUDNN_919, FULL, bb.FLASH),
        # a causal rectangle (head-tail chunks, halos): a mask, the memory-efficient kernel everywhere
        ("h100", "2.11.0", CUDNN_919, RECT, bb.EFFICIENT),
        ("a100", "2.11.0", CUDNN_919, RECT, bb.EFFICIENT),
        # head size past cuDNN's 128 / fp32 / past flash's 256
        ("h100", "2.11.0", CUDNN_919, _spec(d=192, dv=192, causal=True), bb.FLASH),
        ("h100", "2.11.0", CUDNN_919, _spec(F32, causal=True), bb.EFFICIENT),
        ("h100", "2.11.0", CUDNN_919, _spec(d=320, dv=320), bb.EFFICIENT),
        # MLA padded to 128 stays on cuDNN; sinks go to FlexAttention
        ("h100", "2.11.0", CUDNN_919, _spec(d=128, dv=64, causal=True), bb.CUDNN),
        ("h100", "2.11.0", CUDNN_919, _spec(sinks=True, causal=True), bb.FLEX),
    ],
)
def test_selection_per_gpu_torch_and_cudnn(gpu, torch_version, cudnn, spec, kernel):
    choice = bb.select_kernel(bb.GpuInfo.named(gpu), torch_version, cudnn, spec)
    assert choice.kernel == kernel, choice
    assert choice.reason


@pytest.mark.parametrize(
    "spec, kernel, why",
    [
        (RECT, bb.EFFICIENT, "takes no mask"),
        (_spec(masked=True), bb.EFFICIENT, "takes no mask"),
        (_spec(d=192, dv=192), bb.FLASH, "head sizes up to 128"),
        (_spec(F32), bb.EFFICIENT, "fp16/bf16"),
    ],
)
def test_a_block_cudnn_cannot_take_falls_back_with_the_reason(spec, kernel, why):
    choice = bb.select_kernel(bb.GpuInfo.named("h100"), "2.13.0", CUDNN_919, spec)
    assert choice.kernel == kernel and why in choice.fallback and "preferred on this GPU" in choice.fallback
    # where cuDNN is not preferred there is nothing to fall back from
    assert bb.select_kernel(bb.GpuInfo.named("a100"), "2.13.0", CUDNN_919, spec).fallback == ""


def test_pins_varlen_and_versions():
    h100 = bb.GpuInfo.named("H100")
    # a pin runs every block it takes, on any GPU and cuDNN, and refuses the rest (never another kernel)
    assert bb.select_kernel(h100, "2.13.0", CUDNN_919, CAUSAL, pinned=bb.FLASH).kernel == bb.FLASH
    assert bb.select_kernel(bb.GpuInfo.named("a100"), "2.13.0", CUDNN_919, CAUSAL, pinned=bb.CUDNN).kernel == bb.CUDNN
    with pytest.raises(ValueError, match="no sdpa_cudnn op"):  # no cuDNN in the process
        bb.select_kernel(h100, "2.13.0", None, CAUSAL, pinned=bb.CUDNN)
    with pytest.raises(ValueError, match="takes no mask"):
        bb.select_kernel(h100, "2.13.0", CUDNN_919, RECT, pinned=bb.CUDNN)
    # all documents of a packed row: one varlen_attn call (flash) where it applies, unless another kernel is pinned
    docs = _spec(causal=True)
    assert bb.select_kernel(h100, "2.11.0", CUDNN_919, docs, varlen=True).reason.startswith("all documents")
    assert bb.select_kernel(h100, "2.11.0", CUDNN_919, docs, varlen=True, pinned=bb.CUDNN).kernel == bb.CUDNN
    assert bb.select_kernel(h100, "2.11.0", CUDNN_919, _spec(masked=True), varlen=True).kernel == bb.EFFICIENT
    # releases outside the schema table are refused with the fix; the GPU table names its GPUs
    with pytest.raises(ValueError, match="torch 2.10.0 is outside"):
        bb.select_kernel(h100, "2.10.0", CUDNN_919, CAUSAL)
    with pytest.raises(ValueError, match="not in the table"):
        bb.GpuInfo.named("tpu")
    caps = bb.caps_for(bb.GpuInfo("custom", (9, 0)), "2.15.0", CUDNN_919)
    assert caps.cudnn_preferred and caps.cudnn_op and caps.flash_op and caps.efficient_op and caps.varlen


def test_the_rule_is_the_planners_and_sdpas():
    """auto_kernel (the planner's and the dry run's kernel) and auto_sdpa_order (what auto sets for torch's SDPA
    dispatch, Ulysses' inner kernel included) give what select_kernel gives an unmasked block, per GPU."""
    for gpu in ("h100", "h200", "b200", "a100", "l40s"):
        info = bb.GpuInfo.named(gpu)
        for cudnn in (CUDNN_919, CUDNN_915, None):
            block = bb.select_kernel(info, "2.13.0", cudnn, CAUSAL).kernel
            assert ak.auto_kernel("blocks", info.capability, cudnn)[0] == block, (gpu, cudnn)
            assert ak.auto_sdpa_order(info.capability, cudnn)[0] == block, (gpu, cudnn)
    assert ak.auto_sdpa_order((9, 0), CUDNN_919) == [bb.CUDNN, bb.FLASH, bb.EFFICIENT, bb.MATH]
    assert ak.auto_sdpa_order((8, 0), CUDNN_919) == [bb.FLASH, bb.EFFICIENT, bb.MATH, bb.CUDNN]


def test_the_run_log_names_the_kernels():
    assert "torch's CPU kernels" in ak.run_kernel_line("auto", "cpu")
    assert "applies on CUDA only" in ak.run_kernel_line("cudnn", "cpu")
    assert "cudnn (cuDNN fused attention), pinned" in ak.run_kernel_line("cudnn", "cuda", (9, 0), CUDNN_919)
    line = ak.run_kernel_line("auto", "cuda", (9, 0), CUDNN_919)
    assert "SDPA tries sdpa_cudnn, sdpa_flash" in line and "compute capability 9.0" in line
    # no GPU here: auto's SDPA order is entered only where a GPU is, and changes nothing otherwise
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.cudnn_sdp_enabled)
    before = [f() for f in flags]
    with get_train_context(False, False, attention_backend="auto", device_type="cuda")():
        assert ak.pinned_kernel() is None and [f() for f in flags] == before


def test_each_layer_kind_logs_its_kernel_once(caplog, monkeypatch):
    """The CUDA slot logs one INFO line per layer kind and kernel (with the fallback reason where the GPU's
    preferred kernel could not take the block): stand-in caps and a stand-in kernel, on CPU."""
    caps = bb.caps_for(bb.GpuInfo.named("h100"), "2.13.0", CUDNN_919)
    monkeypatch.setattr(cuda_blocks, "_WARNED", set())
    monkeypatch.setattr(cuda_blocks, "cuda_caps", lambda device: caps)
    monkeypatch.setattr(cuda_blocks, "select_backend", lambda dev, spec, c, pinned=None: bb.select_backend("cuda", spec, c))
    monkeypatch.setattr(cuda_blocks, "_sdpa_forward", lambda kernel, q, k, v, *a: (q, q[..., 0].float()))
    q = torch.zeros(1, 2, 16, 64, dtype=BF16)
    mask = torch.ones(16, 16, dtype=torch.bool)
    with caplog.at_level(logging.INFO, logger="automodel.distributed.cp.blocks"):
        for _ in range(3):
            cuda_blocks.cuda_block_forward(q, q, q, True, None, None, None, None)  # diagonal block: cuDNN
            cuda_blocks.cuda_block_forward(q, q, q, False, None, mask, None, None)  # a document mask: efficient
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "layer kind 'causal'" in lines[0] and "run sdpa_cudnn" in lines[0]
    assert "'masked (window/chunk/document) full'" in lines[1] and "run sdpa_efficient" in lines[1]
    assert "cuDNN (preferred on this GPU) cannot take it: takes no mask" in lines[1]


def test_the_dry_run_names_the_kernel_per_layer_kind():
    """kernel_plan: one line per attention layer kind with each block shape's kernel (a hybrid model: full and
    sliding-window layers, sinks), and the recipe's dry run prints them for the planned GPU."""
    from automodel.config import load_config
    from automodel.distributed.cp.kernel_plan import layer_kind_kernel_lines
    from automodel.distributed.cp.profile import FULL, SLIDING, LayerSpec, ModelProfile
    from automodel.training.dry_run import dry_run_report

    layers = (LayerSpec(0, FULL, qk_head_dim=64, v_head_dim=64), LayerSpec(1, SLIDING, window=128, sinks=True),
              LayerSpec(2, FULL, qk_head_dim=64, v_head_dim=64))  # fmt: skip
    profile = ModelProfile("x", "X", layers, 8, 2, 64, False, "sdpa", False)
    h100 = bb.GpuInfo.named("h100")
    lines = layer_kind_kernel_lines(profile, h100, "2.11.0", CUDNN_919)
    assert len(lines) == 2, lines
    assert lines[0].startswith("  full attention: diagonal sdpa_cudnn; off-diagonal sdpa_cudnn; causal rectangle")
    assert "sdpa_efficient (cuDNN cannot take it)" in lines[0]
    assert lines[1] == "  sliding window 128 (sinks): masked blocks flex"
    a100 = layer_kind_kernel_lines(profile, bb.GpuInfo.named("a100"), "2.11.0", CUDNN_919, packed=True)
    assert "diagonal sdpa_flash" in a100[0] and "whole documents: one varlen_attn call (flash)" in a100[0]
    pinned = layer_kind_kernel_lines(profile, h100, "2.11.0", CUDNN_919, pinned=bb.CUDNN)
    assert "REFUSED: sdpa_cudnn takes no mask" in pinned[0] and "REFUSED" in pinned[1]
    report = dry_run_report(load_config(["--config", "configs/cp.yaml", "recipe.dry_run=true", "recipe.gpu_type=a100"]))
    i = report.index("--- attention kernels per layer kind on NVIDIA A100")
    assert report[i:].splitlines()[1].startswith("  full attention: diagonal sdpa_flash; off-diagonal sdpa_flash")
    # a CPU-only torch plans the reference cuDNN (9.19), as the memory plan does: cuDNN on an H100; a CUDA build (with
    # or without a GPU here) its own cuDNN, again as the memory plan does
    report = dry_run_report(load_config(["--config", "configs/cp.yaml", "recipe.dry_run=true", "recipe.gpu_type=h100"]))
    i = report.index("--- attention kernels per layer kind on NVIDIA H100")
    own = f"cuDNN {torch.backends.cudnn.version()})" if torch.backends.cudnn.is_available() else "9.19 assumed)"
    assert report[i:].splitlines()[0].endswith(own + " ---"), report[i:].splitlines()[0]
    assert report[i:].splitlines()[1].startswith("  full attention: diagonal sdpa_cudnn")


def test_the_cuda_slot_reads_the_process_cudnn_and_torchs_switch(monkeypatch):
    """cuda_blocks' caps prefer cuDNN by the same rule with this process's cuDNN, and TORCH_CUDNN_SDPA_DEPRIORITIZED
    (torch's own switch off) turns it off for the blocks as it does for SDPA."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: CUDNN_919)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    assert cuda_blocks._cudnn_preferred((9, 0)) and not cuda_blocks._cudnn_preferred((8, 0))
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not cuda_blocks._cudnn_preferred((9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: CUDNN_915)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED")
    assert not cuda_blocks._cudnn_preferred((9, 0))


def test_gqa_reaches_cudnn_grouped_and_is_repeated_for_the_others():
    """The selection says whether grouped K/V are repeated: cuDNN and flash take them as they are on torch 2.11-2.15
    (aten_schemas.GROUPED_KV), the memory-efficient kernel gets them repeated; equal heads need neither."""
    h100, a100 = bb.GpuInfo.named("h100"), bb.GpuInfo.named("a100")
    for version in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"):
        c = bb.select_kernel(h100, version, CUDNN_919, CAUSAL)
        assert (c.kernel, c.expand_kv) == (bb.CUDNN, False) and "grouped K/V as they are" in c.reason, version
    for version in ("2.11.0", "2.13.0", "2.15.0"):
        c = bb.select_kernel(a100, version, CUDNN_919, CAUSAL)
        assert (c.kernel, c.expand_kv) == (bb.FLASH, False) and "grouped K/V as they are" in c.reason, version
    no_flash_gqa = bb.CudaCaps((8, 0), flash_gqa=False)  # a release outside the table: flash gets them repeated
    c = bb.select_backend("cuda", CAUSAL, no_flash_gqa)
    assert (c.kernel, c.expand_kv) == (bb.FLASH, True) and "repeated per query head" in c.reason
    assert not bb.select_kernel(a100, "2.13.0", CUDNN_919, CAUSAL, pinned=bb.CUDNN).expand_kv
    rect_gqa = bb.BlockSpec(BF16, 128, 128, causal=True, square=False, grouped=True)
    assert bb.select_kernel(h100, "2.13.0", CUDNN_919, rect_gqa).expand_kv  # the memory-efficient kernel
    equal = bb.select_kernel(h100, "2.13.0", CUDNN_919, _spec(causal=True))
    assert not equal.expand_kv and "K/V" not in equal.reason
    no_gqa = bb.CudaCaps((9, 0), cudnn_op=True, cudnn_preferred=True, cudnn_gqa=False)  # a release outside the table
    assert bb.select_backend("cuda", CAUSAL, no_gqa).expand_kv
    assert bb.caps_for(h100, "2.11.0", CUDNN_919).cudnn_gqa and not bb.caps_for(h100, "2.11.0", None).cudnn_gqa


def test_packed_rows_run_cudnn_varlen_where_torch_runs_it():
    """All documents of a packed row: cuDNN's packed-row call where torch's own varlen_attn runs it (2.15: causal and
    full documents; 2.14: full documents only, its causal varlen_attn runs flash; cuDNN >= 9.18 on Hopper, where auto
    prefers cuDNN, or pinned), flash's varlen_attn elsewhere, per-document blocks where a pin rules both out."""
    h100, a100 = bb.GpuInfo.named("h100"), bb.GpuInfo.named("a100")
    docs = _spec(causal=True, grouped=True)
    full_docs = _spec(causal=False, grouped=True)
    for version, spec in (("2.15.0", docs), ("2.15.0", full_docs), ("2.14.1", full_docs)):
        c = bb.select_kernel(h100, version, CUDNN_919, spec, varlen=True)
        repeat = version.startswith("2.14")  # 2.14's gate wants equal heads; 2.15 takes grouped K/V as they are
        assert (c.kernel, c.varlen, c.expand_kv) == (bb.CUDNN, True, repeat) and "cum_seq_q" in c.reason
        assert bb.select_kernel(h100, version, CUDNN_919, spec, varlen=True, max_len=129).kernel == bb.CUDNN
    for version in ("2.11.0", "2.12.1", "2.13.0", "2.14.1"):  # varlen_attn keeps its cuDNN path off for causal rows
        c = bb.select_kernel(h100, version, CUDNN_919, docs, varlen=True)
        assert (c.kernel, c.varlen) == (bb.FLASH, True), version
    flash_cases = [
        (h100, "2.14.1", 91700, {}),  # cuDNN older than 9.18
        (a100, "2.15.0", CUDNN_919, {}),  # compute capability 8.0
        (h100, "2.15.0", CUDNN_919, {"window": 128}),  # a window: cuDNN's call takes none
        (h100, "2.15.0", CUDNN_919, {"max_len": 128}),  # documents of at most 128 tokens (cuDNN 9.24 takes them)
    ]
    for gpu, version, cudnn, kw in flash_cases:
        c = bb.select_kernel(gpu, version, cudnn, docs, varlen=True, **kw)
        assert (c.kernel, c.varlen) == (bb.FLASH, True), (gpu, version, cudnn, kw, c)
    assert bb.select_kernel(h100, "2.15.0", 92400, docs, varlen=True, max_len=128).kernel == bb.CUDNN
    # pins: cuDNN where torch has no packed-row cuDNN call, and flash where torch's varlen_attn would itself run
    # cuDNN (2.14, full documents), fall back to per-document blocks of the pinned kernel (never another kernel)
    c = bb.select_kernel(h100, "2.13.0", CUDNN_919, docs, varlen=True, pinned=bb.CUDNN)
    assert (c.kernel, c.varlen) == (bb.CUDNN, False)
    c = bb.select_kernel(h100, "2.14.1", CUDNN_919, docs, varlen=True, pinned=bb.CUDNN)  # causal rows on 2.14
    assert (c.kernel, c.varlen) == (bb.CUDNN, False)
    equal_full_docs = _spec(causal=False)
    c = bb.select_kernel(h100, "2.14.1", CUDNN_919, equal_full_docs, varlen=True, pinned=bb.FLASH)
    assert (c.kernel, c.varlen) == (bb.FLASH, False)
    # grouped K/V handed as they are (enable_gqa) turn 2.14's cuDNN path off: one flash call
    c = bb.select_kernel(h100, "2.14.1", CUDNN_919, full_docs, varlen=True, pinned=bb.FLASH)
    assert (c.kernel, c.varlen, c.expand_kv) == (bb.FLASH, True, False)
    c = bb.select_kernel(h100, "2.14.1", CUDNN_919, docs, varlen=True, pinned=bb.FLASH)  # causal: varlen_attn is flash
    assert (c.kernel, c.varlen) == (bb.FLASH, True)
    # torch 2.15's varlen_attn follows the flash pin (sdpa_kernel): one flash call
    c = bb.select_kernel(h100, "2.15.0", CUDNN_919, docs, varlen=True, pinned=bb.FLASH)
    assert (c.kernel, c.varlen) == (bb.FLASH, True)
    c = bb.select_kernel(h100, "2.15.0", CUDNN_919, docs, varlen=True, pinned=bb.CUDNN)
    assert (c.kernel, c.varlen) == (bb.CUDNN, True)
    caps = bb.caps_for(h100, "2.14.1", CUDNN_919)
    assert "this torch's varlen_attn runs cuDNN" in bb.varlen_refusal(equal_full_docs, caps, bb.FLASH)
    assert "full attention only" in bb.varlen_refusal(docs, caps, bb.CUDNN)
    assert "packed-row cuDNN call" in bb.varlen_refusal(docs, bb.caps_for(h100, "2.13.0", CUDNN_919), bb.CUDNN)
    assert bb.varlen_choice(docs, caps, bb.EFFICIENT) is None


def test_flash_varlen_takes_grouped_kv_as_they_are():
    """Flash's one call for all documents (varlen_attn) gets grouped K/V as they are in every release of the table
    (aten_schemas.VARLEN_GQA: 2.11-2.15, with enable_gqa from 2.12), repeated per query head only for caps that say
    otherwise; equal heads are never repeated; on 2.14 grouped K/V turn varlen_attn's own cuDNN path off."""
    h100, a100 = bb.GpuInfo.named("h100"), bb.GpuInfo.named("a100")
    for causal in (True, False):
        grouped, equal = _spec(causal=causal, grouped=True), _spec(causal=causal)
        for version in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"):
            c = bb.select_kernel(a100, version, CUDNN_919, grouped, varlen=True)
            assert (c.kernel, c.varlen, c.expand_kv) == (bb.FLASH, True, False), (version, causal, c)
            assert "grouped K/V as they are" in c.reason
            assert not bb.select_kernel(a100, version, CUDNN_919, equal, varlen=True).expand_kv
            assert bb.caps_for(a100, version, None).varlen_gqa
        c = bb.varlen_choice(grouped, bb.CudaCaps(capability=(8, 0), varlen=True))  # a varlen_attn that repeats
        assert (c.kernel, c.expand_kv) == (bb.FLASH, True) and "as they are" not in c.reason
    # 2.14 under auto on a Hopper with cuDNN >= 9.18: full grouped documents still go to cuDNN's packed-row call,
    # whose 2.14 gate wants equal heads (repeated); flash only where cuDNN cannot take them
    c = bb.select_kernel(h100, "2.14.1", CUDNN_919, _spec(grouped=True), varlen=True)
    assert (c.kernel, c.varlen, c.expand_kv) == (bb.CUDNN, True, True)
    c = bb.select_kernel(h100, "2.14.1", CUDNN_919, _spec(causal=True, grouped=True), varlen=True)
    assert (c.kernel, c.varlen, c.expand_kv) == (bb.FLASH, True, False)


def test_runtime_caps_are_the_planned_caps(monkeypatch):
    """cuda_blocks' CudaCaps of a device (what a run selects with) equal block_backend.caps_for's for that GPU,
    release and cuDNN (what the dry run printed), field by field: one rule for both (block_backend.release_caps).
    Before, the run's caps lacked the packed-row call's grouped K/V on torch 2.15, so a run repeated K/V and ran
    per-block kernels where its plan said one grouped call."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(cuda_blocks, "flex_available", lambda device_type: True)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    for version in ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"):
        for cudnn in (CUDNN_919, 92400, None):
            monkeypatch.setattr(torch, "__version__", version)
            monkeypatch.setattr(torch.backends.cudnn, "version", lambda c=cudnn: c)
            monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda c=cudnn: c is not None)
            cuda_blocks._caps_of.cache_clear()
            cuda_blocks._takes_grouped_kv.cache_clear()
            run, plan = cuda_blocks._caps_of(0), bb.caps_for(bb.GpuInfo.named("h100"), version, cudnn)
            assert run == plan, (version, cudnn, run, plan)
    cuda_blocks._caps_of.cache_clear()
    cuda_blocks._takes_grouped_kv.cache_clear()


def test_ulysses_inner_sdpa_logs_the_kernel_that_ran(caplog, monkeypatch):
    """Ulysses' inner sdpa call logs the kernel torch's SDPA dispatch runs for its own tensors under the active pin
    (aten._fused_sdp_choice): on CPU the CPU flash kernel; under a math pin (what attention_backend_context enters
    on CUDA for model.attention_backend=math) math. One line per kind and kernel, not per layer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from automodel.distributed.cp.ulysses import attention as ua
    from automodel.distributed.cp.ulysses.attention import make_ulysses_batch_and_ctx, set_ulysses_attention
    from tests.workers.ulysses_worker import make_batch, tiny_llama

    monkeypatch.setattr(ua, "_INNER_LOGGED", set())
    model = tiny_llama(2, "sdpa")
    set_ulysses_attention(model)
    batch = make_batch("plain")

    def run():
        ctx_factory, local = make_ulysses_batch_and_ctx(None, batch, inner_attn="sdpa")
        with ctx_factory():
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)

    with caplog.at_level(logging.INFO, logger="automodel.distributed.cp.blocks"):
        run()
        run()
        # the recipe's train context with model.attention_backend=math as on a GPU (its sdpa_kernel pin needs none):
        # the inner kernel transformers runs inside Ulysses is the pinned one
        with get_train_context(False, False, attention_backend="math", device_type="cuda")():
            run()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ulysses' inner sdpa")]
    assert len(lines) == 2, lines
    assert "torch's SDPA runs sdpa_flash" in lines[0] and "causal" in lines[0]
    assert "torch's SDPA runs math" in lines[1]
    q, k = torch.zeros(1, 4, 16, 8), torch.zeros(1, 2, 16, 8)
    assert ak.sdpa_dispatch_choice(q, k, k, None, 0.0, True, None) == bb.FLASH  # CPU flash, GQA
    with sdpa_kernel([SDPBackend.MATH]):
        assert ak.sdpa_dispatch_choice(q, k, k, None, 0.0, True, None) == bb.MATH


def test_the_dry_run_says_how_gqa_and_packed_rows_run():
    """kernel_plan's line per layer kind says which kernels get grouped K/V and which repeated, and which call takes
    the whole documents of a packed row (cuDNN's packed-row call on torch >= 2.14, flash's varlen_attn before)."""
    from automodel.distributed.cp.kernel_plan import layer_kind_kernel_lines
    from automodel.distributed.cp.profile import FULL, LayerSpec, ModelProfile

    profile = ModelProfile("x", "X", (LayerSpec(0, FULL, qk_head_dim=128, v_head_dim=128),), 8, 2, 128, False, "sdpa",
                           False)  # fmt: skip
    h100 = bb.GpuInfo.named("h100")
    old = layer_kind_kernel_lines(profile, h100, "2.13.0", CUDNN_919, packed=True)[0]
    assert "GQA: grouped K/V as they are to sdpa_cudnn, K/V repeated per query head for sdpa_efficient" in old
    assert "whole documents: one varlen_attn call (flash)" in old
    new = layer_kind_kernel_lines(profile, h100, "2.15.0", CUDNN_919, packed=True)[0]
    assert "whole documents: one cuDNN varlen call (aten._cudnn_attention_forward)" in new
    causal_214 = layer_kind_kernel_lines(profile, h100, "2.14.1", CUDNN_919, packed=True)[0]
    assert "whole documents: one varlen_attn call (flash)" in causal_214  # 2.14 runs cuDNN for full rows only
    a100 = layer_kind_kernel_lines(profile, bb.GpuInfo.named("a100"), "2.14.1", CUDNN_919)[0]
    assert "GQA: grouped K/V as they are to sdpa_flash, K/V repeated per query head for sdpa_efficient" in a100


def test_the_cuda_slot_caps_of_this_process(monkeypatch):
    """cuda_blocks' caps of a device (stand-in: an H100 with cuDNN 9.19 in this process's torch): cuDNN preferred,
    grouped K/V for cuDNN, and the packed-row cuDNN call exactly where this torch release runs it itself."""
    from automodel.distributed.cp import aten_schemas

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: CUDNN_919)
    monkeypatch.delenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", raising=False)
    caps = cuda_blocks._caps_of.__wrapped__(0)
    release = aten_schemas.torch_release(torch.__version__)
    assert caps.cudnn_op and caps.cudnn_preferred and caps.cudnn_gqa == aten_schemas.takes_grouped_kv(bb.CUDNN, release)
    assert caps.cudnn_varlen == aten_schemas.cudnn_varlen_runs(release, CUDNN_919, (9, 0))
    want = bb.caps_for(bb.GpuInfo.named("h100"), torch.__version__, CUDNN_919)
    assert (caps.cudnn_gqa, caps.cudnn_varlen, caps.varlen_follows_sdpa) == (
        want.cudnn_gqa, want.cudnn_varlen, want.varlen_follows_sdpa)
    for version, runs, follows in (("2.14.1", True, False), ("2.15.0", True, True), ("2.12.1", False, False)):
        monkeypatch.setattr(torch, "__version__", version)  # the ops are the same in 2.11-2.15 (aten_schemas)
        got = cuda_blocks._caps_of.__wrapped__(0)
        assert (got.cudnn_varlen, got.varlen_follows_sdpa) == (runs, follows), version
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    none = cuda_blocks._caps_of.__wrapped__(0)
    assert not (none.cudnn_op or none.cudnn_gqa or none.cudnn_varlen or none.cudnn_preferred)


def test_the_dry_run_says_where_thd_blocks_run_packed():
    """kernel_plan's line names the thd / thd_docs block sets one packed-row cuDNN call takes: both on torch 2.15,
    the prefix blocks only on 2.14 and only with equal heads (its varlen_attn runs cuDNN for full attention of equal
    heads only), none before or on an A100."""
    from automodel.distributed.cp.kernel_plan import layer_kind_kernel_lines
    from automodel.distributed.cp.profile import FULL, LayerSpec, ModelProfile

    profile = ModelProfile("x", "X", (LayerSpec(0, FULL, qk_head_dim=128, v_head_dim=128),), 8, 2, 128, False, "sdpa",
                           False)  # fmt: skip
    h100 = bb.GpuInfo.named("h100")
    line = layer_kind_kernel_lines(profile, h100, "2.15.0", CUDNN_919)[0]
    assert "thd / thd_docs / usp prefix and diagonal blocks: one cuDNN packed-row call each per layer" in line
    off = layer_kind_kernel_lines(profile, h100, "2.15.0", CUDNN_919, packed_blocks=False)[0]  # cudnn_packed_blocks
    assert "packed-row" not in off and "one cuDNN call per block (model.cudnn_packed_blocks=false)" in off
    assert "packed-row" not in layer_kind_kernel_lines(profile, h100, "2.14.1", CUDNN_919)[0]  # GQA: 2.15 only
    mha = ModelProfile("x", "X", (LayerSpec(0, FULL, qk_head_dim=128, v_head_dim=128),), 8, 8, 128, False, "sdpa",
                       False)  # fmt: skip
    assert "thd / thd_docs / usp prefix blocks: one cuDNN packed-row call" in layer_kind_kernel_lines(
        mha, h100, "2.14.1", CUDNN_919)[0]
    assert "packed-row" not in layer_kind_kernel_lines(profile, h100, "2.13.0", CUDNN_919)[0]
    assert "packed-row" not in layer_kind_kernel_lines(profile, bb.GpuInfo.named("a100"), "2.15.0", CUDNN_919)[0]
    assert "packed-row" not in layer_kind_kernel_lines(profile, h100, "2.15.0", CUDNN_919, pinned=bb.FLASH)[0]
