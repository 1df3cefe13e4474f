"""THD context parallelism for unmodified Hugging Face models: packed documents, exact, on any device.

Each CP rank holds its Transformer Engine partition of the packed token stream (for every document
of padded length ``L`` and chunk ``c = L / (2W)``, rank ``r`` holds chunks ``r`` and ``2W-1-r``;
see :mod:`automodel.distributed.te_batch`) and feeds it to the model as ONE row ``[1, T/W]`` with
the tokens' global per-document ``position_ids``, so RoPE is right. Everything outside attention is
token-local and runs unchanged. The attention registered here (:data:`THD_ATTN_NAME` in
transformers' ``AttentionInterface``) makes every local query attend to exactly the keys of its own
document at earlier or equal positions.

Kernels (one key, ``kernel=``; an unavailable kernel is a ``ValueError``, never a fallback):

- ``portable`` (default, every device): K/V are all-gathered over the CP group (``T`` tokens of
  ``Hkv`` heads, GQA kept: the query heads are never materialised for K/V). For each document and
  each of its two local query chunks (global chunk ``j``), the keys are the document's prefix
  ``[0, j*c)`` (no mask) and the diagonal block ``[j*c, (j+1)*c)`` (causal). Both run through
  ``aten._scaled_dot_product_flash_attention_for_cpu`` (CPU) or ``aten._scaled_dot_product_flash_attention``
  / the efficient kernel (CUDA) and are merged with their log-sum-exp. This is lower-right causal
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

Usage::

    set_thd_attention(model)                                  # once
    ctx_factory, batch = make_thd_batch_and_ctx(device_mesh, batch)
    with ctx_factory():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = token_ce_sum(logits, batch["labels"]) / global_label_count
        loss.backward()
    # then all-reduce (SUM) the parameter gradients over the CP group
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from automodel.distributed.cp.batch_forms import check_batch_forms
from automodel.distributed.cp.group import resolve_cp_group as _resolve_cp
from automodel.distributed.te_batch import make_cp_batch_for_te
from automodel.distributed.thd_utils import thd_partition_indices
from automodel.errors import CPUnsupportedError

__all__ = [
    "THD_ATTN_NAME",
    "THD_KERNELS",
    "THD_CP_COMM_TYPES",
    "THDPlan",
    "check_thd_kernel",
    "current_thd_plan",
    "thd_context",
    "thd_attention_forward",
    "thd_attention",
    "register_thd_attention",
    "set_thd_attention",
    "make_thd_batch_and_ctx",
]

#: The name under which THD attention is registered in transformers' ``AttentionInterface``.
THD_ATTN_NAME = "thd"
#: Values of ``kernel=`` (config key ``distributed.thd_kernel``).
THD_KERNELS = ("portable", "flash_attn", "te")
#: Transformer Engine context-parallel communication types (``distributed.thd_cp_comm_type``).
THD_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")

aten = torch.ops.aten
# torch >= 2.13 names (the *_tensor ones are deprecated there); older torch has only the *_tensor ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
#: Use the exact math blocks (what non-CPU devices run in the portable kernel) also on CPU; tests set it.
FORCE_MATH_BLOCKS = False


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
            for j, q_off in ((r, off), (2 * w - 1 - r, off + c)):
                yield q_off, c, start, start + j * c

    def index(self, name: str, device: torch.device) -> torch.Tensor:
        """``"to_global"``: ``[T]`` positions in the rank-major gathered stream of each global token;
        ``"to_ranks"``: ``[T]`` global token of each position of the rank-major stream."""
        key = (name, str(device))
        if key not in self._index:
            cu = torch.tensor(self.cu_seqlens_padded, dtype=torch.int64)
            parts = [
                thd_partition_indices(cu, self.total, self.world_size, r).long()
                for r in range(self.world_size)
            ]
            to_ranks = torch.cat(parts)
            to_global = torch.empty_like(to_ranks)
            to_global[to_ranks] = torch.arange(self.total)
            self._index[("to_ranks", str(device))] = to_ranks.to(device)
            self._index[("to_global", str(device))] = to_global.to(device)
        return self._index[key]

    def token_layout(self):
        """This step's :class:`~automodel.distributed.cp.kernels.token_layout.TokenLayout` (cached)."""
        if "layout" not in self._index:
            from automodel.distributed.cp.kernels.token_layout import thd_layout

            self._index["layout"] = thd_layout(self.cu_seqlens_padded, self.group, self.world_size, self.rank)
        return self._index["layout"]

    # --- communication: token-major [n, H, D] tensors
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather local ``[T/W, H, D]`` to global-order ``[T, H, D]`` (no autograd)."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        _all_gather(out, x, group=self.group)
        return out.index_select(0, self.index("to_global", x.device))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Sum global-order ``[T, H, D]`` over the ranks and keep this rank's ``[T/W, H, D]`` (no autograd)."""
        if self.world_size == 1:
            return x
        ranked = x.index_select(0, self.index("to_ranks", x.device)).contiguous()
        out = x.new_empty((self.local_tokens, *x.shape[1:]))
        _reduce_scatter(out, ranked, group=self.group)
        return out


# A plain stack (not a ContextVar): autograd may run the backward on another thread.
_STACK: list[THDPlan] = []


def current_thd_plan() -> THDPlan | None:
    """The innermost active :class:`THDPlan`, or ``None``."""
    return _STACK[-1] if _STACK else None


@contextlib.contextmanager
def thd_context(plan: THDPlan, *, require_attention: bool = True) -> Iterator[THDPlan]:
    """Make ``plan`` active for THD attention calls inside the block.

    With ``require_attention`` (default) a block that ran no THD attention call raises ``RuntimeError``
    on exit: the model was not switched (:func:`set_thd_attention`) and each rank attended only within
    its own tokens.
    """
    start = plan.calls
    _STACK.append(plan)
    try:
        yield plan
    finally:
        _STACK.remove(plan)
    if require_attention and plan.calls == start:
        raise RuntimeError(
            "no THD attention ran inside the THD context: the model still uses another attention implementation, "
            "so each CP rank attended only within its own tokens. Call set_thd_attention(model) (attn "
            f"implementation {THD_ATTN_NAME!r}) before the forward pass"
        )


# ---------------------------------------------------------------------------------------------------------
# portable kernel: blocked flash kernels on prefix + diagonal blocks, merged by log-sum-exp


def _math_scores(q, k, causal: bool, scale: float | None):
    """``[1, Hkv, g, n, m]`` fp32+ scores of one block (GQA by grouping the query heads)."""
    hkv, d = k.shape[1], q.shape[-1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    qg = q.reshape(1, hkv, q.shape[1] // hkv, q.shape[2], d).to(dtype)
    s = torch.matmul(qg, k.to(dtype).unsqueeze(2).transpose(-1, -2)) * (
        scale if scale is not None else d**-0.5
    )
    if causal:  # square diagonal block: upper-left == lower-right
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s, qg


def _block_fwd(q, k, v, causal: bool, scale: float | None):
    """``(out [1, Hq, n, D], lse [1, Hq, n])`` of one block (q: ``[1, Hq, n, D]``, k/v: ``[1, Hkv, m, D]``).

    CPU: torch's blocked flash kernel (no score matrix). Other devices: exact math on the block (the
    ``flash_attn`` / ``te`` kernels are the fast CUDA paths).
    """
    if q.device.type == "cpu" and not FORCE_MATH_BLOCKS:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    s, qg = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype).unsqueeze(2))
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:3])


def _block_bwd(dout, q, k, v, out, lse, causal: bool, scale: float | None):
    """``(dq, dk, dv)`` of one block given the MERGED ``out``/``lse`` of its queries (exact: the
    probabilities are ``exp(s - lse)`` with the final LSE, and ``rowsum(dout * out)`` uses the final out)."""
    if q.device.type == "cpu" and not FORCE_MATH_BLOCKS:
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out, lse, 0.0, causal, scale=scale
        )[:3]
    hkv, g, n, d = k.shape[1], q.shape[1] // k.shape[1], q.shape[2], q.shape[3]
    s, qg = _math_scores(q, k, causal, scale)
    p = torch.exp(s - lse.reshape(1, hkv, g, n, 1).to(s.dtype))
    do = dout.reshape(1, hkv, g, n, d).to(s.dtype)
    vv = v.to(s.dtype).unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, vv.transpose(-1, -2))
    delta = (do * out.reshape(1, hkv, g, n, d).to(s.dtype)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * (scale if scale is not None else d**-0.5)
    dq = torch.matmul(ds, k.to(s.dtype).unsqueeze(2))
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _merge(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * torch.exp(lse_a - lse).unsqueeze(-1).to(out_a.dtype) + out_b * torch.exp(
        lse_b - lse
    ).unsqueeze(-1).to(out_b.dtype)
    return out, lse


def _head_major(x_tok: torch.Tensor) -> torch.Tensor:
    """Token-major ``[n, H, D]`` -> ``[1, H, n, D]`` (a view)."""
    return x_tok.permute(1, 0, 2).unsqueeze(0)


def _portable_forward(q, kg, vg, plan: THDPlan, scale):
    """q ``[1, Hq, Tl, D]``; kg/vg global ``[1, Hkv, T, D]``. Returns out ``[1, Hq, Tl, D]``, lse ``[1, Hq, Tl]``."""
    out = torch.zeros_like(q)
    lse = None
    for q_off, n, k_start, k_diag in plan.query_blocks():
        qs = q[:, :, q_off : q_off + n]
        o, lse_b = _block_fwd(qs, kg[:, :, k_diag : k_diag + n], vg[:, :, k_diag : k_diag + n], True, scale)
        if k_diag > k_start:
            op, lp = _block_fwd(qs, kg[:, :, k_start:k_diag], vg[:, :, k_start:k_diag], False, scale)
            o, lse_b = _merge(op, lp, o, lse_b)
        if lse is None:
            lse = q.new_zeros((*q.shape[:3],), dtype=lse_b.dtype)
        out[:, :, q_off : q_off + n] = o
        lse[:, :, q_off : q_off + n] = lse_b
    if lse is None:
        lse = q.new_zeros((*q.shape[:3],), dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
    return out, lse


def _portable_backward(dout, q, kg, vg, out, lse, plan: THDPlan, scale):
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
            g = _block_bwd(*args, kg[:, :, a:b], vg[:, :, a:b], *tail, causal, scale)
            dq[:, :, sl] += g[0]
            dkg[:, :, a:b] += g[1]
            dvg[:, :, a:b] += g[2]
    return dq, dkg, dvg


class _THDAttention(torch.autograd.Function):
    """Portable THD attention; saves only local tensors, re-gathers K/V in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, plan: THDPlan, scale):  # type: ignore[override]
        # q: [1, Hq, Tl, D], k/v: [1, Hkv, Tl, D] (this rank's tokens)
        kg = _head_major(plan.gather(k[0].transpose(0, 1)))
        vg = _head_major(plan.gather(v[0].transpose(0, 1)))
        out, lse = _portable_forward(q, kg, vg, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan = ctx.plan
        kg = _head_major(plan.gather(k[0].transpose(0, 1)))  # re-gathered, never kept from the forward
        vg = _head_major(plan.gather(v[0].transpose(0, 1)))
        dq, dkg, dvg = _portable_backward(dout, q, kg, vg, out, lse, plan, ctx.scale)
        dk = plan.reduce_scatter(dkg[0].transpose(0, 1))  # [Tl, Hkv, D]
        dv = plan.reduce_scatter(dvg[0].transpose(0, 1))
        return dq, dk.transpose(0, 1).unsqueeze(0), dv.transpose(0, 1).unsqueeze(0), None, None


# ---------------------------------------------------------------------------------------------------------
# CUDA kernels (not run in CI: no GPU; see scripts/gpu_check.py)


class _GatherKV(torch.autograd.Function):
    """All-gather token-major ``[Tl, H, D]`` to global ``[T, H, D]``; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, plan: THDPlan):  # type: ignore[override]
        ctx.plan = plan
        return plan.gather(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return ctx.plan.reduce_scatter(grad.contiguous()), None


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
        kg = _GatherKV.apply(k_tok, plan).index_select(0, k_idx)
        vg = _GatherKV.apply(v_tok, plan).index_select(0, k_idx)
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
    if query.shape[0] != 1 or query.shape[2] != plan.local_tokens:
        raise ValueError(
            f"THD attention expects this rank's {plan.local_tokens} tokens as one row [1, H, {plan.local_tokens}, D], "
            f"got query {tuple(query.shape)}; feed the model the batch returned by make_thd_batch_and_ctx"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    if plan.kernel == "flash_attn":
        return _flash_attn_thd(query, key, value, plan, scale)
    if plan.kernel == "te":
        return _te_thd(query, key, value, plan, scale)
    return _THDAttention.apply(query, key, value, plan, scale)


def thd_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """THD attention with transformers' attention-function signature (registered as ``"thd"``).

    ``query`` ``[1, Hq, T/W, D]``, ``key``/``value`` ``[1, Hkv, T/W, D]``; returns ``([1, T/W, Hq, D], None)``.
    ``attention_mask`` must be ``None`` (what transformers passes for this implementation: document
    boundaries come from the active :class:`THDPlan`).
    """
    plan = current_thd_plan()
    if plan is None:
        raise RuntimeError(
            f"attention implementation {THD_ATTN_NAME!r} was called outside a THD context; run the model inside "
            "`with ctx_factory():` from make_thd_batch_and_ctx, or switch the model back "
            "(model.set_attn_implementation('sdpa')) for runs without CP"
        )
    plan.calls += 1
    if attention_mask is not None:
        raise ValueError(
            "THD attention received an attention mask; document boundaries and padding come from the packed "
            "layout (seq_lens / seq_lens_padded). Do not pass attention_mask to the model"
        )
    if dropout:
        raise ValueError(
            f"THD attention does not implement attention dropout (got {dropout}); set the model's "
            "attention_dropout to 0"
        )
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise ValueError(
            f"{type(module).__name__} is not causal; THD attention computes causal attention only"
        )
    if kwargs.get("position_bias") is not None:
        raise CPUnsupportedError(
            f"distributed.cp_method=thd: {type(module).__name__} uses attention biases, which THD "
            "attention does not apply (docs/support_matrix.md)"
        )
    from automodel.distributed.cp.kernels.strategy import run_layer

    def native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return thd_attention(q, k, v, plan, scale).transpose(1, 2)

    # per layer: windows, chunks, sinks and softcapping run the halo kernel, MLA runs on padded V
    # (cp/kernels/strategy.py); transformers passes softcap only where the model applies it (sdpa refuses it)
    out = run_layer(
        module, query, key, value, kwargs, layout=plan.token_layout(), native=native, method="thd",
        scaling=scaling, dropout=dropout, apply_softcap=True,
    )
    return out, None


def register_thd_attention(name: str = THD_ATTN_NAME) -> str:
    """Register :func:`thd_attention_forward` in transformers' ``AttentionInterface`` (idempotent).

    Deliberately not registered as a mask implementation: transformers then builds no (local, wrong) mask
    and passes ``attention_mask=None``. Returns ``name``.
    """
    from transformers import AttentionInterface

    from automodel.distributed.torch_internals import ALL_MASK_ATTENTION_FUNCTIONS

    if name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        raise ValueError(f"{name!r} is a mask implementation name in transformers; pick another name")
    AttentionInterface.register(name, thd_attention_forward)
    return name


def set_thd_attention(model: torch.nn.Module, device_mesh: Any = None) -> str:
    """Switch an HF model to THD attention (mutates the model); returns the previous implementation name.

    Raises:
        CPUnsupportedError: a layer kind THD attention does not compute exactly (the message names the
            layers and the methods that would); a sliding window is checked at the first attention call.
        ValueError: the model's attention cannot be swapped (not a transformers ``PreTrainedModel``, or it
            does not dispatch attention through ``AttentionInterface``); the message names the model class.
    """
    del device_mesh  # the CP group comes with every batch (make_thd_batch_and_ctx)
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise ValueError(
            f"{type(model).__name__} is not a transformers PreTrainedModel, so its attention cannot be swapped for "
            f"THD attention ({THD_ATTN_NAME!r} in transformers' AttentionInterface); use a transformers causal LM, "
            "or call automodel.distributed.thd_attention.thd_attention from your own attention module"
        )
    # exact or refused: every layer kind of the model against what THD computes (a sliding window is
    # judged against the longest document at the first attention call)
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.registry import check_model_for_cp

    check_model_for_cp("thd", cached_profile(model), seq_len=None)
    from automodel.distributed.cp.linear_mixer import install_linear_mixers

    install_linear_mixers(model, cached_profile(model), "thd", current_thd_plan)  # docs/linear_mixers.md
    previous = model.config._attn_implementation
    register_thd_attention()
    try:
        model.set_attn_implementation(THD_ATTN_NAME)
    except (ValueError, TypeError, KeyError, NotImplementedError) as err:
        raise CPUnsupportedError(
            f"distributed.cp_method=thd: {type(model).__name__} refused attn_implementation={THD_ATTN_NAME!r} ({err}); its attention cannot be "
            "swapped, so distributed.cp_method=thd cannot run it: use distributed.cp_method=ring (unpacked rows)"
        ) from err
    if model.config._attn_implementation != THD_ATTN_NAME:
        raise CPUnsupportedError(
            f"distributed.cp_method=thd: {type(model).__name__} did not accept attn_implementation={THD_ATTN_NAME!r} (its attention is not "
            "dispatched through transformers' AttentionInterface); distributed.cp_method=thd cannot run it"
        )
    return previous


# ---------------------------------------------------------------------------------------------------------
# the batch


def make_thd_batch_and_ctx(
    device_mesh: Any,
    batch: dict[str, Any],
    kernel: str = "portable",
    cp_comm_type: str = "p2p",
    inner_attn: str | None = None,
    seq_lens_padding_value: int = -1000,
) -> tuple[Callable[[], contextlib.AbstractContextManager[THDPlan]], dict[str, Any]]:
    """Shard a BSHD batch (packed or not) for THD CP and build the context its attention calls need.

    Args:
        device_mesh: DeviceMesh with a ``"cp"`` dim, a 1-D CP mesh, a CP ``ProcessGroup``, or ``None``.
        batch: identical on every CP rank: ``input_ids`` ``[B, S]`` int64, ``labels`` ``[B, S]`` (already
            shifted, -100 = ignore), packed rows add ``position_ids`` ``[B, S]`` (restarting per
            document) and ``seq_lens`` / ``seq_lens_padded`` ``[B, P]`` (``-1000`` = unused); every padded
            length must be a multiple of ``2*cp_size``. Without ``seq_lens`` each row is one document
            (``attention_mask`` ``[B, S]``, if given, marks its real tokens, right-padded).
            Optional ``loss_mask`` ``[B, S]``.
        kernel: ``portable`` | ``flash_attn`` | ``te`` (see the module docstring).
        cp_comm_type: Transformer Engine's CP communication (``te`` kernel only).
        inner_attn: accepted (the recipe binds the model's previous implementation) and unused.
        seq_lens_padding_value: sentinel of unused ``seq_lens`` entries.

    Returns:
        ``(ctx_factory, local)``. ``local`` holds ``input_ids``, ``labels``, ``position_ids`` (global
        per-document positions; mRoPE ``[n_rope, 1, T/W]``), ``loss_mask`` if given, each ``[1, T/W]``:
        this rank's tokens of the flattened batch in TE's partition order; and ``padding_mask``,
        ``cu_seqlens``, ``cu_seqlens_padded``, ``max_seqlen`` as :func:`make_cp_batch_for_te` returns
        them. ``batch`` is not mutated. Inside ``ctx_factory()`` a model switched with
        :func:`set_thd_attention` computes exact per-document causal attention.

    Raises:
        ValueError: a document not padded to a multiple of ``2*cp_size``, inconsistent ``seq_lens`` /
            ``seq_lens_padded``, an unavailable kernel, anything :func:`make_cp_batch_for_te` rejects.
    """
    check_batch_forms("thd", batch)  # refuse what thd does not compute exactly (docs/batch_forms.md)
    del inner_attn
    if not isinstance(batch.get("input_ids"), torch.Tensor) or batch["input_ids"].dim() != 2:
        raise ValueError(f"the batch needs 'input_ids' [B, S]; got keys {sorted(batch)}")
    group, world, rank = _resolve_cp(device_mesh)
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

    def ctx_factory() -> contextlib.AbstractContextManager[THDPlan]:
        return thd_context(plan)

    return ctx_factory, local


class _CPSize:
    """The (size, local rank) slice of the DeviceMesh API that make_cp_batch_for_te reads."""

    ndim = 1

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank
