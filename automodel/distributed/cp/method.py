"""The CP method interface: what a method declares, and the defaults most methods share.

A CP method is a strategy. The trainer, the config rules, the self-check, the dry run, the memory
planner and the VLM path call this interface and never branch on a method's name; adding a method
is one module defining a :class:`CPMethod` subclass plus one :func:`~automodel.distributed.cp.registry.register_cp_method`
call (``automodel/distributed/cp/__init__.py`` registers the built-in ones).

What a method declares:

- **exactness per layer kind**: :meth:`CPMethod.layer_problem` says why a layer of the
  :class:`~automodel.distributed.cp.profile.ModelProfile` is not computed exactly (``None``: it is), and
  :attr:`CPMethod.attn_implementations` which attention implementations it runs;
- **batch layout**: :attr:`layout`, :attr:`chunks_per_rank`, :meth:`token_ranges`,
  :meth:`row_multiple`, :attr:`supports_packed`, :attr:`splits_heads`;
- **preparing a model** (and undoing it, for the self-check): :meth:`prepare_model` returns a
  :class:`PreparedModel`;
- **sharding a batch**: :meth:`batch_function` returns ``fn(device_mesh, batch) -> (ctx_factory, batch)``;
- **memory terms** for the planner: :meth:`attention_workspace` and :meth:`attention_extent`;
- **its exchange** per attention layer, once: :meth:`exchange_terms` (:class:`ExchangeTerm`), read by
  ``cp_method: auto``, the step estimate and the layout rankings through
  :func:`automodel.distributed.cp.cost.exchange_cost`; its options (:meth:`options`, :meth:`with_options`);
- **its dry-run description**: :meth:`describe`;
- **its config problems**: :meth:`config_problems` (and :meth:`dataset_options` /
  :meth:`recipe_batch_options` for the keys only it reads).

The config, memory-plan and dry-run objects are passed in duck-typed (``cfg.distributed``, ``d.heads``,
``r.local_tokens`` ...): ``distributed`` sits below ``config`` and ``training`` and imports neither.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from automodel.distributed.cp.layout import head_tail_spans
from automodel.distributed.cp.profile import LayerSpec, ModelProfile

__all__ = ["AttentionSwitchingMethod", "CPMethod", "ExchangeTerm", "PreparedModel", "BatchFn"]

BatchFn = Callable[[Any, dict[str, Any]], tuple[Callable[[], Any], dict[str, Any]]]


@dataclass(frozen=True)
class ExchangeTerm:
    """One collective of a method's CP attention, per attention layer and micro-batch: a method's declaration
    of what it sends (:meth:`CPMethod.exchange_terms`). ``cp_method: auto``, the dry run's step estimate and
    ``recipe.plan_layouts`` read it through :func:`automodel.distributed.cp.cost.exchange_cost`, which also
    decides, from ``span``, the tensor-parallel size and the ranks per node, whether it crosses nodes.

    Attributes:
        what: the collective in words (e.g. ``"K and V of the other ranks' tokens"``).
        group: ranks taking part.
        span: consecutive CP ranks the group covers (a group strided over the CP group spans all of it);
            whether it stays inside a node is read from this.
        forward_bytes: sent per rank in the layer's forward (sent once more when activation checkpointing
            recomputes the forward).
        backward_bytes: sent per rank in the layer's backward.
        forward_overlap: the fraction of the layer's forward attention compute the forward's exchange runs
            under (its time is hidden up to that much compute, the rest adds to the step). 0: it does not
            overlap (an all-gather or all-to-all the attention waits for).
        backward_overlap: the same for the backward's exchange and the backward's attention compute (twice
            the forward's).
    """

    what: str
    group: int
    span: int
    forward_bytes: float
    backward_bytes: float
    forward_overlap: float = 0.0
    backward_overlap: float = 0.0
    #: fixed seconds per layer for collectives that add latency beyond their bytes (headwise Ulysses: one
    #: all-to-all per head group, ``distributed.ulysses_head_chunks``), in the forward and in the backward; never
    #: hidden under the attention compute
    forward_latency_s: float = 0.0
    backward_latency_s: float = 0.0

    @property
    def bytes(self) -> float:
        """Sent per rank, forward and backward together (no recomputed forward)."""
        return self.forward_bytes + self.backward_bytes

    @property
    def overlaps(self) -> bool:
        """Some of it runs under the attention compute."""
        return self.forward_overlap > 0 or self.backward_overlap > 0

    def exposed_seconds(self, bytes_per_s: float, forward_attention_s: float, recompute: bool = False) -> float:
        """Seconds this term adds to one layer's step on a link of ``bytes_per_s`` per rank, when the layer's
        forward attention compute takes ``forward_attention_s`` (its backward twice that): each pass's exchange
        hides under its own pass's overlapped compute only (a forward's all-gather cannot hide under the
        backward). ``recompute``: activation checkpointing runs the forward, and its exchange, once more."""
        fwd = max(0.0, self.forward_bytes / bytes_per_s - self.forward_overlap * forward_attention_s)
        bwd = max(0.0, self.backward_bytes / bytes_per_s - self.backward_overlap * 2 * forward_attention_s)
        fwd += self.forward_latency_s
        return fwd * (2 if recompute else 1) + bwd + self.backward_latency_s


@dataclass
class PreparedModel:
    """What :meth:`CPMethod.prepare_model` did to a model, and how to undo it.

    Attributes:
        module: the module whose attention was switched (``None``: nothing was switched).
        previous_attn: its attention implementation before the switch (the inner kernel).
        current_attn: the implementation the method installed.
        single_rank: at CP size 1 on packed rows, what computes each document and why (empty elsewhere):
            the model's own forward, or a method's document-aware attention on the one rank
            (:func:`~automodel.distributed.cp.bind.bind_cp_method`).
        packed_refusal: at CP size 1 in the own loop, why packed batches are refused (empty: they are not).
    """

    module: Any = None
    previous_attn: str | None = None
    current_attn: str | None = None
    single_rank: str = ""
    packed_refusal: str = ""

    @property
    def switched(self) -> bool:
        return self.module is not None

    def undo(self) -> None:
        """Put the model's own attention back (the self-check's reference run). Mutates the model."""
        if self.module is not None:
            self.module.set_attn_implementation(self.previous_attn)

    def redo(self) -> None:
        """Switch the method's attention in again after :meth:`undo`. Mutates the model."""
        if self.module is not None:
            self.module.set_attn_implementation(self.current_attn)


class CPMethod:
    """Base class of a context-parallel method (see the module docstring for the interface).

    Subclasses set the class attributes and override what differs; instances are stateless.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: ``model.attn_implementation`` values the method runs (``None``: any)
    attn_implementations: ClassVar[tuple[str, ...] | None] = None
    #: rows may hold several documents (``data.dataset.pack: true``) with boundaries respected
    supports_packed: ClassVar[bool] = False
    #: runs a VLM's text model on merged ``inputs_embeds`` (vision encoded on each rank's share)
    supports_vlm: ClassVar[bool] = False
    #: every CP rank holds this many equal chunks of every row
    chunks_per_rank: ClassVar[int] = 2
    #: ``"head_tail"``: rank r gets chunks r and 2W-1-r of 2W; ``"contiguous"``: the r-th of W slices
    layout: ClassVar[Literal["head_tail", "contiguous"]] = "head_tail"
    #: attention heads are divided over the CP ranks (``num_attention_heads % cp_size == 0``)
    splits_heads: ClassVar[bool] = False
    #: the ``distributed.<key>`` values only this method reads (usp: ``ulysses_size``); a plan layout that
    #: names another method leaves them unset
    option_keys: ClassVar[tuple[str, ...]] = ()
    #: the one of :attr:`option_keys` a plan layout's number after the method's name sets (``cp64.usp8``:
    #: ``ulysses_size=8``); ``None``: the method takes no number there
    layout_option: ClassVar[str | None] = None
    #: the backward's :meth:`attention_workspace` already holds the attention's dq, dk, dv (ring: its fp32
    #: accumulators become them), so the memory planner's tiled-layer attention moment does not count them again
    workspace_holds_qkv_grads: ClassVar[bool] = False

    # ------------------------------------------------------------------ exactness
    def layer_problem(self, layer: LayerSpec, seq_len: int | None) -> str | None:
        """Why this method does not compute ``layer`` exactly on rows of ``seq_len`` tokens (``None``:
        it does). ``seq_len=None``: the row length is not known yet (a window is then judged at the
        first attention call, against the real row)."""
        raise NotImplementedError

    def attn_problem(self, attn_implementation: str | None) -> str | None:
        """Why the method cannot run a model whose attention implementation is ``attn_implementation``."""
        if self.attn_implementations is None or attn_implementation is None:
            return None
        if attn_implementation in self.attn_implementations:
            return None
        return (
            f"its attention implementation is {attn_implementation!r} and {self.name} runs only "
            f"{' / '.join(self.attn_implementations)} (set model.attn_implementation / "
            f"attn_implementation={self.attn_implementations[0]!r} when building the model)"
        )

    # ------------------------------------------------------------------ layout
    def token_ranges(self, seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int]]:
        """Token ranges ``[start, end)`` of a ``seq_len`` row that CP rank ``cp_rank`` holds."""
        if cp_size <= 1:
            return [(0, seq_len)]
        if self.layout == "head_tail":  # whole chunks of seq_len // (2 * cp_size) tokens
            return head_tail_spans(seq_len - seq_len % (2 * cp_size), cp_size, cp_rank)
        base, extra = divmod(seq_len, cp_size)  # near-even, remainder on the first ranks
        start = cp_rank * base + min(cp_rank, extra)
        return [(start, start + base + (1 if cp_rank < extra else 0))]

    def row_multiple(self, cp_size: int, tp_size: int = 1, sequence_parallel: bool = False) -> tuple[int, str]:
        """The multiple a row's length must be for an even split, and the rule in words.

        ``chunks_per_rank * cp_size``, times ``tp_size`` with sequence parallelism; 1 at ``cp_size == 1``
        without it. E.g. ``(8, "2*cp_size*tp_size = 2*2*2 = 8 (sequence parallel)")``.
        """
        chunks = self.chunks_per_rank if cp_size > 1 else 1
        sp = sequence_parallel and tp_size > 1
        factors = [(chunks, str(chunks))] if chunks > 1 else []
        if cp_size > 1:
            factors.append((cp_size, "cp_size"))
        if sp:
            factors.append((tp_size, "tp_size"))
        if not factors:
            return 1, "1"
        multiple = math.prod(value for value, _ in factors)
        names = "*".join(name for _, name in factors)
        values = "*".join(str(value) for value, _ in factors)
        what = f"{names} = {multiple}" if len(factors) == 1 else f"{names} = {values} = {multiple}"
        return multiple, what + (" (sequence parallel)" if sp else "")

    def head_split_problem(self, num_attention_heads: int | None, cp_size: int, tp_size: int = 1) -> str | None:
        """Why the method cannot split ``num_attention_heads`` over ``cp_size`` ranks (``None``: it can); the
        fix it names changes the sizes (the caller adds the methods that run the model instead)."""
        tp_size = max(1, tp_size)
        if (
            not self.splits_heads
            or cp_size <= 1
            or num_attention_heads is None
            or num_attention_heads % tp_size
            or (num_attention_heads // tp_size) % cp_size == 0
        ):
            return None
        local = num_attention_heads // tp_size
        divisors = [d for d in range(2, local + 1) if local % d == 0]
        per_tp = f", {local} per TP rank (distributed.tp_size={tp_size})," if tp_size > 1 else ","
        return (
            f"distributed.cp_method={self.name} splits the attention heads over the CP ranks, but the model has "
            f"num_attention_heads={num_attention_heads}{per_tp} which is not divisible by "
            f"distributed.cp_size={cp_size}; set distributed.cp_size to a divisor of {local} ({divisors})"
            + (" or a smaller distributed.tp_size" if tp_size > 1 else "")
        )

    def head_chunk_ranks(self, cp_size: int) -> int | None:
        """The ranks one attention call's heads are split over by an all-to-all, when the method can run them in
        head groups (``distributed.ulysses_head_chunks``, :mod:`automodel.distributed.cp.head_chunks`): Ulysses
        the CP group, usp its Ulysses sub-group. ``None`` (the default): the method takes no head chunks."""
        return None

    # ------------------------------------------------------------------ model and batch
    def prepare_model(self, model: Any, device_mesh: Any) -> PreparedModel:
        """Prepare ``model`` once before CP steps (mutates it); default: nothing to do."""
        return PreparedModel()

    def batch_function(self, prepared: PreparedModel | None = None, **options: Any) -> BatchFn:
        """``fn(device_mesh, batch) -> (ctx_factory, local_batch)`` for every micro-batch."""
        fn = self._batch_function()
        if options:
            fn = functools.partial(fn, **options)
        return fn

    def _batch_function(self) -> BatchFn:
        raise NotImplementedError

    def recipe_batch_options(self, cfg: Any) -> dict[str, Any]:
        """Keyword options the recipe binds to the batch function from the config (default: none)."""
        return {}

    def dataset_options(self, cfg: Any, node: Any) -> dict[str, Any]:
        """Extra keyword arguments for a dataset node under this method (default: none)."""
        return {}

    # ------------------------------------------------------------------ config
    def configured(self, cfg: Any) -> CPMethod:
        """This method with the options of ``cfg`` (a RecipeConfig) bound, for the checks and the dry run
        that depend on them (e.g. usp's ``distributed.ulysses_size``). Default: ``self``. Call it only on
        a config whose :meth:`key_problems` are empty."""
        return self

    def cp_sub_groups(self, cp_size: int) -> list[tuple[str, int, bool]]:
        """The sub-groups the CP group is factored into, innermost (consecutive CP ranks) first: ``(name,
        size, warn_if_it_spans_nodes)``; the dry run's node plan reports each. Default: none (one CP group)."""
        return []

    def key_problems(self, cfg: Any) -> list[str]:
        """Bad values of the keys only this method reads, checked whichever method is selected (a typo is
        reported even while another method runs). Default: none. ``cfg`` is a RecipeConfig."""
        return []

    def config_problems(self, cfg: Any, cuda_available: bool | None) -> list[str]:
        """What this method, when selected, needs of the rest of the config (default: nothing)."""
        return []

    # ------------------------------------------------------------------ memory plan and dry run
    def attention_extent(self, d: Any, r: Any) -> tuple[int, int, int]:
        """``(heads, query tokens, key tokens)`` one rank's attention kernel sees per row (the eager
        ``S_q x S_k`` term); ``d``: ModelDims, ``r``: RunShape of the memory planner."""
        return d.heads // r.tp, r.local_tokens // r.local_batch, r.seq

    def attention_workspace(self, d: Any, r: Any) -> tuple[float, str]:
        """Bytes per rank the CP attention holds beyond the layer's own activations, and a note."""
        raise NotImplementedError

    def kernel_path(self, packed: bool) -> str:
        """How this method's attention reaches a CUDA kernel: ``"blocks"`` (the CP block kernels,
        :mod:`automodel.distributed.cp.cuda_blocks`) or ``"sdpa"`` (torch's SDPA dispatch, e.g. an unchanged
        inner ``sdpa`` kernel); ``packed``: rows hold several documents. Default: the block kernels."""
        return "blocks"

    def mask_scope(self, packed: bool) -> str | None:
        """Where transformers' attention mask is built on this method's path (the memory planner's ``attention
        masks``): ``"local"`` (the model builds it from the rank's tokens, as without CP: its attention function
        is a mask implementation), ``"global"`` (the method builds the whole row's mask per layer kind for its
        inner kernel) or ``None`` (default: the method's attention function is registered without a mask
        implementation, so ``create_causal_mask`` builds nothing); ``packed``: rows hold several documents."""
        return None

    def runs_halo_kernel(self) -> bool:
        """Whether sliding-window, chunked and ALiBi layers run the halo kernel
        (:func:`~automodel.distributed.cp.layers.strategy.run_layer`; the memory planner's block masks and ALiBi's
        score blocks). Default yes."""
        return True

    def halo_extent(self, d: Any, r: Any) -> tuple[int, int, int]:
        """``(heads, kv heads, query tokens per row)`` the halo kernel sees on a rank (the memory planner's halo block
        masks, ALiBi's and the exact-math layers' score blocks and K/V buffers): those of one kernel call
        (:meth:`kernel_call_tokens`). Default: the rank's tokens, all heads ``/ tp``; usp: ``H / U`` heads for ``U``
        ranks' tokens, the ring sub-group's share (planned at the whole CP group's, Gemma 2's and gpt-oss' score
        blocks read +60% to +82% at cp 4, ``scripts/bench_plan_families_cp.py --cp 4``)."""
        heads, kv_heads, q_tokens, _ = self.kernel_call_tokens(d, r)
        return heads, kv_heads, q_tokens

    def saves_repeated_kv(self, packed: bool, head_dim: int = 0) -> bool:
        """Whether a grouped-query layer's saved activations hold K/V repeated to the query heads (the memory
        planner's ``2 h`` per token). Default no: the block kernels (``blocks._BlockedAttention``, the document
        blocks) save this rank's q, k, v at the KV heads; ``packed``: rows hold several documents; ``head_dim``: the
        model's head size (0: unknown)."""
        return False

    def kernel_call_tokens(self, d: Any, r: Any) -> tuple[int, int, int, int]:
        """``(heads, kv heads, query tokens, key tokens)`` per row of ONE attention kernel call on a rank (what a
        kernel's backward buffers scale with: :func:`automodel.distributed.cp.attention_kernels.kernel_buffers`).
        Default: the block kernels of a method whose rank holds ``local_tokens / local_batch`` queries, each block
        against at most as many keys (a ring step, a document's chunk); all heads ``/ tp``."""
        q = r.local_tokens // r.local_batch
        return d.heads // r.tp, max(1, d.kv_heads // r.tp), q, q

    def exchange_terms(self, d: Any, r: Any, packed: bool = False) -> list[ExchangeTerm]:
        """What one rank sends per attention layer and micro-batch: the method's one declaration of its
        exchange (read through :func:`automodel.distributed.cp.cost.exchange_cost`; ``d``: the model's sizes,
        ``heads``, ``kv_heads``, ``head_dim``; ``r``: the run's shape, ``cp``, ``tp``, ``seq``,
        ``local_tokens``, ``local_batch``, ``compute_bytes``; ``packed``: rows hold several documents). The
        default reads :meth:`attention_extent`: a kernel that sees whole rows with ``heads / cp`` (Ulysses)
        moves q, k, v and the output by all-to-all (forward, and as much again in backward); one that sees
        the rank's queries against the whole row receives K and V of the other ranks' tokens (forward; in
        backward K/V again and dK/dV back). Neither overlaps the attention compute."""
        cp = r.cp
        if cp <= 1:
            return []
        heads_seen, q_tokens, _ = self.attention_extent(d, r)
        kv = d.kv_heads // r.tp * d.head_dim
        n = r.local_tokens
        if q_tokens >= r.seq:
            per_layer = (cp - 1) / cp * n * (2 * heads_seen * cp * d.head_dim + 2 * kv) * r.compute_bytes
            return [ExchangeTerm("all-to-all of q, k, v and the output", cp, cp, per_layer, per_layer)]
        per_layer = (cp - 1) * n * 2 * kv * r.compute_bytes
        return [ExchangeTerm("K and V of the other ranks' tokens", cp, cp, per_layer, 2 * per_layer)]

    def sparse_exchange_terms(self, widths: tuple[int, int], r: Any) -> list[ExchangeTerm]:
        """What one rank sends per DSA layer (:mod:`~automodel.distributed.cp.layers.sparse_attention`):
        ``widths`` = ``(latent KV, indexer key)`` elements per token, all-gathered over the CP group (forward);
        the latent KV's gradient reduce-scattered back (backward; the indexer has none). Doge's dynamic mask attention
        gathers K and V the same way (``widths`` = ``(2 * Hkv * D, 0)``; the term keeps DSA's words). Default: one group of ``r.cp`` ranks,
        whatever the method's split (every built-in method gathers the same state)."""
        latent, index = widths
        if r.cp <= 1:
            return []
        sent = (r.cp - 1) * r.local_tokens * r.compute_bytes
        return [ExchangeTerm("latent KV and indexer keys of the other ranks' tokens (DSA)", r.cp, r.cp,
                             sent * (latent + index), sent * latent)]  # fmt: skip

    def options(self) -> dict[str, Any]:
        """The ``distributed.<key>`` values bound to this instance (usp: ``ulysses_size``); default none."""
        return {}

    def with_options(self, **options: Any) -> CPMethod:
        """This method with ``options`` (``distributed.<key>`` values, as :meth:`options` and
        :meth:`auto_configs` give them) bound. Default: no options; ``ValueError`` for any."""
        if options:
            raise ValueError(f"cp_method {self.name} takes no options, got {options}")
        return self

    def auto_configs(self, cp_size: int, ranks_per_node: int | None) -> list[tuple[CPMethod, dict[str, Any]]]:
        """The configurations ``cp_method: auto`` may try, each ``(method with its options bound, the
        distributed.<key> values that select them)``. Default: this method as it is, with no keys."""
        return [(self, {})]

    def describe(self, seq: int, cp_size: int) -> str:
        """The dry run's line on how a row of ``seq`` tokens is split."""
        if cp_size == 1:
            return f"cp_method {self.name}: cp_size 1, no context parallelism (rows of {seq} tokens stay whole)"
        if self.layout == "head_tail":
            return (
                f"cp_method {self.name} ({self.summary}): each row of {seq} tokens is split into "
                f"{2 * cp_size} chunks (head-tail)"
            )
        return (
            f"cp_method {self.name} ({self.summary}): each row of {seq} tokens is split into "
            f"{cp_size} contiguous slices"
        )

    def describe_attention(self, b: int, heads: int, kv: int, head_dim: int, seq: int, cp_size: int, attn: str) -> list[str]:
        """Extra dry-run shape lines for the attention under CP (default: none)."""
        return []

    def __repr__(self) -> str:
        return f"<CP method {self.name!r}>"


class AttentionSwitchingMethod(CPMethod):
    """A method that runs its own attention implementation around the model's kernel (Ulysses, thd).

    :meth:`prepare_model` switches the model to it (``_switch() -> (set_fn, name)``, ``set_fn(model,
    mesh) -> previous implementation``); the batch function then gets ``inner_attn=<previous>``.
    """

    def _switch(self) -> tuple[Callable[[Any, Any], str], str]:
        raise NotImplementedError

    def prepare_model(self, model: Any, device_mesh: Any) -> PreparedModel:
        set_attention, name = self._switch()
        previous = set_attention(model, device_mesh)
        return PreparedModel(module=model, previous_attn=previous, current_attn=name)

    def batch_function(self, prepared: PreparedModel | None = None, **options: Any) -> BatchFn:
        if prepared is not None and prepared.switched:
            options = {"inner_attn": prepared.previous_attn, **options}
        return super().batch_function(prepared, **options)


def profile_problems(method: CPMethod, profile: ModelProfile, seq_len: int | None) -> list[str]:
    """Every reason ``method`` does not run ``profile``'s model exactly, grouped by reason."""
    by_reason: dict[str, list[int]] = {}
    for layer in profile.layers:
        reason = method.layer_problem(layer, seq_len)
        if reason is not None:
            by_reason.setdefault(reason, []).append(layer.index)
    problems = []
    attn = method.attn_problem(profile.attn_implementation)
    if attn is not None:
        problems.append(attn)
    for reason, indices in by_reason.items():
        which = "layer" if len(indices) == 1 else "layers"
        problems.append(f"{which} {_ranges(indices)}: {reason}")
    return problems


def _ranges(indices: list[int]) -> str:
    out, start, prev = [], indices[0], indices[0]
    for i in indices[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def standard_problem(
    method: str,
    layer: LayerSpec,
    seq_len: int | None,
    *,
    windows: bool = False,
    chunks: bool = False,
    sinks: bool = False,
    softcap: bool = False,
    mla: bool = False,
    position_scaled: bool = False,
    windows_checked_at_call: bool = False,
    alibi: bool = False,
) -> str | None:
    """The reason shared by the built-in methods for a layer they do not compute exactly (``None``: exact).

    The keyword flags say what the method's kernel applies exactly: sliding ``windows``, attention
    ``chunks``, ``sinks``, logit ``softcap``, ``mla`` (value heads of another size) and
    ``position_scaled`` queries (Llama 4's temperature, corrected to the global position), ``alibi`` (ALiBi's
    per-head bias from the key's position in its document, BLOOM's and MPT's; a method with it installs
    :mod:`~automodel.distributed.cp.layers.alibi`, which GPT-Neo's layers need too). Linear /
    state-space mixers are exact where :mod:`~automodel.distributed.cp.layers.linear_support` lists a kernel for
    the mixer and the method, sparse attention (DSA) where :mod:`~automodel.distributed.cp.layers.sparse_support`
    lists its class and the method; unrecognised layers are refused by every built-in method; ``mlp_only``
    layers are exact under every split.
    """
    from automodel.distributed.cp.profile import LINEAR, MLP_ONLY, REPORT_HINT, SPARSE, UNKNOWN

    if layer.kind == MLP_ONLY:
        return None
    if layer.kind == SPARSE:
        from automodel.distributed.cp.layers.sparse_support import sparse_attention_problem

        return sparse_attention_problem(method, layer)
    if layer.kind == LINEAR:
        from automodel.distributed.cp.layers.linear_support import linear_mixer_problem

        return linear_mixer_problem(method, layer)
    if layer.kind == UNKNOWN and layer.known_gap:  # known, and no CP kernel for it: the reason, no report request
        return f"{layer.describe()} is not exact under {method}: {layer.known_gap}"
    if layer.kind == UNKNOWN:
        return f"{layer.describe()} is not known to be exact under {method} ({REPORT_HINT})"
    deferred = (
        seq_len is None and windows_checked_at_call and layer.kind == "sliding_window" and not layer.window_in_mask_only
    )
    if windows and layer.window_in_mask_only and not layer.attends_like_full(seq_len):
        return (
            f"{layer.describe()} reaches only transformers' mask, not the attention function, and {method} builds "
            "its own mask"
        )
    if not layer.attends_like_full(seq_len) and not deferred:
        if (layer.kind == "sliding_window" and not windows) or (layer.kind == "chunked_attention" and not chunks):
            rows = f"the rows ({seq_len} tokens)" if seq_len else "the rows (their length is not known yet)"
            return f"{layer.describe()} is shorter than {rows}: {method} computes full causal attention over the row"
    if layer.sinks and not sinks:
        return f"attention sinks (a per-head sink logit in every softmax), which {method} does not apply"
    if layer.softcap and not softcap:
        return f"attention logit softcapping ({layer.softcap:g}), which {method}'s kernel does not apply"
    if layer.mla and not mla:
        return (
            f"value heads of size {layer.v_head_dim} and query/key heads of size {layer.qk_head_dim} (MLA), which "
            f"{method}'s kernel does not take"
        )
    if layer.own_code and not layer.alibi and not alibi:
        return (
            f"{layer.describe()} computed in the layer's own code (GPT-Neo), which {method} does not reach: the "
            "built-in methods make the layer hand q, k and v to their attention (cp/layers/alibi.py)"
        )
    if layer.alibi and not alibi:
        return (
            f"ALiBi (each score of head h gets slope_h * (j - i), computed in the layer's own code), which {method} "
            "does not apply: the built-in methods do (ulysses with each rank's head slopes over whole rows; ring, "
            "thd, thd_docs and usp with the bias of each key's position in its document, in the halo kernel)"
        )
    if layer.position_scaled and not position_scaled:
        return (
            "queries scaled by their absolute position (Llama 4's attention temperature on NoPE layers), read "
            "from cache_position, which each CP rank would compute from its own shard"
        )
    return None
