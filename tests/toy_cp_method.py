"""A toy CP method, registered by a test: proves that a new method is one module plus one registry entry.

``toy_gather``: rows split head-tail (:mod:`automodel.distributed.cp.layout`); every attention layer
all-gathers K/V of the whole row with the shared exchange (:mod:`automodel.distributed.cp.exchange.gather`),
then runs each of the rank's two query chunks against its own chunk (one causal block) and the chunks
before it (one block, no mask) with the shared block kernel, merged by log-sum-exp; its backward
gathers K/V again, runs the blocks' backward against the merged output and reduce-scatters dK/dV
(:func:`~automodel.distributed.cp.blocks.blocked_attention` with the toy's own block scheme).
Its attention reaches transformers through the shared adapter (:mod:`automodel.distributed.cp.hf_attention`)
and finds its step through the active-context stack (:mod:`automodel.distributed.cp.active`); it uses no
code of another method. Nothing outside this file and the :func:`~automodel.distributed.cp.register_cp_method`
call knows it: the config rules, the trainer, the self-check, the dry run, the memory planner
(tests/test_recipe_parity.py) and ``context_parallel`` (tests/test_context_parallel.py) run it through
the :class:`~automodel.distributed.cp.CPMethod` interface.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from automodel.distributed.cp import CPMethod, LayerSpec, PreparedModel, register_cp_method
from automodel.distributed.cp.method import standard_problem

NAME = "toy_gather"
SUMMARY = "toy: K/V all-gathered, blocks merged by log-sum-exp"


class _Plan:
    """One step: the CP group, the global positions of the tokens each rank holds (``[W, n]``) and the chunk
    length ``c``; the :class:`~automodel.distributed.cp.blocks.BlockScheme` of the toy's attention."""

    def __init__(self, group: Any, world: int, rank: int, positions: torch.Tensor, chunk: int) -> None:
        self.group, self.world, self.rank, self.chunk = group, world, rank, chunk
        ranked = positions.flatten()  # the global token at each place of the rank-major stream
        self.to_ranks, self.to_global = ranked, torch.argsort(ranked)
        self.calls = 0  # attention calls inside the context (active.py's "no attention ran" check)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, H, n, D]`` this rank's tokens -> ``[B, H, S, D]`` the whole row (the shared all-gather)."""
        from automodel.distributed.cp.exchange.gather import all_gather_tokens

        tokens = all_gather_tokens(x.permute(2, 0, 1, 3), self.group, self.world, self.to_global.to(x.device))
        return tokens.permute(1, 2, 0, 3)

    def _reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """The adjoint of :meth:`_gather`: ``[B, H, S, D]`` summed over the ranks, this rank's ``[B, H, n, D]``."""
        from automodel.distributed.cp.exchange.gather import reduce_scatter_tokens

        ranked = reduce_scatter_tokens(x.permute(2, 0, 1, 3), self.group, self.world, self.to_ranks.to(x.device))
        return ranked.permute(1, 2, 0, 3)

    def _blocks(self):  # noqa: ANN202
        """Per query chunk of this rank (head r, tail 2W-1-r): its slice of the local queries and its key
        blocks ``(keys, causal)``: its own chunk (causal) and every earlier chunk (all visible)."""
        c = self.chunk
        for half, index in enumerate((self.rank, 2 * self.world - 1 - self.rank)):
            blocks = [(slice(index * c, (index + 1) * c), True)] + ([(slice(0, index * c), False)] if index else [])
            yield slice(half * c, (half + 1) * c), blocks

    def forward(self, q, k, v, scale):  # noqa: ANN001, ANN201
        from automodel.distributed.cp.blocks import block_forward, merge

        keys, values = self._gather(k), self._gather(v)
        outs, lses = [], []
        for rows, blocks in self._blocks():
            out = lse = None
            for cols, causal in blocks:
                o, m = block_forward(q[:, :, rows], keys[:, :, cols], values[:, :, cols], causal=causal, scale=scale)
                out, lse = (o, m) if out is None else merge(out, lse, o, m)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(self, dout, q, k, v, out, lse, scale):  # noqa: ANN001, ANN201
        from automodel.distributed.cp.blocks import block_backward

        keys, values = self._gather(k), self._gather(v)  # gathered again: never saved
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(keys), torch.zeros_like(values)
        for rows, blocks in self._blocks():
            for cols, causal in blocks:
                a, b, c = block_backward(
                    dout[:, :, rows], q[:, :, rows], keys[:, :, cols], values[:, :, cols], out[:, :, rows],
                    lse[:, :, rows], causal=causal, scale=scale,
                )
                dq[:, :, rows] += a
                dk[:, :, cols] += b
                dv[:, :, cols] += c
        return dq, self._reduce_scatter(dk), self._reduce_scatter(dv)


def _toy_attention(call: Any) -> tuple[torch.Tensor, None]:
    """Exact causal attention of this rank's two head-tail chunks of queries over the whole row."""
    from automodel.distributed.cp.blocks import blocked_attention
    from automodel.distributed.cp.hf_attention import enter_call

    plan = enter_call(NAME, NAME, f"the {NAME} context", "context_parallel(...).shard")
    if call.dropout:
        raise ValueError(f"{NAME} does not implement attention dropout (got {call.dropout}); set attention_dropout=0")
    out = blocked_attention(call.query, call.key, call.value, plan, call.scaling)
    return out.transpose(1, 2).contiguous(), None


def toy_batch_and_ctx(device_mesh: Any, batch: dict[str, Any], inner_attn: str | None = None):
    """``(ctx_factory, local)``: every ``[B, S]`` tensor of ``batch`` cut to this rank's head-tail chunks
    (``S`` a multiple of ``2 * cp_size``; ``position_ids`` added), an all-ones ``attention_mask`` dropped."""
    from automodel.distributed.cp.active import activate, not_switched_message
    from automodel.distributed.cp.group import resolve_cp_group
    from automodel.distributed.cp.layout import head_tail_spans

    del inner_attn
    group, world, rank = resolve_cp_group(device_mesh)
    bsz, seq = batch["input_ids"].shape
    mask = batch.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        raise ValueError(f"{NAME} takes no padding mask: right-pad rows with labels -100 and drop attention_mask")
    spans = [head_tail_spans(seq, world, r) for r in range(world)]
    positions = torch.stack([torch.cat([torch.arange(a, b) for a, b in s]) for s in spans])
    index = positions[rank].to(batch["input_ids"].device)
    local: dict[str, Any] = {"position_ids": index.unsqueeze(0).expand(bsz, -1).contiguous()}
    for k, v in batch.items():
        if k == "attention_mask":
            continue
        is_row = isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] in (1, bsz) and v.shape[1] == seq
        local[k] = v.index_select(1, index) if is_row else v
    plan = _Plan(group, world, rank, positions, seq // (2 * world))
    message = not_switched_message(NAME, "context_parallel", NAME)

    def ctx_factory() -> contextlib.AbstractContextManager:
        return activate(NAME, plan, message=message)

    return ctx_factory, local


class ToyGather(CPMethod):
    name = NAME
    summary = SUMMARY
    attn_implementations = ("sdpa", "eager")
    chunks_per_rank = 2
    layout = "head_tail"

    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        return standard_problem(self.name, layer, seq_len)

    def prepare_model(self, model: Any, device_mesh: Any) -> PreparedModel:
        from automodel.distributed.cp.hf_attention import hf_attention_function, switch_attention

        previous = switch_attention(model, NAME, hf_attention_function(_toy_attention, NAME), NAME)
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
