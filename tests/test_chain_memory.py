"""What the state chain keeps through the step, as the memory planner measures it on the meta device
(:mod:`automodel.training.chain_memory`, :func:`automodel.distributed.cp.layers.state_chain.kept_bytes`), against what
a chained forward on the CPU leaves allocated."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from automodel.distributed.cp.layers import linear_mixer  # noqa: F401 - registers every kernel
from automodel.distributed.cp.layers.linear_support import STATE_MIXERS
from automodel.distributed.cp.layers.mixer_kernel import kernel_for
from automodel.distributed.cp.layers.state_chain import Chain, kept_bytes, run_chain
from automodel.training.chain_memory import _meta_copy, chain_kept
from scripts.live_tensors import AllocationTracker
from tests.family_matrix import family_by_name

TOKENS = 256


def _first_mixer(name: str) -> tuple[torch.nn.Module, int]:
    config = family_by_name(name).build_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return next(m for m in model.modules() if type(m).__name__ in STATE_MIXERS), config.hidden_size


# one family per kernel family that the tiny configs run fast: Gated DeltaNet, Mamba2, Mamba, a short convolution, ZAYA's
# convolutional attention, lightning attention, the RG-LRU
@pytest.mark.parametrize("name", ["olmo_hybrid", "zamba2", "jamba", "lfm2_moe", "zaya", "minimax", "recurrent_gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_bytes_is_what_a_chained_forward_leaves_allocated(name: str, dtype: torch.dtype) -> None:
    """After a chained forward of one row on the CPU, the storages it allocated and still holds (all but its output)
    and the core's inputs are exactly what ``kept_bytes`` counts, on the CPU and on a meta copy of the mixer."""
    mixer, hidden = _first_mixer(name)
    mixer = mixer.to(dtype)
    kernel = kernel_for(mixer)
    with torch.no_grad():
        seq = kernel.project(mixer, torch.randn(1, TOKENS, hidden, dtype=dtype)).seq
    leaves = {k: v.detach().requires_grad_(True) for k, v in seq.items()}
    tracker = AllocationTracker()
    with tracker:
        # a middle rank's two chunks, each started from a state (what kept_bytes runs)
        chain = Chain(None, 0, [[(0, 0, 0), (0, 0, TOKENS // 2), (0, TOKENS // 2, TOKENS // 2)]])
        out = run_chain(kernel, mixer, kernel.core_params(mixer, None), leaves, chain)
    gc.collect()
    inputs = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in leaves.values()}  # views of one projection
    held = tracker.current - out.untyped_storage().nbytes() + sum(inputs.values())
    assert kept_bytes(kernel, mixer, seq) == held > sum(inputs.values())
    meta = _meta_copy(mixer, dtype)
    with torch.no_grad():
        meta_seq = kernel.project(meta, torch.zeros(1, TOKENS, hidden, dtype=dtype, device="meta")).seq
    assert kept_bytes(kernel, meta, meta_seq) == held
    # the model's own mixer is untouched by the copy
    assert all(p.device.type == "cpu" and p.dtype == dtype for p in mixer.parameters())


def test_chain_kept_sums_its_layers_and_refuses_what_it_cannot_measure() -> None:
    """Every chained layer counts once, each class measured on its first layer; a row's bytes grow linearly with its
    tokens (the probe's two lengths fit the kept bytes at a third); a mixer without a CP kernel is not measured."""
    mixer, hidden = _first_mixer("olmo_hybrid")
    one = chain_kept([(0, mixer)], hidden)
    three = chain_kept([(0, mixer), (1, mixer), (2, mixer)], hidden)
    assert one is not None and three is not None and three.layers == 3
    assert three.per_token == tuple(3 * x for x in one.per_token)
    assert three.per_row == tuple(3 * x for x in one.per_row)
    assert one.per_token[0] > one.per_token[1] > 0  # the bf16 model keeps its inputs and outputs in bf16
    kernel = kernel_for(mixer)
    meta = _meta_copy(mixer, torch.float32)
    with torch.no_grad():
        seq = kernel.project(meta, torch.zeros(1, 1536, hidden, device="meta")).seq
    assert kept_bytes(kernel, meta, seq) == pytest.approx(1536 * one.per_token[0] + one.per_row[0], abs=1)
    assert chain_kept([], hidden) is None
    assert chain_kept([(0, torch.nn.Linear(hidden, hidden))], hidden) is None
