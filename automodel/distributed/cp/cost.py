"""A CP method's exchange per attention layer, inside a node and across nodes: the one cost model.

Each method declares what one rank sends per attention layer and micro-batch once
(:meth:`~automodel.distributed.cp.method.CPMethod.exchange_terms`: forward and backward bytes of each
collective, the CP ranks it spans, and the share of that pass's attention compute it runs under).
:func:`exchange_cost` places that declaration on the nodes (a collective whose ``span x tp_size``
consecutive ranks do not fit in one node crosses the network) and is what every consumer reads:

- ``cp_method: auto`` (:func:`~automodel.distributed.cp.choose.choose_cp_method`) ranks the methods by
  :attr:`ExchangeCost.weighted_bytes` (a byte across nodes weighs :data:`INTER_NODE_WEIGHT`);
- the dry run's step estimate (:mod:`automodel.training.step_estimate`) turns each term into seconds
  with the GPU's link bandwidths (:meth:`ExchangeCost.exposed_seconds`: what each pass hides under its
  own attention compute);
- ``recipe.plan_layouts`` and ``automodel plan`` rank layouts by that estimate.

Pure arithmetic on sizes: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from automodel.distributed.cp.method import CPMethod, ExchangeTerm
from automodel.distributed.cp.profile import ModelProfile

__all__ = ["COMPUTE_BYTES", "INTER_NODE_WEIGHT", "ExchangeCost", "exchange_cost", "span_inside_node"]

#: a byte sent across nodes costs this many bytes sent inside one (NVLink 450 GB/s per GPU against a node's
#: 8 x 400 Gb/s NICs shared by its 8 GPUs, 50 GB/s each: the H100 / H200 entries of
#: automodel/config/gpu_specs.py give 9); the step estimate uses the GPU's own bandwidths instead
INTER_NODE_WEIGHT = 8.0
#: bytes per element of what is exchanged when the caller does not say (bf16)
COMPUTE_BYTES = 2


def span_inside_node(span: int, node: int | None) -> bool:
    """A group of ``span`` consecutive ranks (row-major mesh) stays inside nodes of ``node`` ranks
    (``None``: one node holds every rank)."""
    return node is None or (span <= node and node % span == 0)


@dataclass(frozen=True)
class ExchangeCost:
    """One rank's CP attention exchange per attention layer and micro-batch (bytes; see the module docstring).

    Attributes:
        method: the method, its options bound (usp: ``ulysses_size``).
        terms: its :class:`~automodel.distributed.cp.method.ExchangeTerm` declarations at this layout.
        across_nodes: per term, whether its group spans nodes (its bytes go over the network).
    """

    method: CPMethod
    terms: tuple[ExchangeTerm, ...]
    across_nodes: tuple[bool, ...]

    def items(self) -> Iterator[tuple[ExchangeTerm, bool]]:
        """``(term, across_nodes)`` pairs."""
        return zip(self.terms, self.across_nodes)

    @property
    def intra_node_bytes(self) -> float:
        """Sent per rank inside a node, forward and backward together (no recomputed forward)."""
        return sum(t.bytes for t, across in self.items() if not across)

    @property
    def inter_node_bytes(self) -> float:
        """Sent per rank across nodes, forward and backward together (no recomputed forward)."""
        return sum(t.bytes for t, across in self.items() if across)

    @property
    def total_bytes(self) -> float:
        return self.intra_node_bytes + self.inter_node_bytes

    @property
    def weighted_bytes(self) -> float:
        """``cp_method: auto``'s cost: inside-node bytes + :data:`INTER_NODE_WEIGHT` x across-node bytes."""
        return self.intra_node_bytes + INTER_NODE_WEIGHT * self.inter_node_bytes

    def seconds(self, intra_bytes_per_s: float, inter_bytes_per_s: float, recompute: bool = False) -> float:
        """Link time of one layer's exchange (nothing hidden): each term's bytes over its link's bandwidth
        per rank (bytes/s); ``recompute``: the forward's exchange once more (activation checkpointing)."""
        return sum(
            (t.bytes + (t.forward_bytes if recompute else 0.0)) / (inter_bytes_per_s if across else intra_bytes_per_s)
            for t, across in self.items()
        )

    def exposed_seconds(
        self, intra_bytes_per_s: float, inter_bytes_per_s: float, forward_attention_s: float, recompute: bool = False
    ) -> float:
        """What one layer's exchange adds to the step: :meth:`ExchangeTerm.exposed_seconds` of every term on its
        link, the layer's forward attention compute taking ``forward_attention_s`` (backward twice that)."""
        return sum(
            t.exposed_seconds(inter_bytes_per_s if across else intra_bytes_per_s, forward_attention_s, recompute)
            for t, across in self.items()
        )


def _sizes(model: Any) -> SimpleNamespace:
    """``heads``, ``kv_heads``, ``head_dim``, ``hidden`` of a ModelProfile or of sizes that carry them."""
    if isinstance(model, ModelProfile):
        heads = model.num_attention_heads or 1
        hidden = model.hidden_size or 64 * heads
        return SimpleNamespace(
            heads=heads,
            kv_heads=model.num_key_value_heads or heads,
            head_dim=model.head_dim or max(1, hidden // heads),
            hidden=hidden,
        )
    return SimpleNamespace(heads=model.heads, kv_heads=model.kv_heads, head_dim=model.head_dim,
                           hidden=getattr(model, "hidden", model.heads * model.head_dim))  # fmt: skip


def _scaled(term: ExchangeTerm, factor: float) -> ExchangeTerm:
    return replace(term, forward_bytes=term.forward_bytes * factor, backward_bytes=term.backward_bytes * factor)


def _with_sparse_layers(method: CPMethod, profile: ModelProfile, r: Any, terms: tuple) -> tuple:
    """The terms per attention layer of a model with DSA layers: the method's own attention exchange for its
    share of the other attention layers, :meth:`CPMethod.sparse_exchange_terms` for the DSA layers' share (the
    latent KV and indexer keys gathered whatever the method)."""
    from automodel.distributed.cp.profile import SPARSE

    sparse = [layer for layer in profile.layers if layer.kind == SPARSE]
    if not sparse:
        return terms
    attention = [layer for layer in profile.layers if layer.is_attention or layer.hybrid_attention]
    share = len(sparse) / max(1, len(attention))
    known = [layer.sparse_widths for layer in sparse if layer.sparse_widths]
    # the layers' mean (DeepSeek-V4's differ per layer type: window only, HCA, CSA with its indexer)
    widths = tuple(sum(w[i] for w in known) / len(known) for i in (0, 1)) if known else None
    if widths is None:  # sizes not known: as much as one KV head of the model's head size and an indexer key
        head = _sizes(profile).head_dim
        widths = (2 * head, head)
    dsa = tuple(_scaled(t, share) for t in method.sparse_exchange_terms(widths, r))
    return tuple(_scaled(t, 1 - share) for t in terms if share < 1) + dsa


def exchange_cost(
    method: CPMethod,
    model: ModelProfile | Any,
    *,
    seq_len: int,
    cp_size: int,
    tp_size: int = 1,
    ranks_per_node: int | None = None,
    packed: bool = False,
    local_batch: int = 1,
    compute_bytes: int = COMPUTE_BYTES,
    head_chunks: int = 1,
) -> ExchangeCost:
    """What one rank of ``method`` sends per attention layer and micro-batch, inside a node and across nodes.

    Args:
        method: a CP method with its options bound (``get_cp_method("usp").with_options(ulysses_size=8)``;
            an unbound usp is costed as one group over ``cp_size``).
        model: a :class:`~automodel.distributed.cp.profile.ModelProfile`, or sizes with ``heads``,
            ``kv_heads``, ``head_dim`` (the memory planner's ModelDims).
        seq_len: the (padded) row length in tokens.
        cp_size: the CP group's size (``<= 1``: nothing is exchanged).
        tp_size: tensor parallelism (divides the heads; a CP group's ranks are ``tp_size`` apart).
        ranks_per_node: processes per node (``None``: every rank on one node).
        packed: rows hold several documents (thd_docs then exchanges only split documents).
        local_batch: rows per micro-batch on the rank.
        compute_bytes: bytes per exchanged element (2: bf16).
        head_chunks: ``distributed.ulysses_head_chunks`` (Ulysses, usp: one all-to-all per head group, the
            backward recomputing each group's; :func:`automodel.distributed.cp.head_chunks.head_chunked_exchange`).

    Returns:
        the :class:`ExchangeCost`. Pure.
    """
    r = SimpleNamespace(
        cp=cp_size, tp=tp_size, seq=seq_len, local_batch=local_batch, compute_bytes=compute_bytes,
        local_tokens=max(1, local_batch * seq_len // max(1, cp_size)), head_chunks=head_chunks,
    )  # fmt: skip
    terms = tuple(method.exchange_terms(_sizes(model), r, packed)) if cp_size > 1 else ()
    if cp_size > 1 and isinstance(model, ModelProfile):
        terms = _with_sparse_layers(method, model, r, terms)
    across = tuple(not span_inside_node(t.span * tp_size, ranks_per_node) for t in terms)
    return ExchangeCost(method, terms, across)
