"""What each per-layer memory technique did, for the run log once after the first training step.

A technique is only worth its memory term if it runs: a wrapper order (FSDP2's class swap, ``torch.compile``,
a new transformers release) can switch one off without changing a number (issue 41). The trainer resets the
counters before its first step (after the CP self-check, whose steps are not training), and after that step
logs one line per technique that is on, with what it did, from the counters the techniques keep themselves:

- activation checkpointing (:class:`automodel.models.block_call.BlockCounts`): checkpointed calls and their
  recomputations in the backward, per decoder layer; every layer recomputed once per micro-batch;
- activation offload (:class:`automodel.training.activation_offload.OffloadStore`): tensors and bytes moved to
  the host per layer (the layer's inputs: one ``[B, S_local, H]`` hidden-state tensor per micro-batch), the
  host pool;
- tiled MLP (:class:`automodel.models.tiled_mlp.TileCounts`): MLP calls, those run through the tiled Function (one
  tile or more) and those inside the tiled layer's tiles, tiles, the largest tile, the tiles recomputed by the
  tiled backward; every call is one or the other;
- tiled layer (:class:`automodel.models.tiled_layer.TiledLayerCounts`): the decoder layers run in tiles, their
  calls and tiles, the tiles recomputed by the tiled backward;
- tiled final norm (:func:`automodel.models.tiled_mlp.tile_final_norms`, with either of those two): the same counts as the
  tiled MLP's, for the norms outside the decoder layers;
- tiled layer norms (:func:`automodel.models.tiled_mlp.tile_layer_norms`, with the tiled MLP): the same counts for the
  decoder layers' hidden-size norms; every call is tiled or inside a tiled layer's tile;
- checkpoint groups (:class:`automodel.models.checkpoint_groups.GroupCounts`): the layer inputs kept (the groups'
  first layers', offloaded or on the device), those not kept and rebuilt in the backward, the layer forwards run
  again to rebuild them;
- headwise Ulysses (:data:`automodel.distributed.cp.head_chunks.HEAD_GROUP_COUNTS`): attention calls run in head
  groups, the groups run in the forward and recomputed in the backward;
- attention head groups without CP (:data:`automodel.models.attention_head_chunks.ATTENTION_HEAD_GROUP_COUNTS`,
  ``model.attention_head_chunks``): the same counts.

A technique that is on but did not act (a layer not recomputed, the offload moving more or fewer tensors than
the layer inputs) is a WARNING line naming what to report; :func:`technique_problems` lists them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from automodel.distributed.cp.head_chunks import HEAD_GROUP_COUNTS
from automodel.models.attention_head_chunks import ATTENTION_HEAD_GROUP_COUNTS
from automodel.models.block_call import block_calls
from automodel.models.checkpoint_groups import checkpoint_groups_of
from automodel.models.tiled_layer import layer_tile_counts
from automodel.models.tiled_mlp import tile_counts
from automodel.training.activation_offload import OffloadStore

__all__ = ["collect_technique_report", "reset_technique_counts", "technique_lines", "technique_problems"]


def reset_technique_counts(model: nn.Module, store: OffloadStore | None) -> None:
    """Zero every counter the techniques keep on ``model`` (and ``store``'s). Mutates them."""
    for call in block_calls(model):
        call.counts.reset()
    for counts in tile_counts(model) + tile_counts(model, "final_norm") + tile_counts(model, "layer_norm"):
        counts.reset()
    for layer_counts in layer_tile_counts(model):
        layer_counts.reset()
    if store is not None:
        store.reset_counts()
    groups = checkpoint_groups_of(model)
    if groups is not None:
        groups.counts.reset()
    HEAD_GROUP_COUNTS.reset()
    ATTENTION_HEAD_GROUP_COUNTS.reset()


def collect_technique_report(
    model: nn.Module, store: OffloadStore | None, micro_batches: int, head_chunks: int = 1,
    attention_head_chunks: int = 1,
) -> dict[str, Any]:
    """What the techniques did since :func:`reset_technique_counts`: a JSON-able dict with one entry per technique
    that is on (``activation_checkpointing``, ``activation_offload``, ``tiled_mlp``, ``headwise_ulysses`` when
    ``head_chunks`` (``distributed.ulysses_head_chunks``) is above 1, ``attention_head_groups`` when
    ``attention_head_chunks`` (``model.attention_head_chunks``, no CP) is); ``micro_batches`` is how many
    forward/backward passes that was."""
    report: dict[str, Any] = {"micro_batches": micro_batches}
    if head_chunks > 1:
        c = HEAD_GROUP_COUNTS
        report["headwise_ulysses"] = {"head_chunks": head_chunks, "calls": c.calls, "groups": c.groups,
                                      "recomputed": c.recomputed, "max_groups": c.max_groups}  # fmt: skip
    if attention_head_chunks > 1:
        c = ATTENTION_HEAD_GROUP_COUNTS
        report["attention_head_groups"] = {"head_chunks": attention_head_chunks, "calls": c.calls, "groups": c.groups,
                                           "recomputed": c.recomputed, "max_groups": c.max_groups}  # fmt: skip
    calls = block_calls(model)
    checkpointed = calls if any(c.checkpoint for c in calls) else []  # every block, when checkpointing is on
    if checkpointed:
        report["activation_checkpointing"] = {
            "layers": len(checkpointed),
            "layers_recomputed": sum(c.counts.recomputed > 0 for c in checkpointed),
            "checkpointed_calls": sum(c.counts.checkpointed for c in checkpointed),
            "recomputed": sum(c.counts.recomputed for c in checkpointed),
            "recomputed_per_layer": [c.counts.recomputed for c in checkpointed],
        }
    groups = checkpoint_groups_of(model)
    if groups is not None and checkpointed:
        g = groups.counts
        report["checkpoint_groups"] = {
            "layers_per_group": groups.size, "groups": len(groups.starts), "layers": len(groups.calls),
            "starts": groups.starts, "kept": g.kept, "dropped": g.dropped, "rebuilt": g.rebuilt, "replayed": g.replayed,
            "offloaded": store is not None,
        }  # fmt: skip
    if store is not None:
        per_layer = store.per_layer()
        stats = store.stats()
        report["activation_offload"] = {
            "layers": len(per_layer),
            "tensors": sum(n for n, _ in per_layer.values()),
            "bytes": sum(b for _, b in per_layer.values()),
            "per_layer": {str(i): {"tensors": n, "bytes": b} for i, (n, b) in per_layer.items()},
            # the positional tensor inputs of the checkpointed calls: what checkpointing keeps, all offload may move
            # (with checkpoint groups, the groups' first layers' only: the others keep none)
            "layer_inputs": sum(c.counts.input_tensors for c in checkpointed if c.group is None or not c.group.position),
            "host_bytes": stats.host_bytes,
            "peak_host_bytes": stats.peak_host_bytes,
        }
    tiles = tile_counts(model)
    if tiles:
        report["tiled_mlp"] = {"mlps": len(tiles), **_tile_totals(tiles),
                               "in_layer_tiles": sum(t.in_layer_tiles for t in tiles)}  # fmt: skip
    norms = tile_counts(model, "final_norm")
    if norms:
        report["tiled_final_norm"] = {"norms": len(norms), **_tile_totals(norms)}
    layer_norms = tile_counts(model, "layer_norm")
    if layer_norms:
        report["tiled_layer_norms"] = {"norms": len(layer_norms), **_tile_totals(layer_norms),
                                       "in_layer_tiles": sum(t.in_layer_tiles for t in layer_norms)}  # fmt: skip
    layers = layer_tile_counts(model)
    if layers:
        report["tiled_layer"] = {
            "layers": len(layers),
            "layers_tiled": sum(t.calls > 0 for t in layers),
            "calls": sum(t.calls for t in layers),
            "tiles": sum(t.tiles for t in layers),
            "backward_tiles": sum(t.backward_tiles for t in layers),
            "max_tile_tokens": max(t.max_tile_tokens for t in layers),
            "max_tokens": max(t.max_tokens for t in layers),
        }
    return report


def _tile_totals(counts: list) -> dict[str, int]:
    """Calls, tiled calls, tiles, backward tiles, the largest tile and call over tiled modules' ``TileCounts``."""
    return {
        "calls": sum(t.calls for t in counts),
        "tiled_calls": sum(t.tiled_calls for t in counts),
        "tiles": sum(t.tiles for t in counts),
        "backward_tiles": sum(t.backward_tiles for t in counts),
        "max_tile_tokens": max(t.max_tile_tokens for t in counts),
        "max_tokens": max(t.max_tokens for t in counts),
    }


def _tiles_said(t: dict[str, int]) -> str:
    """The run log's words for :func:`_tile_totals` (and the one-tile calls inside the tiled layer's tiles, where
    ``t`` counts them and there were some)."""
    inside = t.get("in_layer_tiles", 0)
    return (f"{t['calls']} call(s) of up to {t['max_tokens']} tokens, {t['tiled_calls']} run in {t['tiles']} tile(s) of "
            f"at most {t['max_tile_tokens']} tokens; {t['backward_tiles']} tile(s) recomputed by the tiled backward"
            + (f"; {inside} inside the tiled layer's tiles" if inside else ""))  # fmt: skip


def _untiled(t: dict[str, int]) -> int:
    """Calls in ``t`` (:func:`_tile_totals`) that ran whole: neither tiled nor inside the tiled layer's tiles."""
    return t["calls"] - t["tiled_calls"] - t.get("in_layer_tiles", 0)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def technique_lines(report: dict[str, Any]) -> list[str]:
    """One log line per technique in ``report`` (:func:`collect_technique_report`)."""
    m = report["micro_batches"]
    lines = []
    ac = report.get("activation_checkpointing")
    if ac is not None:
        lines.append(
            f"activation checkpointing: {ac['layers_recomputed']} of {ac['layers']} decoder layers recomputed in "
            f"the backward ({ac['recomputed']} recomputation(s) of {ac['checkpointed_calls']} checkpointed "
            f"call(s), {m} micro-batch(es))"
        )
    off = report.get("activation_offload")
    if off is not None:
        per = off["per_layer"]
        shapes = {(v["tensors"], v["bytes"]) for v in per.values()}
        if len(shapes) == 1:
            (n, b) = next(iter(shapes))
            each = f"each of {off['layers']} layers: {n} tensor(s), {_size(b)}"
        else:
            each = ", ".join(f"layer {i}: {v['tensors']} tensor(s), {_size(v['bytes'])}" for i, v in per.items())
        lines.append(
            f"activation offload: {off['tensors']} tensor(s), {_size(off['bytes'])} moved to the host over {m} "
            f"micro-batch(es) ({each}; the layer inputs: {off['layer_inputs']}); host pool {_size(off['host_bytes'])}"
        )
    cg = report.get("checkpoint_groups")
    if cg is not None:
        where = "offloaded to the host" if cg["offloaded"] else "kept on the device"
        lines.append(
            f"checkpoint groups: {cg['groups']} group(s) of up to {cg['layers_per_group']} of {cg['layers']} decoder "
            f"layers; {cg['kept']} layer input(s) {where} (layers {', '.join(map(str, cg['starts']))}), {cg['dropped']} "
            f"not kept, {cg['rebuilt']} rebuilt in the backward by {cg['replayed']} layer forward(s) run again "
            f"({m} micro-batch(es))"
        )
    tm = report.get("tiled_mlp")
    if tm is not None:
        lines.append(f"tiled MLP: {tm['mlps']} MLP(s), {_tiles_said(tm)}")
    tn = report.get("tiled_final_norm")
    if tn is not None:
        lines.append(f"tiled final norm: {tn['norms']} norm(s) outside the decoder layers, {_tiles_said(tn)}")
    ln = report.get("tiled_layer_norms")
    if ln is not None:
        lines.append(f"tiled layer norms: {ln['norms']} norm(s) of the decoder layers, {_tiles_said(ln)}")
    tl = report.get("tiled_layer")
    if tl is not None:
        lines.append(
            f"tiled layer: {tl['layers_tiled']} of {tl['layers']} decoder layers, {tl['calls']} call(s) of up to "
            f"{tl['max_tokens']} tokens in {tl['tiles']} tile(s) of at most {tl['max_tile_tokens']} tokens (pre and "
            f"post parts); {tl['backward_tiles']} tile(s) recomputed by the tiled backward"
        )
    hw = report.get("headwise_ulysses")
    if hw is not None:
        lines.append(
            f"headwise Ulysses: {hw['calls']} attention call(s) in {hw['head_chunks']} head groups each, "
            f"{hw['groups']} group(s) run one at a time in the forward and {hw['recomputed']} recomputed group by "
            f"group in the backward ({m} micro-batch(es))"
        )
    ag = report.get("attention_head_groups")
    if ag is not None:
        lines.append(
            f"attention head groups (model.attention_head_chunks={ag['head_chunks']}, no CP): {ag['calls']} attention "
            f"call(s) in {ag['head_chunks']} head groups each, {ag['groups']} group(s) run one at a time in the "
            f"forward and {ag['recomputed']} recomputed group by group in the backward ({m} micro-batch(es))"
        )
    return lines


def technique_problems(report: dict[str, Any]) -> list[str]:
    """What a technique that is on failed to do in ``report`` (empty: each did its job)."""
    problems = []
    ac = report.get("activation_checkpointing")
    if ac is not None and ac["layers_recomputed"] < ac["layers"]:
        missing = [i for i, n in enumerate(ac["recomputed_per_layer"]) if n == 0]
        problems.append(
            f"model.activation_checkpointing=true but {len(missing)} of {ac['layers']} decoder layers (e.g. layer "
            f"{missing[0]}) were not recomputed in the backward: checkpointing is off for them"
        )
    off = report.get("activation_offload")
    if off is not None:
        if off["tensors"] == 0:
            problems.append("model.activation_offload=true but no tensor was moved to the host")
        elif off["tensors"] > off["layer_inputs"]:
            problems.append(
                f"model.activation_offload=true moved {off['tensors']} tensors to the host, more than the "
                f"{off['layer_inputs']} layer inputs checkpointing keeps: the layers' activations are offloaded "
                f"instead of recomputed"
            )
        elif off["tensors"] < off["layer_inputs"]:
            problems.append(
                f"model.activation_offload=true moved only {off['tensors']} of the {off['layer_inputs']} layer "
                f"inputs to the host: the others stayed on the device"
            )
    cg = report.get("checkpoint_groups")
    if cg is not None and (cg["dropped"] == 0 or cg["rebuilt"] != cg["dropped"]):
        problems.append(
            f"model.checkpoint_group_layers={cg['layers_per_group']} but {cg['dropped']} layer input(s) were not kept "
            f"and {cg['rebuilt']} rebuilt in the backward: the groups did not act as planned"
        )
    tm = report.get("tiled_mlp")
    if tm is not None and _untiled(tm):
        problems.append(
            f"model.tiled_mlp is on but {_untiled(tm)} of {tm['calls']} "
            f"MLP call(s) ran untiled, keeping their intermediates"
        )
    tn = report.get("tiled_final_norm")
    if tn is not None and _untiled(tn):
        problems.append(
            f"the final norm is tiled (with model.tiled_mlp or model.tiled_layer) but {_untiled(tn)} "
            f"of {tn['calls']} call(s) ran untiled, keeping its fp32 temporaries for every token"
        )
    ln = report.get("tiled_layer_norms")
    if ln is not None and _untiled(ln):
        problems.append(
            f"model.tiled_mlp tiles the decoder layers' norms but {_untiled(ln)}"
            f" of {ln['calls']} norm call(s) ran untiled, keeping their fp32 temporaries for every token"
        )
    tl = report.get("tiled_layer")
    if tl is not None and tl["layers_tiled"] < tl["layers"]:
        problems.append(
            f"model.tiled_layer is on but only {tl['layers_tiled']} of {tl['layers']} decoder layers ran in tiles: "
            f"the others ran their own forward"
        )
    hw = report.get("headwise_ulysses")
    if hw is not None and (hw["calls"] == 0 or hw["groups"] != hw["calls"] * hw["head_chunks"]):
        problems.append(
            f"distributed.ulysses_head_chunks={hw['head_chunks']} but {hw['calls']} attention call(s) ran "
            f"{hw['groups']} head group(s): the attention did not run in head groups"
        )
    ag = report.get("attention_head_groups")
    if ag is not None and (ag["calls"] == 0 or ag["groups"] != ag["calls"] * ag["head_chunks"]):
        problems.append(
            f"model.attention_head_chunks={ag['head_chunks']} but {ag['calls']} attention call(s) ran "
            f"{ag['groups']} head group(s): the attention did not run in head groups"
        )
    return problems
