"""model.attention_backend (automodel.distributed.cp.attention_kernels): the names and their config errors, the
rule auto follows per GPU, the pin a run's train context sets, and each kernel's backward buffers in exact bytes."""

from __future__ import annotations

import pytest
import torch

from automodel.config import ConfigError, load_config
from automodel.distributed.cp import attention_kernels as ak
from automodel.distributed.cp import block_backend as bb
from automodel.distributed.train_context import get_train_context


def _problems(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(["--config", "configs/cp.yaml", *overrides], world_size=2)
    return str(info.value)


def test_config_names_the_kernels_and_refuses_what_cannot_run():
    assert load_config(["--config", "configs/cp.yaml", "model.attention_backend=cudnn"], world_size=2)
    assert "model.attention_backend='fa3' is not one of ['auto', 'flash', 'cudnn', 'efficient', 'flex', 'math']" in (
        _problems("model.attention_backend=fa3")
    )
    assert "model.attn_implementation=eager runs the model's own" in _problems(
        "model.attention_backend=flash", "model.attn_implementation=eager"
    )
    # no CP: attention goes through torch's SDPA dispatch, which has no FlexAttention backend
    assert "has no FlexAttention backend" in _problems("model.attention_backend=flex", "distributed.cp_size=1")


@pytest.mark.parametrize(
    ("path", "capability", "cudnn", "half", "head_dim", "kernel"),
    [
        ("sdpa", (9, 0), 91600, True, 128, bb.CUDNN),  # H100 / H200 with a recent cuDNN: SDPA tries cuDNN first
        ("sdpa", (10, 0), 91600, True, 64, bb.CUDNN),  # B200
        ("sdpa", (9, 0), 91500, True, 128, bb.FLASH),  # cuDNN 9.15.0 is not newer than 9.15.0
        ("sdpa", (9, 0), None, True, 128, bb.FLASH),  # unknown here: flash, the larger backward
        ("sdpa", (9, 0), 91600, True, 192, bb.FLASH),  # head size past cuDNN's 128
        ("sdpa", (8, 0), 91600, True, 128, bb.FLASH),  # A100: SDPA's default order
        ("sdpa", (8, 9), 91600, True, 128, bb.FLASH),  # L40S
        ("blocks", (9, 0), 91600, True, 128, bb.CUDNN),  # the CP block kernels follow the same rule (issue 44)
        ("blocks", (9, 0), 91500, True, 128, bb.FLASH),
        ("blocks", (8, 0), 91600, True, 128, bb.FLASH),
        ("sdpa", (9, 0), 91600, False, 128, bb.EFFICIENT),  # fp32
        ("sdpa", (7, 0), None, True, 128, bb.EFFICIENT),  # V100
        ("sdpa", None, None, True, 128, ak.CPU_KERNEL),
    ],
)
def test_auto_follows_torchs_rule(path, capability, cudnn, half, head_dim, kernel):
    got, why = ak.auto_kernel(path, capability, cudnn, half=half, head_dim=head_dim)
    assert got == kernel and why


def test_the_train_context_pins_the_kernel_for_blocks_and_sdpa():
    """On CUDA the pin reaches the CP blocks (pinned_kernel) and torch's SDPA dispatch (its backend flags); on
    exit both are restored; auto and a CPU run change nothing."""
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.cudnn_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)  # fmt: skip
    before = [f() for f in flags]
    with get_train_context(False, False, attention_backend="cudnn", device_type="cuda")():
        assert ak.pinned_kernel() == bb.CUDNN
        assert [f() for f in flags] == [False, True, False, False]
        with ak.attention_backend_context("flash"):  # nests
            assert ak.pinned_kernel() == bb.FLASH and flags[0]() and not flags[1]()
        assert ak.pinned_kernel() == bb.CUDNN
    assert ak.pinned_kernel() is None and [f() for f in flags] == before
    for kw in ({"attention_backend": "auto"}, {"attention_backend": "flash", "device_type": "cpu"}):
        with get_train_context(False, False, **kw)():
            assert ak.pinned_kernel() is None and [f() for f in flags] == before
    with get_train_context(False, False, attention_backend="flex")():  # flex: the CP blocks only
        assert ak.pinned_kernel() == bb.FLEX and [f() for f in flags] == before


def test_kernel_buffers_exact_bytes():
    """One call: 1 row, 100 queries x 100 keys, 4 query heads and 2 KV heads of size 16, bf16."""
    call = ak.KernelCall(batch=1, q_tokens=100, k_tokens=100, heads=4, kv_heads=2, head_dim=16, dtype_bytes=2)

    def total(kernel, c=call):
        return {b.name: b.bytes for b in ak.kernel_buffers(kernel, c)}

    # flash: dq_accum [1, 128, 4, 32] fp32, softmax_d [1, 4, 128] fp32, dK/dV expanded 2 x [1, 100, 4, 16] bf16
    assert total(bb.FLASH) == {"dq_accum": 128 * 4 * 32 * 4, "softmax_d": 4 * 128 * 4,
                               "dk_expanded, dv_expanded": 2 * 100 * 4 * 16 * 2}  # fmt: skip
    # the CP block glue hands flash grouped K/V too (aten_schemas.GROUPED_KV): the op's own expanded dK/dV, no
    # repeat of K/V by the glue (it was 4 x [1, 4, 100, 16] bf16 when the glue repeated them)
    blocks = ak.KernelCall(**{**call.__dict__, "native_gqa": False})
    assert total(bb.FLASH, blocks) == total(bb.FLASH)
    # the memory-efficient kernel keeps the glue's repeat on the block path
    # cuDNN: fp32 dQ accumulator and softmax_sum in its workspace; dK/dV at the KV heads
    assert total(bb.CUDNN) == {"dQ_accum (workspace)": 4 * 100 * 16 * 4, "softmax_sum (workspace)": 4 * 100 * 4}
    assert total(bb.EFFICIENT) == {
        "delta": 4 * 100 * 4,
        "workspace: gQ accumulator": 4 * 128 * 64 * 4,
        "workspace: gK, gV accumulators (upper bound)": 2 * 4 * 128 * 16 * 4,
        "K/V repeated to all heads and dK/dV before the sum": 4 * 4 * 100 * 16 * 2,
    }
    assert total(bb.FLEX) == {"delta": 1600, "dK, dV per query head before the sum": 2 * 4 * 100 * 16 * 2}
    assert total(bb.MATH) == {"scores, probabilities and their gradient": 3 * 4 * 100 * 100 * 4}
    assert total(ak.CPU_KERNEL) == {}
    mha = ak.KernelCall(batch=2, q_tokens=256, k_tokens=256, heads=4, kv_heads=4, head_dim=64)
    assert set(total(bb.FLASH, mha)) == {"dq_accum", "softmax_d"}  # no GQA: nothing expanded
    assert total(bb.FLASH, mha)["dq_accum"] == 2 * 256 * 4 * 64 * 4
