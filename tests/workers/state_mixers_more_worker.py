"""The Mamba-1 mixers (Mamba, FalconMamba, Jamba), LFM2's short conv, Kimi's delta attention and others under CP (tests/test_state_mixers_more.py).

On every rank, per family (tiny models, the same weights on every rank): a packed row of three documents
and the single-process reference with each document run ALONE through the unmodified model (loss = sum CE /
label count, every parameter's gradient); then each method at cp = the group size through its own-loop API
on the packed row (ring: two unpacked rows against one process on the whole rows). Loss and gradients are
SUM-all-reduced over the group and compared.

Cases ``(dtype, kernels)``: ``"hf"`` runs transformers' own kernels (Jamba's scan and Kimi's chunked rule
compute in fp32 whatever the dtype); ``"fp64"`` replaces the model module's ``mamba_selective_scan`` /
``chunk_kimi_delta_attention`` by the dtype-keeping references of :mod:`automodel.distributed.cp.layers.mamba1`
/ :mod:`.kimi_delta` in BOTH runs (the module function is what the class forward and the CP kernel call).
Every model keeps its attention layer (Kimi-Linear's is MLA).
"""

from __future__ import annotations

import copy
import functools
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from automodel.errors import UserInputError
from tests.family_matrix import absent_reason, family_by_name
from tests.workers.cp_steps import (
    documents_reference,
    packed_documents,
    reduce_flat,
    rows_reference,
    sum_ce,
    take_grads,
    unpacked_rows,
)

VOCAB = 128
DOCS = (13, 29, 6)  # real lengths; each is padded to a multiple of 2*cp (cp=4: the 6-token one is 8 one-token chunks)
ALL_FAMILIES = ("jamba", "lfm2", "lfm2_moe", "lfm3", "kimi_linear", "bailing_hybrid", "minimax", "recurrent_gemma", "mamba",
                "falcon_mamba", "zamba", "rwkv", "xlstm")
#: those the installed transformers has (all from 5.25; the tests of the others skip, naming the release)
FAMILIES = tuple(family for family in ALL_FAMILIES if absent_reason(family) is None)


def build_model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    """The family's tiny model (tests/family_matrix.py) in ``dtype`` with non-trivial decay parameters (a
    fresh copy of one built per process: building costs more than the runs)."""
    return copy.deepcopy(_build_model(family, dtype))


@functools.cache
def _build_model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    # lfm2's default config has attention on every layer: its short convolutions are in the flagship's row
    fam = family_by_name("lfm2@flagship" if family == "lfm2" else family)
    config = fam.build_config()
    if family == "zamba":  # one Mamba layer and one hybrid layer (Mamba + the shared attention) prove it: CI time
        config.num_hidden_layers = 2
        config.layers_block_type = ["linear_attention", "hybrid"]  # what the config names "mamba" after __init__
    if family == "kimi_linear":  # dense MLPs: its MoE router computes in fp32, which would blur the fp64 proof
        config.mlp_layer_types = ["dense"] * config.num_hidden_layers
    if family == "bailing_hybrid":  # two delta-attention layers, dense MLPs (as Kimi's, above). No MLA layer: its
        # output gate computes sigmoid(g_proj(x).float()) in any dtype, which would blur the fp64 proof by 6e-10
        # (its MLA runs in the family matrix, exact in fp32)
        config.num_hidden_layers = 2
        config.layer_types = ["linear_attention", "linear_attention"]
        config.mlp_layer_types = ["dense", "dense"]
    if family == "xlstm" and dtype == torch.float64:  # its norms reduce in fp32 unless told not to, and its
        # token-by-token part keeps its state in inference_state_dtype (fp32; the config's validator offers no
        # fp64): both in the model's dtype, in both runs
        config.norm_reduction_force_float32 = False
        config.__dict__["inference_state_dtype"] = "float64"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=fam.attn_implementation(), dtype=dtype,
                                             experts_implementation="eager")  # grouped_mm: no fp64
    with torch.no_grad():
        for module in model.modules():
            name = type(module).__name__
            if name in ("JambaMambaMixer", "MambaMixer", "FalconMambaMixer"):  # slower decay than the init's (dt ~ 0.7): the state reaches further
                module.dt_proj.bias.uniform_(-4.0, -1.0)
                module.D.uniform_(0.5, 1.5)
            if name == "ZambaMambaMixer":  # the same, per Mamba head; x_proj_weight starts at zeros (B = C = 0)
                module.dt_proj_bias.uniform_(-4.0, -1.0)
                module.D.uniform_(0.5, 1.5)
                module.x_proj_weight.normal_(0.0, 0.2)
            if name in ("xLSTMLayer", "xLSTMFeedForward"):  # the init zeroes every "gate" weight: the gates
                # would not depend on the token (and the feed-forward's output would be zero)
                for sub_name, sub in module.named_children():
                    if "gate" in sub_name and isinstance(sub, torch.nn.Linear):
                        sub.weight.normal_(0.0, 0.1)
                if name == "xLSTMLayer":  # input gates near exp(-10) leave little to the state: nearer 1
                    module.igate_preact.bias.uniform_(-2.0, 1.0)
            if name == "KimiLinearDeltaAttention":
                module.o_norm.weight.uniform_(0.5, 1.5)
    if family == "bailing_hybrid":  # its conv is built in fp32 whatever the dtype: the model's dtype throughout
        model = model.to(dtype)
    return model.train()


def _rms_norm(self, hidden_states):
    """transformers' RMSNorm in the input's dtype (the classes' own forward computes in fp32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _weightless_rms_norm(self, x):
    """``FalconMambaWeightlessRMSNorm.forward`` in the input's dtype."""
    return self._norm(x)


def _gemma_rms_norm(self, x):
    """``RecurrentGemmaRMSNorm.forward`` in the input's dtype."""
    return self._norm(x) * (1.0 + self.weight)


def _rms_norm_gated(self, hidden_states, gate=None):
    """``KimiLinearRMSNormGated.forward`` in the input's dtype."""
    return _rms_norm(self, hidden_states) * torch.sigmoid(gate)


def _forget_gate(self, hidden_states):
    """``KimiLinearForgetGate.forward`` in the input's dtype."""
    g = (self.f_b_proj(self.f_a_proj(hidden_states)) + self.dt_bias.view(1, 1, -1))
    g = g.view(*hidden_states.shape[:2], -1, self.head_dim)
    return -torch.exp(self.A_log) * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


def _bailing_forget_gate(self, hidden_states):
    """``BailingHybridForgetGate.forward`` in the input's dtype (its own computes in fp32)."""
    shape = (*hidden_states.shape[:2], self.num_heads, self.head_dim)
    gate = self.f_proj(hidden_states).view(shape) + self.dt_bias.view(1, 1, self.num_heads, self.head_dim)
    rate = self.A_log.exp().view(1, 1, self.num_heads, 1)
    if self.safe_gate:
        return self.lower_bound * torch.sigmoid(rate * gate)
    return -rate * torch.where(gate > 20.0, gate, torch.log(1.0 + torch.exp(gate)))


def _rnn_scan_fp64(modeling) -> Any:
    """``RecurrentGemmaRglru._rnn_scan`` accumulating in fp64 (its default accumulates in fp32)."""
    cls = getattr(modeling, "RecurrentGemmaRglru", None)
    return None if cls is None else functools.partialmethod(cls._rnn_scan, acc_dtype=torch.float64)


def fp64_patches(model: torch.nn.Module, kernels: str) -> list[tuple[object, str, object]]:
    """Swap in the dtype-keeping pieces for ``kernels == "fp64"``: the model module's scan / rule (the
    references of :mod:`automodel.distributed.cp.layers.mamba1` / :mod:`.kimi_delta`) and the forwards of the
    classes that compute in fp32 (RMS norms, Kimi's forget gate). Returns ``(owner, name, original)`` to undo."""
    from automodel.distributed.cp.layers import kimi_delta, mamba1, rwkv

    if kernels != "fp64":
        return []
    modeling = sys.modules[type(model).__module__]
    swaps = [(modeling, "mamba_selective_scan", mamba1.selective_scan_reference),
             (modeling, "chunk_kimi_delta_attention", kimi_delta.recurrent_kda_reference),
             (modeling, "rwkv_linear_attention_cpu", rwkv.wkv_reference),
             (getattr(modeling, "JambaRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "MiniMaxRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "MambaRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "ZambaRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "FalconMambaRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "FalconMambaWeightlessRMSNorm", None), "forward", _weightless_rms_norm),
             (getattr(modeling, "RecurrentGemmaRMSNorm", None), "forward", _gemma_rms_norm),
             (getattr(modeling, "RecurrentGemmaRglru", None), "_rnn_scan", _rnn_scan_fp64(modeling)),
             (getattr(modeling, "KimiLinearRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "KimiLinearRMSNormGated", None), "forward", _rms_norm_gated),
             (getattr(modeling, "KimiLinearForgetGate", None), "forward", _forget_gate),
             (getattr(modeling, "BailingHybridRMSNorm", None), "forward", _rms_norm),
             (getattr(modeling, "BailingHybridRMSNormGated", None), "forward", _rms_norm_gated),
             (getattr(modeling, "BailingHybridForgetGate", None), "forward", _bailing_forget_gate)]
    undo = []
    for owner, name, new in swaps:
        if owner is not None and new is not None and hasattr(owner, name):
            undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, new)
    return undo


def documents(world: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The documents (ids of length L+1, the last is the next-token label) and the packed row."""
    return packed_documents(DOCS, VOCAB, world)


def ring_rows() -> dict[str, torch.Tensor]:
    return unpacked_rows(VOCAB)


_ce, _grads = sum_ce, take_grads
reference, ring_reference = documents_reference, rows_reference


def cp_step(method: str, model, batch, group) -> tuple[float, dict]:
    """One own-loop step of ``method`` on this rank's share; loss and gradients summed over ``group``."""
    from torch.distributed.device_mesh import DeviceMesh

    count = int((batch["labels"] != -100).sum())
    batch = {k: v.clone() for k, v in batch.items()}
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))
    if method == "ring":
        from automodel.distributed.cp_utils import make_cp_batch_and_ctx

        ctx, local = make_cp_batch_and_ctx(mesh, batch)
    elif method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        inner = set_ulysses_attention(model, mesh)
        ctx, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=inner)
    elif method == "thd":
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        set_thd_attention(model, mesh)
        ctx, local = make_thd_batch_and_ctx(mesh, batch)
    elif method == "thd_docs":
        from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention

        set_doc_attention(model, mesh)
        ctx, local = make_doc_batch_and_ctx(mesh, batch)
    else:
        from automodel.distributed.cp.usp.attention import make_usp_batch_and_ctx, set_usp_attention

        set_usp_attention(model, mesh)
        ctx, local = make_usp_batch_and_ctx(mesh, batch, ulysses_size=2)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = _ce(logits, local["labels"]) / count
        loss.backward()
    return reduce_flat(model, loss, group)


GRAD_FLOOR = 1e-3  # as tests/workers/family_matrix_worker.py: fp32 scales floored at 1e-3 x the largest gradient


def compare(ref_loss, ref_grads, loss, grads) -> dict:
    """Loss rel err; per parameter max abs diff / max abs reference (``grad_rel``), and the same with the
    denominator floored at ``GRAD_FLOOR`` x the model's largest reference gradient entry (``grad_rel_floored``,
    for fp32: a parameter whose gradient is a sum of cancelling terms, like a decay's ``A_log``, is known only
    to the round-off of the terms, not of the small sum)."""
    top = max(ref.abs().max().item() for ref in ref_grads.values())
    rel, floored = {}, {}
    for n, ref in ref_grads.items():
        diff, scale = (grads[n] - ref).abs().max().item(), ref.abs().max().item()
        rel[n] = diff / max(scale, 1e-30)
        floored[n] = diff / max(scale, GRAD_FLOOR * top)
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": rel, "grad_rel_floored": floored,
            "missing": sorted(set(ref_grads) - {n for n, g in grads.items() if g.abs().max() > 0})}


def fp32_movement(family: str) -> list[float]:
    """How far one process moves, fp32, under changes that keep the math (the worst loss or gradient,
    ``grad_rel_floored``, on the packed documents alone): the fp32 model against its fp64 copy (transformers' kernels),
    the documents run in the reverse order (the gradients summed in another order), packed in one row (state
    restarted per document) instead of one by one, and for Kimi's chunked rule every chunk size of 1, 2, 4,
    8, 16 against its 64, and for xLSTM's chunkwise kernel every chunk size of 1, 2, 4, 8 against its 16. The CP runs' fp32
    tolerance (tests/test_state_mixers_more.py) is this amount, no looser."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.layers.linear_mixer import install_linear_mixers

    base = build_model(family, torch.float32)
    docs, row = documents(2)
    ref = reference(copy.deepcopy(base), docs)
    moved = [compare(*ref, *reference(copy.deepcopy(base).double(), docs)),
             compare(*ref, *reference(copy.deepcopy(base), docs[::-1]))]
    packed = copy.deepcopy(base)  # the same documents packed in one row, the state restarted at each
    install_linear_mixers(packed, cached_profile(packed), None)
    logits = packed(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
    loss = _ce(logits, row["labels"]) / int((row["labels"] != -100).sum())
    loss.backward()
    moved.append(compare(*ref, loss.item(), _grads(packed)))
    modeling = sys.modules[type(base).__module__]
    if family == "kimi_linear":
        original = modeling.chunk_kimi_delta_attention
        try:
            for size in (1, 2, 4, 8, 16):
                modeling.chunk_kimi_delta_attention = functools.partial(original, chunk_size=size)
                moved.append(compare(*ref, *reference(copy.deepcopy(base), docs)))
        finally:
            modeling.chunk_kimi_delta_attention = original
    if family == "xlstm":  # its chunkwise kernel at other chunk sizes (CP's pieces cut its chunks elsewhere)
        for size in (1, 2, 4, 8):
            model = copy.deepcopy(base)
            for block in model.base_model.blocks:
                config = copy.deepcopy(block.mlstm_layer.config)
                config.chunk_size = size
                block.mlstm_layer.config = config
                block.mlstm_layer.mlstm_backend = type(block.mlstm_layer.mlstm_backend)(config)
            moved.append(compare(*ref, *reference(model, docs)))
    return [max(m["loss_rel"], *m["grad_rel_floored"].values()) for m in moved]


def run_cases(group, cp: int, methods, cases) -> dict:
    out: dict = {}
    for family in FAMILIES:
        for dtype_name, kernels in cases:
            base = build_model(family, getattr(torch, dtype_name))
            undo = fp64_patches(base, kernels)
            t0 = time.perf_counter()
            try:
                docs, row = documents(cp)
                ref = reference(copy.deepcopy(base), docs)
                rows = ring_rows()
                ring_ref = ring_reference(copy.deepcopy(base), rows) if "ring" in methods else None
                for method in methods:
                    batch, expected = (rows, ring_ref) if method == "ring" else (row, ref)
                    try:
                        got = cp_step(method, copy.deepcopy(base), batch, group)
                    except UserInputError as err:  # refused before any collective, on every rank alike
                        out[(family, dtype_name, kernels, method)] = {"refused": str(err)}
                        continue
                    out[(family, dtype_name, kernels, method)] = compare(*expected, *got)
            finally:
                for owner, name, original in undo:
                    setattr(owner, name, original)
            out[("seconds", family, dtype_name)] = time.perf_counter() - t0
    return out


def main(rank: int, world_size: int = 4) -> dict:
    """cp=2: ranks {0, 1} run the fp64 cases while {2, 3} run the fp32 ones; then cp=4 on all four (usp =
    2 x 2), both cases. Rank 0 also measures :func:`fp32_movement` per family."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    fp64, fp32 = ("float64", "fp64"), ("float32", "hf")
    pairs = [dist.new_group([r, r + 1], backend="gloo") for r in range(0, world_size, 2)]
    times = [time.time()]
    results: dict = {2: run_cases(pairs[rank // 2], 2, ("ulysses", "thd", "thd_docs", "ring"), [(fp64, fp32)[rank // 2]])}
    times.append(time.time())
    if rank >= 2:  # this pair ran the (faster) fp32 cases: it measures two families each
        mine = FAMILIES[0::2] if rank == 2 else FAMILIES[1::2]
        results["fp32_movement"] = {family: fp32_movement(family) for family in mine}
    times.append(time.time())
    if world_size == 4:
        results[4] = run_cases(dist.new_group(backend="gloo"), 4, ("ulysses", "thd", "thd_docs", "ring", "usp"),
                               [fp64, fp32])
    times.append(time.time())
    results["times"] = times
    return results
