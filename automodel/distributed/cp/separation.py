"""Packed rows at CP size 1: does the model's own forward keep a row's documents apart, and if not, what does.

transformers reads a packed row's documents from ``position_ids`` that restart, but not every model honours
them: the mask builders see the restarts only when a model passes ``position_ids`` to them (with no cache and
no ``attention_mask``), and gpt-oss (eager attention with sinks, sliding and full layers) does not, so its
documents attend to each other (logits up to 0.6 off on a tiny model) while Llama's and Mistral's are exact.
State-space and linear mixers carry their state from one document into the next unless a kernel restarts it.
Whether a model's forward separates documents is therefore found **by a check on the model, not a list**:

- :func:`document_separation` runs the model itself (as the run will run it, eval mode, no grad, RNG untouched)
  on a tiny probe: two packed rows ``[A, B]`` and ``[A', B]`` (different first documents, the same second one,
  ``position_ids`` restarting at ``B``) and ``B`` alone. It separates documents when ``B``'s logits do not
  depend on the document before it and equal ``B`` run alone. The probe checks the model's plumbing (do the
  positions reach its masks and mixers); windows and chunks are transformers' shared mask code, applied per
  document once they do. A model that cannot run the probe (weights on the meta device, a forward that needs
  other inputs) or that has a token mixer the profile does not recognise is taken not to separate them; so is
  DeepSeek sparse attention run by transformers' own indexer (its top-k is taken over the whole packed row, and
  equal scores resolve differently from the document alone); with the CP DSA kernel installed it is probed.
- :func:`packed_method_at_one` is the document-aware path where it does not: a CP method that runs the model
  exactly on packed rows, computed on one rank (every method's attention at world size 1 is exact against
  each document alone: thd_docs keeps every document whole and local, thd and ulysses compute per document),
  or ``None``: then packing is refused at CP size 1, with the reason.

:func:`~automodel.distributed.cp.bind.bind_cp_method` (the recipe, the self-check's reference),
:func:`~automodel.distributed.cp.context.context_parallel` at a CP group of 1 and ring's
``make_cp_batch_and_ctx`` at a CP mesh of size 1 read these two.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from automodel.distributed.cp.method import CPMethod
from automodel.distributed.cp.profile import ModelProfile
from automodel.distributed.cp.registry import alternatives, run_problems
from automodel.errors import CPUnsupportedError

__all__ = [
    "PACKED_FORMS",
    "PROBE_LENGTHS",
    "Separation",
    "cache_off",
    "document_separation",
    "own_forward_on_packed_rows",
    "packed_method_at_one",
    "packed_refusal",
]

#: the batch forms (:func:`~automodel.distributed.cp.batch_forms.classify_batch`) of packed rows
PACKED_FORMS = frozenset({"restarts", "seq_lens", "seq_lens_only"})
#: the probe's documents: ``A`` (and ``A'``) then ``B``, in tokens
PROBE_LENGTHS = (5, 7)
#: the longest sliding window or attention chunk the probe reaches across (``B`` is made longer than the model's
#: longest); a model with longer ones is not probed (its own forward is not trusted with packed rows)
PROBE_MAX_WINDOW = 16384
#: ``B``'s logits next to ``A`` vs next to ``A'`` (the same row layout, so the same arithmetic): at most this
#: much of their largest magnitude apart when the documents are kept apart (a mixing model is off by percents)
_SAME_ROW_RTOL = 1e-4
#: ``B`` in the packed row vs ``B`` alone (another shape, so other rounding), by the parameters' dtype
_ALONE_RTOL = {torch.float64: 1e-8, torch.float32: 1e-4}
_ALONE_RTOL_16BIT = 3e-2

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Separation:
    """What :func:`document_separation` found.

    Attributes:
        separates: the model's own forward computes each document of a packed row as if alone.
        reason: in words, with the figures (completes "the model's own forward ...").
    """

    separates: bool
    reason: str


def _attn(model: Any) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None)


def document_separation(model: torch.nn.Module) -> Separation:
    """Whether ``model``'s own forward keeps the documents of a packed row apart (probed once per model object
    and attention implementation; see the module docstring). Runs three tiny forwards of ``model`` in eval mode
    under ``torch.no_grad()``; its training mode and the global RNG states are restored, nothing else changes.
    Call it on every rank of a run together (a sharded model's forward is collective)."""
    attn = _attn(model)
    found = _CACHE.get(model, {})
    if attn not in found:
        found[attn] = _probe(model)
        _CACHE[model] = found
    return found[attn]


def _first_param(model: torch.nn.Module) -> torch.Tensor | None:
    for p in model.parameters():
        return p
    return None


def _probe(model: torch.nn.Module) -> Separation:
    sparse = _sparse_layers_without_kernel(model)
    if sparse:  # transformers' DSA takes each query's top-k over the whole row: not the document alone's
        return Separation(
            False,
            f"runs DeepSeek sparse attention ({sparse}) with transformers' indexer, which takes each query's top-k "
            "over the whole packed row: equal scores resolve differently from the document alone (the CP DSA "
            "kernel, installed by bind_cp_method and every CP method, takes it per document)",
        )
    unknown = _unknown_layers(model)
    if unknown:  # the probe vouches for the model's plumbing of position_ids, not for mixers it does not know
        return Separation(
            False,
            f"has token mixers the model profile does not recognise ({unknown}), which a probe on a few tokens "
            "cannot vouch for (their behaviour may change with the row's length, as a sparse-attention indexer's "
            "top-k does)",
        )
    if _alibi_layers(model):  # the bias of a key's index in the row: Falcon's rounds it to bf16 (not shift-invariant)
        return Separation(
            False,
            "adds ALiBi from each key's index in the packed row (Falcon rounds slope x index to bf16, so the bias "
            "differs from the document alone's past the probe's few tokens); the CP methods' attention adds it for "
            "each key's index in its document",
        )
    param = _first_param(model)
    if param is None or param.is_meta:
        return Separation(False, "could not be probed (its weights are on the meta device)")
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        return Separation(False, "could not be probed (no vocabulary size)")
    device = getattr(param, "device", torch.device("cpu"))
    if hasattr(param, "to_local"):  # a DTensor parameter: the local shard's device
        device = param.to_local().device
    n_a, n_b = PROBE_LENGTHS
    reach = _longest_window(model)
    if reach > PROBE_MAX_WINDOW:
        return Separation(
            False,
            f"has windows or chunks of {reach} tokens, longer than the probe runs ({PROBE_MAX_WINDOW}): where a "
            "document crosses one, the probe cannot vouch that its boundaries are the document's own",
        )
    n_b = max(n_b, reach + 3)  # B crosses a window / chunk boundary: at the row's index, or at its own position?
    gen = torch.Generator().manual_seed(1234)
    a, a2, b = (torch.randint(0, int(vocab), (n,), generator=gen) for n in (n_a, n_a, n_b))
    packed = torch.stack([torch.cat([a, b]), torch.cat([a2, b])]).to(device)
    positions = torch.cat([torch.arange(n_a), torch.arange(n_b)]).expand(2, -1).to(device)
    was_training = model.training
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.eval()
            rows = _logits(model, packed, positions)[:, n_a:].double()
            alone = _logits(model, b[None].to(device), torch.arange(n_b, device=device)[None])[0].double()
    except Exception as e:  # noqa: BLE001 - any failure: not known to separate, the exact path runs instead
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return Separation(False, f"could not be probed ({type(e).__name__}: {first})")
    finally:
        model.train(was_training)
    scale = max(float(alone.abs().max()), 1e-6)
    mixed = float((rows[0] - rows[1]).abs().max()) / scale
    off = float((rows[1] - alone).abs().max()) / scale
    dtype = param.dtype
    alone_tol = _ALONE_RTOL.get(dtype, _ALONE_RTOL_16BIT)
    if mixed > _SAME_ROW_RTOL:
        return Separation(
            False,
            f"lets the documents of a packed row attend to each other (a {n_b}-token document's logits move by "
            f"{mixed:.2g} of their scale when the document before it changes)",
        )
    if off > alone_tol:
        return Separation(
            False,
            f"does not compute a packed document as if alone (its logits differ from the document run alone by "
            f"{off:.2g} of their scale)",
        )
    return Separation(True, "computes each document of a packed row as if alone (probed)")


def _sparse_layers_without_kernel(model: torch.nn.Module) -> str:
    """The DSA layers (``sparse_attention``) whose attention module does not carry the CP DSA kernel
    (:func:`~automodel.distributed.cp.layers.sparse_attention.install_sparse_attention`), in words (empty: none)."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.layers.sparse_layers import installed_on
    from automodel.distributed.cp.profile import SPARSE

    try:
        profile = cached_profile(model)
    except Exception:  # noqa: BLE001 - _unknown_layers reports it
        return ""
    sparse = [layer for layer in profile.layers if layer.kind == SPARSE]
    if not sparse or installed_on(model) >= len(sparse):
        return ""
    return f"layers {', '.join(str(layer.index) for layer in sparse[:8])}: {sparse[0].describe()}"


def _longest_window(model: torch.nn.Module) -> int:
    """The longest sliding window or attention chunk of ``model``'s layers in tokens (0: none, or the profile failed:
    :func:`_unknown_layers` reports that). transformers' mask code places a chunk's boundaries at the row's index on
    some releases (Llama 4 on 5.17) and at each document's own positions on others, which a probe shorter than the
    chunk does not see."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.profile import CHUNKED, SLIDING

    try:
        profile = cached_profile(model)
    except Exception:  # noqa: BLE001
        return 0
    reach = [layer.window if layer.kind == SLIDING else layer.chunk for layer in profile.layers
             if layer.kind in (SLIDING, CHUNKED)]  # fmt: skip
    return max((int(w) for w in reach if w), default=0)


def _unknown_layers(model: torch.nn.Module) -> str:
    """The layers :func:`~automodel.distributed.cp.profile.profile_model` does not recognise, in words (empty:
    none). Windows and chunks are transformers' shared mask code, which the probe checks across the longest of them
    (:func:`_longest_window`); a mixer of unknown kind may depend on lengths the probe does not reach."""
    from automodel.distributed.cp.guard import cached_profile
    from automodel.distributed.cp.profile import UNKNOWN

    try:
        profile = cached_profile(model)
    except Exception as e:  # noqa: BLE001 - a model the profile cannot read is not vouched for either
        return f"the profile failed: {type(e).__name__}"
    layers = [layer for layer in profile.layers if layer.kind == UNKNOWN]
    if not layers:
        return ""
    return f"layers {', '.join(str(layer.index) for layer in layers[:8])}: {layers[0].describe()}"


def _alibi_layers(model: torch.nn.Module) -> bool:
    """Whether the model's profile has ALiBi layers in the layer's own code (BLOOM, MPT, Falcon with alibi=True)."""
    from automodel.distributed.cp.guard import cached_profile

    try:
        return any(layer.alibi for layer in cached_profile(model).layers)
    except Exception:  # noqa: BLE001 - _unknown_layers reports a profile that fails
        return False


def _logits(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, position_ids=positions, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if hasattr(logits, "full_tensor"):  # loss-parallel logits sharded over the vocabulary
        logits = logits.full_tensor()
    return logits


def packed_method_at_one(profile: ModelProfile, preferred: CPMethod | None = None) -> CPMethod | None:
    """The CP method whose document-aware attention computes ``profile``'s model on packed rows at CP size 1:
    ``preferred`` (the run's method) if it runs them exactly, else the first registered one that does
    (:func:`~automodel.distributed.cp.registry.alternatives`); ``None``: no method does. A method that needs
    options to split a group (usp's ``ulysses_size``) has no one-rank form of its own: another one runs instead."""
    if (
        preferred is not None
        and not preferred.option_keys
        and not run_problems(preferred, profile, cp_size=1, packed=True)
    ):
        return preferred
    found = alternatives(profile, cp_size=1, packed=True)
    return found[0][0] if found else None


def packed_refusal(profile: ModelProfile, separation: Separation, how: str) -> str:
    """The refusal of packed rows at CP size 1: what the model's forward does and why nothing else runs them.
    ``how``: the sentence's ending naming the fix (e.g. a config key)."""
    return (
        f"packed rows (several documents per row) at CP size 1: {profile.architecture} "
        f"(model_type={profile.model_type}, attention {profile.attn_implementation!r}) {separation.reason}: its "
        f"own forward could train on documents mixed together, and no CP method's document-aware attention runs "
        f"this model exactly either; {how}"
    )


def cache_off(model: Any) -> list[tuple[Any, Any]]:
    """Set ``use_cache = False`` on ``model``'s config and its text config (mutates them); ``(config, value
    before)`` for each one changed. transformers builds per-document masks from restarting ``position_ids`` only
    without a cache, so a packed row run with one mixes its documents (Llama too); CP never uses the cache."""
    from automodel.distributed.cp.profile import text_config

    changed: list[tuple[Any, Any]] = []
    config = getattr(model, "config", None)
    for c in (config, text_config(config) if config is not None else None):
        if c is not None and getattr(c, "use_cache", None) and all(c is not d for d, _ in changed):
            changed.append((c, c.use_cache))
            c.use_cache = False
    return changed


@contextlib.contextmanager
def own_forward_on_packed_rows(entry: str) -> Iterator[None]:
    """Inside the block, the first transformers model called runs packed rows with its own forward: it is probed
    first (:func:`document_separation`) and refused if that mixes the documents; its cache is off for the block.

    ``entry``: the own-loop function that runs the model's own forward (named in the refusal).

    Raises:
        CPUnsupportedError: at the model's first forward, before any layer runs, when its own forward does not
            keep the documents of a packed row apart; the message names the methods that compute them.
    """
    from automodel.distributed.cp.guard import check_on_first_forward

    restore: list[tuple[Any, Any]] = []

    def probe(model: Any, profile: ModelProfile) -> None:
        separation = document_separation(model)
        if not separation.separates:
            found = [m.name for m, _ in alternatives(profile, cp_size=1, packed=True)]
            run = (
                f"context_parallel(model, mesh, method={found[0]!r}) computes each document alone at any CP size "
                f"(methods that run this model's packed rows: {' | '.join(found)})"
                if found
                else "no CP method runs this model's packed rows exactly"
            )
            raise CPUnsupportedError(
                f"{entry} at CP size 1 runs the model's own forward on packed rows (several documents per row), and "
                f"{profile.architecture} (model_type={profile.model_type}, attention "
                f"{profile.attn_implementation!r}) {separation.reason}: it could train on documents mixed "
                f"together, so it is refused; {run}, or give one document per row"
            )
        restore.extend(cache_off(model))

    try:
        with check_on_first_forward(lambda profile: None, probe):
            yield
    finally:
        for config, value in restore:
            config.use_cache = value
