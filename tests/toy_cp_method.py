"""A toy CP method, registered by a test: proves that a new method is one module plus one registry entry.

``toy_gather``: rows split head-tail (:mod:`automodel.distributed.cp.layout`); every attention layer
all-gathers K/V of the whole row (its backward sums dK/dV over the ranks and keeps this rank's share: a
reduce-scatter, written as an all-reduce and a slice so it runs on gloo), then computes the rank's queries
against each rank's K/V block with exact math and merges the blocks by log-sum-exp. Its own exchange,
attention and batch function, on the shared layout and active-context stack
(:mod:`automodel.distributed.cp.active`) only: no code of another method. Nothing outside this file and
the :func:`~automodel.distributed.cp.register_cp_method` call knows it: the config rules, the trainer,
the self-check, the dry run, the memory planner (tests/test_recipe_parity.py) and ``context_parallel``
(tests/test_toy_cp_method.py) run it through the :class:`~automodel.distributed.cp.CPMethod` interface.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from automodel.distributed.cp import CPMethod, LayerSpec, PreparedModel, register_cp_method
from automodel.distributed.cp.method import standard_problem

NAME = "toy_gather"
SUMMARY = "toy: K/V all-gathered, blocks merged by log-sum-exp"


# ------------------------------------------------------------------------------------------ exchange


class _GatherKV(torch.autograd.Function):
    """``[B, H, T_local, D]`` -> ``[W, B, H, T_local, D]`` (every rank's block); backward: the sum of the
    ranks' gradients of this rank's block (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, rank: int, world: int) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.group, ctx.rank = group, rank
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


# ------------------------------------------------------------------------------------------ attention


class _Plan:
    """One step's layout: the global position of every token each rank holds (``[W, T_local]``)."""

    def __init__(self, group: Any, world: int, rank: int, positions: torch.Tensor) -> None:
        self.group, self.world, self.rank, self.positions = group, world, rank, positions
        self.calls = 0  # attention calls inside the context (active.py's "no attention ran" check)


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float):
    """Attention of ``q`` ``[B, H, Tq, D]`` on one key block: ``(out, lse)``; rows with no key: out 0, lse -inf."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(scores - safe) @ v, lse


def toy_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query`` ``[B, Hq, T, D]``, ``key``/``value`` ``[B, Hkv, T,
    D]`` (this rank's tokens) -> ``([B, T, Hq, D], None)``, exact causal attention over the whole row."""
    from automodel.distributed.cp.active import current

    plan = current(NAME)
    if plan is None:
        raise RuntimeError(f"attention {NAME!r} ran outside its context; run the model inside `with ctx():`")
    plan.calls += 1
    if dropout:
        raise ValueError(f"{NAME} does not implement attention dropout (got {dropout}); set attention_dropout=0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    keys = _GatherKV.apply(key, plan.group, plan.rank, plan.world)
    values = _GatherKV.apply(value, plan.group, plan.rank, plan.world)
    q_pos = plan.positions[plan.rank].to(query.device)
    outs, lses = [], []
    for r in range(plan.world):  # rank r's block of keys, at its global positions
        allowed = q_pos[:, None] >= plan.positions[r].to(query.device)[None, :]
        k = keys[r].repeat_interleave(groups, dim=1)
        v = values[r].repeat_interleave(groups, dim=1)
        out, lse = _block(query, k, v, allowed, scale)
        outs.append(out)
        lses.append(lse)
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # the merge: weights exp(lse_r - lse)
    out = sum(o * torch.exp(lr - lse) for o, lr in zip(outs, lses))
    return out.transpose(1, 2).contiguous(), None


# ------------------------------------------------------------------------------------------ batch


def toy_batch_and_ctx(device_mesh: Any, batch: dict[str, Any], inner_attn: str | None = None):
    """``(ctx_factory, local)``: every ``[B, S]`` tensor of ``batch`` cut to this rank's head-tail chunks
    (``S`` a multiple of ``2 * cp_size``; ``position_ids`` added), an all-ones ``attention_mask`` dropped."""
    from automodel.distributed.cp.active import activate, not_switched_message
    from automodel.distributed.cp.group import resolve_cp_group
    from automodel.distributed.cp.layout import head_tail_spans

    del inner_attn
    group, world, rank = resolve_cp_group(device_mesh)
    ids = batch["input_ids"]
    bsz, seq = ids.shape
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError(f"{NAME} takes no padding mask: right-pad rows with labels -100 and drop attention_mask")
    spans = [head_tail_spans(seq, world, r) for r in range(world)]
    positions = torch.stack([torch.cat([torch.arange(a, b) for a, b in s]) for s in spans])
    index = positions[rank].to(ids.device)
    local: dict[str, Any] = {"position_ids": index.unsqueeze(0).expand(bsz, -1).contiguous()}
    for k, v in batch.items():
        if k == "attention_mask":
            continue
        is_row = isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] in (1, bsz) and v.shape[1] == seq
        local[k] = v.index_select(1, index) if is_row else v
    plan = _Plan(group, world, rank, positions)
    message = not_switched_message(NAME, "context_parallel", NAME)

    def ctx_factory() -> contextlib.AbstractContextManager:
        return activate(NAME, plan, message=message)

    return ctx_factory, local


# ------------------------------------------------------------------------------------------ the method


class ToyGather(CPMethod):
    name = NAME
    summary = SUMMARY
    attn_implementations = ("sdpa", "eager")
    chunks_per_rank = 2
    layout = "head_tail"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(self.name, layer, seq_len)

    def prepare_model(self, model: Any, device_mesh: Any) -> PreparedModel:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, toy_attention_forward)
        previous = model.config._attn_implementation
        model.set_attn_implementation(NAME)
        return PreparedModel(module=model, previous_attn=previous, current_attn=NAME)

    def _batch_function(self):  # noqa: ANN202
        return toy_batch_and_ctx

    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        kv = d.kv_heads * d.head_dim / r.tp
        row = r.local_batch * r.seq  # K/V of the whole row, gathered, and its gradient in backward
        return 2 * 2 * kv * r.compute_bytes * row, "toy: K/V of the whole row all-gathered"


def register() -> CPMethod:
    """Register the toy method (idempotent: a worker process may call it for several runs)."""
    return register_cp_method(ToyGather(), replace=True)
