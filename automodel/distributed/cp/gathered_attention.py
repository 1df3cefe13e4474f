"""The head-tail gathered-K/V causal kernel: exact per-document attention of a rank's THD share.

Shared by ``cp_method: thd`` (across the whole CP group) and ``cp_method: usp`` (across its ring
sub-group, after the Ulysses all-to-all). Each rank holds its Transformer Engine partition of the
packed token stream (for every document of padded length ``L`` and chunk ``c = L / (2W)``, rank ``r``
holds chunks ``r`` and ``2W-1-r``; :func:`automodel.distributed.cp.layout.head_tail_indices`) as ONE row
``[1, T/W]`` with the tokens' global per-document ``position_ids``. :func:`thd_attention` makes every
local query attend to exactly the keys of its own document at earlier or equal positions;
:func:`shard_batch` builds the step's :class:`THDPlan` and the rank's tokens; :func:`gathered_layer` is
one transformers attention call (its checks and the per-layer kernel choice) under a plan.

Kernels (one key, ``kernel=``; an unavailable kernel is a ``ValueError``, never a fallback):

- ``portable`` (default, every device): K/V are all-gathered over the CP group (``T`` tokens of
  ``Hkv`` heads, GQA kept: the query heads are never materialised for K/V). For each document and
  each of its two local query chunks (global chunk ``j``), the keys are the document's prefix
  ``[0, j*c)`` (no mask) and the diagonal block ``[j*c, (j+1)*c)`` (causal). Both are blocks of
  :mod:`automodel.distributed.cp.blocks` (the CPU flash kernel on CPU; torch's fused kernels on
  CUDA, where all prefix blocks and all diagonal blocks each run as ONE packed-row cuDNN call where torch runs that
  call: :mod:`automodel.distributed.cp.block_sets`), merged with their log-sum-exp (:func:`~automodel.distributed.cp.blocks.merge`). This is lower-right causal
  alignment by construction, with no mask tensor at all: memory is the blocked kernel's, never
  ``[T_local, S]``. The autograd function saves only the LOCAL q/k/v, the output and the LSE; the
  backward re-gathers K/V, runs the kernels' backward per block with the merged output and LSE
  (exact, as in ring attention), and reduce-scatters dK/dV back to their owners.
- ``flash_attn`` (CUDA + flash-attn): ``flash_attn_varlen_func`` over the local query chunks against
  their document prefixes (flash-attn >= 2.1 aligns causal masks lower-right), gather and kernel
  recomputed in the backward (``torch.utils.checkpoint``), dK/dV reduce-scattered.
- ``te`` (CUDA + Transformer Engine): TE ``DotProductAttention(qkv_format="thd",
  attn_mask_type="padding_causal")`` with ``cu_seqlens(_padded)`` and
  ``set_context_parallel_group(..., cp_comm_type)`` (``p2p`` by default): TE does its own CP.

The CUDA kernels are not exercised in CI (no GPU); ``scripts/gpu_check.py`` compares them with the
portable path.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from automodel.distributed.cp.block_sets import BlockSet, sets_backward, sets_forward
from automodel.distributed.cp.blocks import block_backward, block_forward, blocked_attention, merge
from automodel.distributed.cp.exchange.gather import all_gather_tokens, gather_kv, reduce_scatter_tokens
from automodel.distributed.cp.gathered_method import THD_CP_COMM_TYPES, THD_KERNELS
from automodel.distributed.cp.hf_attention import AttentionCall, check_local_row
from automodel.distributed.cp.layers.strategy import run_layer
from automodel.distributed.cp.layout import head_tail_indices, head_tail_pair
from automodel.distributed.cp.te_batch import make_cp_batch_for_te
from automodel.errors import CPUnsupportedError

__all__ = [
    "THD_KERNELS",
    "THD_CP_COMM_TYPES",
    "THDPlan",
    "check_thd_kernel",
    "gathered_layer",
    "pad_documents",
    "shard_batch",
    "thd_attention",
]

def check_thd_kernel(kernel: str, device_type: str) -> None:
    """Raise ``ValueError`` if ``kernel`` cannot run on ``device_type`` here (never falls back).

    ``portable`` runs everywhere; ``flash_attn`` needs CUDA and the ``flash_attn`` package;
    ``te`` needs CUDA and ``transformer_engine``.
    """
    if kernel not in THD_KERNELS:
        raise ValueError(
            f"THD kernel {kernel!r} is not one of {THD_KERNELS}; set distributed.thd_kernel to one of them"
        )
    if kernel == "portable":
        return
    package = "flash_attn" if kernel == "flash_attn" else "transformer_engine"
    if device_type != "cuda":
        raise ValueError(
            f"distributed.thd_kernel={kernel} needs CUDA tensors, but the run is on {device_type}; "
            "set distributed.thd_kernel=portable (exact on every device)"
        )
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"distributed.thd_kernel={kernel} needs the {package!r} package, which is not installed; "
            f"install it (pip install {'flash-attn' if kernel == 'flash_attn' else 'transformer-engine[pytorch]'}) "
            "or set distributed.thd_kernel=portable"
        )


# ---------------------------------------------------------------------------------------------------------
# the per-step plan


@dataclass
class THDPlan:
    """Everything THD attention needs that the local ``[1, T/W]`` layer inputs no longer carry.

    Attributes:
        group, world_size, rank: the CP process group (``None`` at ``world_size == 1``), its size, this rank.
        cu_seqlens_padded: ``[N+1]`` python ints, global offsets of the padded documents (``T`` at the end).
        cu_seqlens: ``[N+1]`` python ints, global offsets of the real lengths (TE kernel only).
        max_seqlen: largest padded document length.
        kernel, cp_comm_type: see the module docstring.
        calls: attention calls run under this plan (for the forgotten-switch check).
    """

    group: ProcessGroup | None
    world_size: int
    rank: int
    cu_seqlens_padded: list[int]
    cu_seqlens: list[int]
    max_seqlen: int
    kernel: str = "portable"
    cp_comm_type: str = "p2p"
    calls: int = 0
    _index: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kernel not in THD_KERNELS:
            raise ValueError(f"kernel={self.kernel!r} is not one of {THD_KERNELS}")
        if self.cp_comm_type not in THD_CP_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={self.cp_comm_type!r} is not one of {THD_CP_COMM_TYPES}; "
                "set distributed.thd_cp_comm_type to one of them"
            )
        cu = self.cu_seqlens_padded
        divisor = 2 * self.world_size if self.world_size > 1 else 1
        for i in range(len(cu) - 1):
            n = cu[i + 1] - cu[i]
            if n < 0 or n % divisor:
                raise ValueError(
                    f"document {i} has padded length {n}, not a multiple of 2*cp_size={divisor}; pad every "
                    f"document to a multiple of {divisor} (data.dataset.seq_pad_multiple={divisor})"
                )

    @property
    def total(self) -> int:
        """``T``, the global number of tokens."""
        return self.cu_seqlens_padded[-1]

    @property
    def local_tokens(self) -> int:
        return self.total // self.world_size

    def documents(self) -> Iterator[tuple[int, int, int]]:
        """``(global_start, chunk, local_offset)`` of every non-empty document (chunk = ``L / (2W)``)."""
        w = self.world_size
        for i in range(len(self.cu_seqlens_padded) - 1):
            start, end = self.cu_seqlens_padded[i], self.cu_seqlens_padded[i + 1]
            if end > start:
                yield start, (end - start) // (2 * w) if w > 1 else end - start, start // w

    def query_blocks(self) -> Iterator[tuple[int, int, int, int]]:
        """``(local_offset, length, key_start, key_diag)`` per local query block.

        The block's queries are local tokens ``[local_offset, local_offset + length)``; their keys are the
        global tokens ``[key_start, key_diag)`` (all visible) and ``[key_diag, key_diag + length)`` (causal).
        """
        w, r = self.world_size, self.rank
        for start, c, off in self.documents():
            if w == 1:
                yield off, c, start, start
                continue
            for j, q_off in zip(head_tail_pair(r, w), (off, off + c)):
                yield q_off, c, start, start + j * c

    def index(self, name: str, device: torch.device) -> torch.Tensor:
        """``"to_global"``: ``[T]`` positions in the rank-major gathered stream of each global token;
        ``"to_ranks"``: ``[T]`` global token of each position of the rank-major stream."""
        key = (name, str(device))
        if key not in self._index:
            cu = torch.tensor(self.cu_seqlens_padded, dtype=torch.int64)
            parts = [head_tail_indices(cu, self.world_size, r) for r in range(self.world_size)]
            to_ranks = torch.cat(parts)
            to_global = torch.empty_like(to_ranks)
            to_global[to_ranks] = torch.arange(self.total)
            self._index[("to_ranks", str(device))] = to_ranks.to(device)
            self._index[("to_global", str(device))] = to_global.to(device)
        return self._index[key]

    def block_sets(self, device: torch.device) -> list[BlockSet | None]:
        """The query blocks as two :class:`~automodel.distributed.cp.block_sets.BlockSet` (cached): the prefix blocks
        (local queries against global keys ``[key_start, key_diag)``, no mask) and the diagonal blocks (causal)."""
        key = ("sets", str(device))
        if key not in self._index:
            blocks = list(self.query_blocks())
            self._index[key] = [
                BlockSet.of(False, [(o, n, [(a, d - a)]) for o, n, a, d in blocks], device),
                BlockSet.of(True, [(o, n, [(d, n)]) for o, n, _, d in blocks], device),
            ]
        return self._index[key]

    def token_layout(self):
        """This step's :class:`~automodel.distributed.cp.layout.TokenLayout` (cached)."""
        if "layout" not in self._index:
            from automodel.distributed.cp.layout import thd_layout

            self._index["layout"] = thd_layout(self.cu_seqlens_padded, self.group, self.world_size, self.rank)
        return self._index["layout"]

    # --- communication: token-major [n, H, D] tensors (automodel.distributed.cp.exchange.gather)
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather local ``[T/W, H, D]`` to global-order ``[T, H, D]`` (no autograd)."""
        if self.world_size == 1:
            return x
        return all_gather_tokens(x, self.group, self.world_size, self.index("to_global", x.device))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum global-order ``[T, H, D]`` over the ranks and keep this rank's ``[T/W, H, D]`` (no autograd)."""
        if self.world_size == 1:
            return x
        return reduce_scatter_tokens(x, self.group, self.world_size, self.index("to_ranks", x.device))


# ---------------------------------------------------------------------------------------------------------
# portable kernel: blocked flash kernels on prefix + diagonal blocks, merged by log-sum-exp


def _head_major(x_tok: torch.Tensor) -> torch.Tensor:
    """Token-major ``[n, H, D]`` -> ``[1, H, n, D]`` (a view)."""
    return x_tok.permute(1, 0, 2).unsqueeze(0)


def _tok(x: torch.Tensor) -> torch.Tensor:
    """``[1, H, n, D]`` -> token-major ``[n, H, D]`` (a view)."""
    return x[0].transpose(0, 1)


def _portable_forward(q, kg, vg, plan: THDPlan, scale):
    """q ``[1, Hq, Tl, D]``; kg/vg global ``[1, Hkv, T, D]``. Returns out ``[1, Hq, Tl, D]``, lse ``[1, Hq, Tl]``.
    The prefix and the diagonal blocks each in one packed-row call where the device has one
    (:mod:`~automodel.distributed.cp.block_sets`), else one block call per block."""
    packed = sets_forward(_tok(q), _tok(kg), _tok(vg), plan.block_sets(q.device), scale)
    if packed is not None:
        return _head_major(packed[0]).contiguous(), packed[1].transpose(0, 1).unsqueeze(0).contiguous()
    out = torch.zeros_like(q)
    lse = None
    for q_off, n, k_start, k_diag in plan.query_blocks():
        qs = q[:, :, q_off : q_off + n]
        o, lse_b = block_forward(
            qs, kg[:, :, k_diag : k_diag + n], vg[:, :, k_diag : k_diag + n], causal=True, scale=scale
        )
        if k_diag > k_start:
            op, lp = block_forward(qs, kg[:, :, k_start:k_diag], vg[:, :, k_start:k_diag], scale=scale)
            o, lse_b = merge(op, lp, o, lse_b)
        if lse is None:
            lse = q.new_zeros((*q.shape[:3],), dtype=lse_b.dtype)
        out[:, :, q_off : q_off + n] = o
        lse[:, :, q_off : q_off + n] = lse_b
    if lse is None:
        lse = q.new_zeros((*q.shape[:3],), dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
    return out, lse


def _portable_backward(dout, q, kg, vg, out, lse, plan: THDPlan, scale):
    packed = sets_backward(_tok(dout), _tok(q), _tok(kg), _tok(vg), _tok(out), lse[0].transpose(0, 1),
                           plan.block_sets(q.device), scale)  # fmt: skip
    if packed is not None:
        return tuple(_head_major(g).contiguous() for g in packed)
    dq = torch.zeros_like(q)
    dkg = torch.zeros_like(kg)
    dvg = torch.zeros_like(vg)
    for q_off, n, k_start, k_diag in plan.query_blocks():
        sl = slice(q_off, q_off + n)
        args = (dout[:, :, sl], q[:, :, sl])
        tail = (out[:, :, sl].contiguous(), lse[:, :, sl].contiguous())
        for a, b, causal in ((k_diag, k_diag + n, True), (k_start, k_diag, False)):
            if b <= a:
                continue
            g = block_backward(*args, kg[:, :, a:b], vg[:, :, a:b], *tail, causal=causal, scale=scale)
            dq[:, :, sl] += g[0]
            dkg[:, :, a:b] += g[1]
            dvg[:, :, a:b] += g[2]
    return dq, dkg, dvg


class _PortableScheme:
    """The portable kernel as a :class:`~automodel.distributed.cp.blocks.BlockScheme`: K/V all-gathered in the
    forward and again in the backward (never kept), dK/dV reduce-scattered to their owners."""

    def __init__(self, plan: THDPlan) -> None:
        self.plan = plan

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        return _head_major(self.plan.gather(x[0].transpose(0, 1)))

    def forward(self, q, k, v, scale):
        # q: [1, Hq, Tl, D], k/v: [1, Hkv, Tl, D] (this rank's tokens)
        return _portable_forward(q, self._gathered(k), self._gathered(v), self.plan, scale)

    def backward(self, dout, q, k, v, out, lse, scale):
        dq, dkg, dvg = _portable_backward(dout, q, self._gathered(k), self._gathered(v), out, lse, self.plan, scale)
        dk, dv = (self.plan.reduce_scatter(g[0].transpose(0, 1)) for g in (dkg, dvg))  # [Tl, Hkv, D]
        return dq, dk.transpose(0, 1).unsqueeze(0), dv.transpose(0, 1).unsqueeze(0)


# ---------------------------------------------------------------------------------------------------------
# CUDA kernels (not run in CI: no GPU; see scripts/gpu_check.py)


def _flash_indices(plan: THDPlan, device: torch.device):
    """Varlen layout: one "sequence" per local query block, keyed by its document prefix."""
    key = ("flash", str(device))
    if key not in plan._index:
        cu_q, cu_k, k_idx, max_q, max_k = [0], [0], [], 0, 0
        for _q_off, n, k_start, k_diag in plan.query_blocks():
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + (k_diag + n - k_start))
            k_idx.append(torch.arange(k_start, k_diag + n))
            max_q, max_k = max(max_q, n), max(max_k, k_diag + n - k_start)
        q_idx = torch.cat([torch.arange(o, o + n) for o, n, _, _ in plan.query_blocks()])
        plan._index[key] = (
            torch.tensor(cu_q, dtype=torch.int32, device=device),
            torch.tensor(cu_k, dtype=torch.int32, device=device),
            q_idx.to(device),
            torch.cat(k_idx).to(device),
            max_q,
            max_k,
        )
    return plan._index[key]


def _flash_attn_thd(q, k, v, plan: THDPlan, scale):
    from flash_attn import flash_attn_varlen_func

    cu_q, cu_k, q_idx, k_idx, max_q, max_k = _flash_indices(plan, q.device)

    def run(q_tok, k_tok, v_tok):
        kg = gather_kv(k_tok, plan).index_select(0, k_idx)
        vg = gather_kv(v_tok, plan).index_select(0, k_idx)
        o = flash_attn_varlen_func(
            q_tok.index_select(0, q_idx), kg, vg, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True
        )
        return q_tok.new_zeros(q_tok.shape).index_copy(0, q_idx, o)

    from torch.utils.checkpoint import checkpoint

    tok = [x[0].transpose(0, 1) for x in (q, k, v)]  # [Tl, H, D]
    out = checkpoint(run, *tok, use_reentrant=False)  # the gathered K/V are recomputed, not kept
    return out.transpose(0, 1).unsqueeze(0)


_TE_MODULES: dict = {}


def _te_thd(q, k, v, plan: THDPlan, scale):
    import transformer_engine.pytorch as te

    n_q, n_kv, head_dim = q.shape[1], k.shape[1], q.shape[3]
    key = (n_q, n_kv, head_dim, scale, plan.cp_comm_type, id(plan.group), str(q.device))
    attn = _TE_MODULES.get(key)
    if attn is None:
        attn = te.DotProductAttention(
            n_q,
            head_dim,
            num_gqa_groups=n_kv,
            attention_dropout=0.0,
            qkv_format="thd",
            attn_mask_type="padding_causal",
            softmax_scale=scale,
        )
        if plan.world_size > 1:
            ranks = dist.get_process_group_ranks(plan.group)
            attn.set_context_parallel_group(
                plan.group, ranks, torch.cuda.Stream(), cp_comm_type=plan.cp_comm_type
            )
        _TE_MODULES[key] = attn
    dev = q.device
    cu = torch.tensor(plan.cu_seqlens, dtype=torch.int32, device=dev)
    cu_p = torch.tensor(plan.cu_seqlens_padded, dtype=torch.int32, device=dev)
    tok = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]
    out = attn(
        *tok,
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_p,
        cu_seqlens_kv_padded=cu_p,
        max_seqlen_q=plan.max_seqlen,
        max_seqlen_kv=plan.max_seqlen,
    )
    return out.view(tok[0].shape).transpose(0, 1).unsqueeze(0)


# ---------------------------------------------------------------------------------------------------------
# public attention functions


def thd_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: THDPlan, scale: float | None = None
) -> torch.Tensor:
    """Exact causal attention of this rank's tokens within their documents.

    Args:
        query: ``[1, Hq, T/W, D]``; key/value: ``[1, Hkv, T/W, D]`` (``Hq % Hkv == 0``), this rank's tokens in
            TE's partition order (as :func:`make_thd_batch_and_ctx` lays them out).
        plan: the step's :class:`THDPlan`.
        scale: softmax scale (``None``: ``1/sqrt(D)``).

    Returns:
        ``[1, Hq, T/W, D]``, differentiable w.r.t. query, key and value (dK/dV reach the ranks that own
        the keys through a reduce-scatter).
    """
    check_local_row(query, key, plan.local_tokens, "THD attention", "make_thd_batch_and_ctx")
    if plan.kernel == "flash_attn":
        return _flash_attn_thd(query, key, value, plan, scale)
    if plan.kernel == "te":
        return _te_thd(query, key, value, plan, scale)
    return blocked_attention(query, key, value, _PortableScheme(plan), scale)




def gathered_layer(
    call: AttentionCall, plan: THDPlan, local_index: torch.Tensor | None = None, method: str = "thd"
) -> torch.Tensor:
    """One transformers attention call of the local tokens under ``plan``: ``[1, T/W, Hq, Dv]``.

    ``call.query`` ``[1, Hq, T/W, D]``, key/value ``[1, Hkv, T/W, D]``. Refuses (``ValueError`` /
    :class:`CPUnsupportedError`) a mask (document boundaries come from the plan), dropout, a non-causal
    module and attention biases. Per layer: windows, chunks, sinks and softcapping run the halo kernel,
    MLA runs on padded V (cp/layers/strategy.py); transformers passes ``softcap`` only where the model
    applies it (sdpa refuses it). Everything else runs :func:`thd_attention`. ``local_index``: the index
    transformers took each query's position-dependent scale at (``run_layer``; usp's gathered queries);
    ``method``: the CP method the messages name.
    """
    if call.attention_mask is not None:
        raise ValueError(
            "THD attention received an attention mask; document boundaries and padding come from the packed "
            "layout (seq_lens / seq_lens_padded). Do not pass attention_mask to the model"
        )
    if call.dropout:
        raise ValueError(
            f"THD attention does not implement attention dropout (got {call.dropout}); set the model's "
            "attention_dropout to 0"
        )
    if call.is_causal is False or getattr(call.module, "is_causal", True) is False:
        raise ValueError(f"{call.module_name} is not causal; THD attention computes causal attention only")
    if call.kwargs.get("position_bias") is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method=thd: {call.module_name} uses attention biases, which THD "
            "attention does not apply (docs/support_matrix.md)"
        )

    def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return thd_attention(q, k, v, plan, scale).transpose(1, 2)

    return run_layer(
        call.module, call.query, call.key, call.value, call.kwargs, layout=plan.token_layout(), native=native,
        method=method, scaling=call.scaling, dropout=call.dropout, apply_softcap=True, local_index=local_index,
    )


# ---------------------------------------------------------------------------------------------------------
# the batch


def pad_documents(batch: dict[str, Any], multiple: int, seq_lens_padding_value: int = -1000) -> dict[str, Any]:
    """A packed batch with every document's slot padded to a multiple of ``multiple`` (the head-tail partition
    cuts each document into ``2 * W`` chunks), so packing needs no per-document padding of its own.

    Exact for causal attention: a document's added slots come after its real tokens (``labels`` -100, token 0,
    positions counting on), so no real token reads them, and the next document starts at its own slot. Rows
    are laid out again at a common length (a multiple of ``multiple``; the extra joins each row's last
    document, as the collator does).

    Args:
        batch: ``input_ids`` / ``labels`` ``[B, S]`` and ``seq_lens`` / ``seq_lens_padded`` ``[B, P]``
            (``seq_lens_padding_value`` = unused); other ``[B, S]`` tensors (``position_ids``, ``loss_mask``,
            ``padding_mask``) are moved with the tokens. Not mutated.
        multiple: what every document slot becomes a multiple of.

    Returns:
        ``batch`` itself when every slot and the row length are multiples already (or the batch is not
        packed), else a new dict of the same keys.
    """
    lens, slots = batch.get("seq_lens"), batch.get("seq_lens_padded")
    ids = batch["input_ids"]
    if lens is None or slots is None or multiple <= 1:
        return batch
    bsz, seq = ids.shape
    used = slots != seq_lens_padding_value
    if bool((slots[used] % multiple == 0).all()) and seq % multiple == 0:
        return batch
    old = slots.masked_fill(~used, 0).tolist()
    new = [[-(-p // multiple) * multiple for p in row] for row in old]
    length = max(max(sum(row) for row in new), multiple)
    length = -(-length // multiple) * multiple
    # index of each new slot's token in the old row (-1: an added pad slot), and the pad's offset past its slot
    src = torch.full((bsz, length), -1, dtype=torch.long)
    step = torch.zeros((bsz, length), dtype=torch.long)
    new_slots = slots.clone()
    for b in range(bsz):
        last = max((i for i, p in enumerate(old[b]) if p), default=None)
        at_old = at_new = 0
        for i, (p, q) in enumerate(zip(old[b], new[b])):
            if not p:
                continue
            if i == last:
                q += length - sum(new[b])
            src[b, at_new : at_new + p] = torch.arange(at_old, at_old + p)
            src[b, at_new + p : at_new + q] = at_old + p - 1  # the slot's last token: positions count on from it
            step[b, at_new + p : at_new + q] = torch.arange(1, q - p + 1)
            new_slots[b, i] = q
            at_old, at_new = at_old + p, at_new + q
    empty = (src < 0).all(dim=1, keepdim=True)  # a row without documents: every slot is padding
    pad = (step > 0) | empty
    src = src.clamp(min=0)
    src, pad, step = src.to(ids.device), pad.to(ids.device), step.to(ids.device)
    out = dict(batch)
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key in ("seq_lens", "seq_lens_padded") or value.shape[-2:] != (bsz, seq):
            continue
        index = src.expand(*value.shape[:-2], bsz, length)
        moved = value.gather(-1, index)
        if key == "position_ids":
            moved = moved + step.expand_as(moved)
        else:
            fill = {"labels": -100, "padding_mask": 1}.get(key, 0)  # padding_mask: 1 marks a pad slot
            moved = moved.masked_fill(pad.expand_as(moved), fill)
        out[key] = moved
    out["seq_lens_padded"] = new_slots.to(slots.device)
    return out


def shard_batch(
    group: ProcessGroup | None,
    world: int,
    rank: int,
    batch: dict[str, Any],
    kernel: str = "portable",
    cp_comm_type: str = "p2p",
    seq_lens_padding_value: int = -1000,
) -> tuple[THDPlan, dict[str, Any]]:
    """This rank's THD share of a BSHD batch (packed or not) over ``group`` and the step's :class:`THDPlan`.

    Args:
        group, world, rank: the process group the documents are split over (``None`` at world 1).
        batch: as for ``make_thd_batch_and_ctx`` (identical on every rank of ``group``).
        kernel, cp_comm_type, seq_lens_padding_value: see ``make_thd_batch_and_ctx``.

    Returns:
        ``(plan, local)``: ``local`` holds ``input_ids``, ``labels``, ``position_ids`` (mRoPE
        ``[n_rope, 1, T/W]``), ``loss_mask`` / ``padding_mask`` if present, each ``[1, T/W]``, and
        ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen`` as :func:`make_cp_batch_for_te` returns them.
        ``batch`` is not mutated.

    Raises:
        ValueError: see ``make_thd_batch_and_ctx``.
    """
    if not isinstance(batch.get("input_ids"), torch.Tensor) or batch["input_ids"].dim() != 2:
        raise ValueError(f"the batch needs 'input_ids' [B, S]; got keys {sorted(batch)}")
    ids = batch["input_ids"]
    check_thd_kernel(kernel, ids.device.type)
    bsz, seq_len = ids.shape
    bshd = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if bshd.get("seq_lens") is None and bshd.get("seq_lens_padded") is None:
        mask = bshd.pop("attention_mask", None)
        real = mask.long().sum(1, keepdim=True) if mask is not None else torch.full((bsz, 1), seq_len)
        bshd["seq_lens"] = real.to(ids.device)
        bshd["seq_lens_padded"] = torch.full((bsz, 1), seq_len, device=ids.device)
    elif bshd.get("seq_lens") is None or bshd.get("seq_lens_padded") is None:
        raise ValueError(
            "a packed batch needs both 'seq_lens' and 'seq_lens_padded' [B, P]; got only "
            f"{'seq_lens' if bshd.get('seq_lens') is not None else 'seq_lens_padded'}"
        )
    shard = make_cp_batch_for_te(_CPSize(world, rank), bshd, seq_lens_padding_value=seq_lens_padding_value)
    cu_p = shard["cu_seqlens_padded"]
    cu = shard["cu_seqlens"]
    plan = THDPlan(
        group=group,
        world_size=world,
        rank=rank,
        cu_seqlens_padded=cu_p[cu_p != seq_lens_padding_value].tolist(),
        cu_seqlens=cu[cu != seq_lens_padding_value].tolist(),
        max_seqlen=int(shard["max_seqlen"]),
        kernel=kernel,
        cp_comm_type=cp_comm_type,
    )
    local: dict[str, Any] = {}
    for key in ("input_ids", "labels", "loss_mask", "padding_mask"):
        if key in shard:
            local[key] = shard[key].unsqueeze(0)
    pos = shard["position_ids"]
    local["position_ids"] = pos.unsqueeze(-2) if pos.dim() == 2 else pos.unsqueeze(0)
    for key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
        local[key] = shard[key]
    return plan, local


class _CPSize:
    """The (size, local rank) slice of the DeviceMesh API that make_cp_batch_for_te reads."""

    ndim = 1

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank
