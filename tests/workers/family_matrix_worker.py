"""The CP family x method matrix, run on every rank of one gloo group (tests/test_family_matrix.py).

For every family of :mod:`tests.family_matrix`: build the tiny model (same seed, so the same weights on
every rank), compute the single-process reference on the whole row (loss = sum CE / label count, every
parameter's gradient), then run each column's CP method on a deep copy through its own-loop API (README
"Use CP in your own loop", docs/ulysses.md, docs/thd.md; ``context_parallel`` for usp and for packed
rows): forward on this rank's tokens, loss = sum CE of the local tokens / the global label count,
backward, gradients and loss SUM-all-reduced over the CP group. The group has 2 ranks (cp=2), or 4 for the
methods of ``CP4_METHODS`` (usp 2 x 2) and of ``CP4_REPEATS`` (Ulysses again, column ``"ulysses@4"``). A packed column (``"<method> packed"``) trains one row of three
documents (``DOC_LENGTHS``) against each document run alone in one process; the references are computed
only when a cell runs. The ``auto`` columns name the method ``cp_method: auto`` picks for the model
(:func:`automodel.distributed.cp.choose_cp_method`) with that column's outcome.

A cell is ``exact`` (loss rel err <= 1e-5, every gradient's max abs diff / max abs reference <= 1e-4, and
every parameter with a reference gradient has one), ``refused`` (an ``automodel.errors.UserInputError``;
the detail is its message), ``wrong`` (ran, numbers differ; the detail holds the errors) or ``crash`` (any
other exception; the detail is its type and first line).

Deadlocks: a cell that raises on one rank only can leave the other inside a collective. The CP group
gets a short timeout (``cell_timeout_s``) so that rank fails too; after every cell the ranks agree on
the outcome over a separate group, and when the ranks' outcomes differ (one rank may have left an
unmatched collective behind) the mesh is rebuilt with fresh groups before the next cell.
"""

from __future__ import annotations

import copy
import logging
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from automodel.distributed.mesh import ParallelDims
from automodel.errors import UserInputError
from tests.family_matrix import (
    AUTO_COLUMNS,
    CP1_PACKED,
    CP4_METHODS,
    DOC_LENGTHS,
    FAMILIES,
    PACKED,
    SEQ,
    VOCAB,
    column_method,
    columns,
)

LOSS_TOL = 1e-5
GRAD_TOL = 1e-4
GRAD_FLOOR = 1e-3  # see compare()
ROW_SEED = 1234
MODEL_SEED = 0


def make_row() -> dict[str, torch.Tensor]:
    """One fixed row of SEQ tokens (ids >= 3: no pad/bos/eos ids), labels already shifted."""
    ids = torch.randint(3, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(ROW_SEED))
    return {"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone(),
            "position_ids": torch.arange(SEQ).unsqueeze(0)}


def make_packed_row() -> dict[str, torch.Tensor]:
    """The row of :func:`make_row` as three documents (``DOC_LENGTHS``): positions restart, ``seq_lens`` says where."""
    row = make_row()
    row["position_ids"] = torch.cat([torch.arange(n) for n in DOC_LENGTHS]).unsqueeze(0)
    row["seq_lens"] = torch.tensor([list(DOC_LENGTHS)])
    return row


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def _sum_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=-100, reduction="sum")


def reference(model: torch.nn.Module, row: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process loss and gradients on the whole row."""
    count = int((row["labels"] != -100).sum())
    logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
    loss = _sum_ce(logits, row["labels"]) / count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def reference_docs(model: torch.nn.Module, row: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process loss and gradients of a packed row: each document run alone (same labels)."""
    count = int((row["labels"] != -100).sum())
    total, at = 0.0, 0
    for n in row["seq_lens"][0].tolist():
        logits = model(input_ids=row["input_ids"][:, at : at + n], position_ids=torch.arange(n).unsqueeze(0),
                       use_cache=False).logits  # fmt: skip
        total = total + _sum_ce(logits, row["labels"][:, at : at + n]) / count
        at += n
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total.item(), grads


def _local_step(model, local: dict, ctx_factory, count: int) -> torch.Tensor:
    with ctx_factory():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        loss = _sum_ce(logits, local["labels"]) / count
        loss.backward()
    return loss.detach()


def run_method(method: str, model: torch.nn.Module, row: dict, mesh) -> torch.Tensor:
    """One own-loop step of ``method`` on this rank's share of ``row``; returns the local loss (grads set)."""
    count = int((row["labels"] != -100).sum())  # global label count, before sharding
    batch = {k: v.clone() for k, v in row.items()}
    if method in CP4_METHODS or "seq_lens" in batch:  # the one own-loop entry point of every method
        from automodel.distributed.cp import context_parallel

        cp = context_parallel(model, mesh, method=method, **CP4_METHODS.get(method, {}))
        ctx, local = cp.shard(batch)
        return _local_step(model, local, ctx, count)
    if method == "ring":
        from automodel.distributed.cp_utils import make_cp_batch_and_ctx

        ctx, local = make_cp_batch_and_ctx(mesh, batch)  # entering ctx() shards `local` in place
        return _local_step(model, local, ctx, count)
    if method == "ulysses":
        from automodel.distributed.cp.ulysses.attention import (
            make_ulysses_batch_and_ctx,
            set_ulysses_attention,
        )

        inner = set_ulysses_attention(model, mesh)
        ctx, local = make_ulysses_batch_and_ctx(mesh, batch, inner_attn=inner)
        return _local_step(model, local, ctx, count)
    if method == "thd":
        from automodel.distributed.cp.thd.attention import make_thd_batch_and_ctx, set_thd_attention

        set_thd_attention(model, mesh)
        ctx, local = make_thd_batch_and_ctx(mesh, batch)
        return _local_step(model, local, ctx, count)
    if method == "thd_docs":
        from automodel.distributed.cp.thd_docs.attention import make_doc_batch_and_ctx, set_doc_attention

        set_doc_attention(model, mesh)
        ctx, local = make_doc_batch_and_ctx(mesh, batch)
        return _local_step(model, local, ctx, count)
    if method == "_asymmetric":  # the harness's self-test: rank 1 fails, rank 0 is left inside a collective
        group = mesh["cp"].get_group()
        if dist.get_rank(group) == 1:
            raise RuntimeError("self-test: rank 1 fails before the collective")
        dist.all_reduce(torch.zeros(1), group=group)  # waits until the CP group's timeout
        return torch.zeros(())
    raise KeyError(method)


def _reduce_grads(model: torch.nn.Module, loss: torch.Tensor, group) -> tuple[float, dict, list[str]]:
    """SUM the loss and every parameter's gradient over the CP group (one flat all-reduce).

    A rank without a gradient for a parameter contributes zeros, so the collective is the same on every rank; the
    returned list names the parameters that had a gradient on some ranks only. The recipe cannot train those: FSDP2
    reduce-scatters the gradients each rank has, so the ranks' buffers differ (ZAYA's CCA under Ulysses at cp 4 did,
    before its last rank's unread conv weights were given a zero gradient).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    flags = torch.tensor([float(p.grad is not None) for _, p in params] + [0.0])
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for _, p in params] + [loss.double().reshape(1)])
    dist.all_reduce(flat, group=group)
    dist.all_reduce(flags, group=group)
    grads, at = {}, 0
    for (name, p), flag in zip(params, flags.tolist()):
        if flag > 0:
            grads[name] = flat[at : at + p.numel()].view_as(p).to(p.dtype)
        at += p.numel()
    world = dist.get_world_size(group)
    return flat[-1].item(), grads, [n for (n, _), f in zip(params, flags.tolist()) if 0 < f < world]


def compare(ref_loss: float, ref_grads: dict, loss: float, grads: dict) -> dict:
    """Loss rel err and the worst gradient rel err: max abs diff / max abs reference, per parameter.

    The denominator is floored at GRAD_FLOOR x the model's largest reference gradient entry: a gradient
    that is zero in exact arithmetic (OPT's key bias, which softmax ignores: no RoPE, so it shifts every
    score of a query by the same amount) is round-off in both runs, and round-off over round-off says
    nothing. A wrong result moves gradients by O(1) of their size, far above the floor.
    """
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    missing = sorted(set(ref_grads) - set(grads))
    floor = GRAD_FLOOR * max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
    worst, worst_name = 0.0, None
    for name, ref in ref_grads.items():
        if name not in grads:
            continue
        scale = max(ref.abs().max().item(), floor)
        diff = (grads[name] - ref).abs().max().item()
        rel = diff / scale if scale > 0 else diff
        if rel > worst or worst_name is None:
            worst, worst_name = rel, name
    ok = loss_rel <= LOSS_TOL and worst <= GRAD_TOL and not missing
    detail = f"loss rel {loss_rel:.2e}, worst grad rel {worst:.2e} ({worst_name})"
    if missing:
        detail += f", {len(missing)} parameters without a gradient (e.g. {missing[0]})"
    return {"status": "exact" if ok else "wrong", "detail": detail, "loss_rel": loss_rel,
            "grad_rel": worst, "worst_param": worst_name, "missing": missing}


def _global_state() -> tuple:
    return (torch._C._len_torch_function_stack(), F.scaled_dot_product_attention)


def run_cell(method: str, base: torch.nn.Module, row: dict, mesh, ref_loss: float | None, ref_grads: dict | None,
             ref=None, compares: bool = True) -> dict:  # fmt: skip
    """One cell; ``ref() -> (loss, grads)`` gives the reference when ``ref_loss`` is ``None`` (only once a method
    ran: a refused cell needs none). ``compares=False`` (every rank of the group but the first: the reduced loss
    and gradients are the same on each): a cell that ran is ``"ran"``, and the first rank's comparison counts."""
    before = _global_state()
    t0 = time.perf_counter()
    try:
        model = copy.deepcopy(base)
        loss = run_method(method, model, row, mesh)
        total, grads, partial = _reduce_grads(model, loss, mesh["cp"].get_group())
        if partial:  # the same on every rank of the group (from the all-reduced flags)
            out = {"status": "crash", "detail": f"{len(partial)} parameters have a gradient on some ranks only "
                                                f"(FSDP2's reduce-scatter sizes differ across ranks), e.g. {partial[0]}"}
        elif not compares:
            out = {"status": "ran", "detail": "compared on the group's first rank"}
        else:
            if ref_loss is None:
                ref_loss, ref_grads = ref()
            out = compare(ref_loss, ref_grads, total, grads)
    except UserInputError as err:  # with the methods the refusal names (tests/test_family_matrix.py runs them)
        out = {"status": "refused", "detail": str(err).strip(), "alternatives": list(err.alternatives)}
    except Exception as err:  # noqa: BLE001 - every other exception is the cell's result
        out = {"status": "crash", "detail": _first_line(err), "traceback": traceback.format_exc()}
    if _global_state() != before:
        out = {"status": "crash", "detail": f"left global state behind (torch function modes / SDPA) after "
                                            f"{out['status']}: {out['detail']}"}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def run_cp1_packed_cell(base: torch.nn.Module, row: dict, ref) -> dict:
    """The :data:`CP1_PACKED` cell (one process): ``row``'s three documents at ``distributed.cp_size=1`` through the
    recipe's path (``bind_cp_method`` with packed rows, then ``run_micro_batch``), against ``ref() -> (loss,
    grads)``, each document alone. The cell's ``path`` says what computed the documents."""
    import functools

    from automodel.distributed.cp.bind import bind_cp_method
    from automodel.distributed.train_context import get_train_context
    from automodel.training.step import prepare_batch, run_micro_batch

    t0 = time.perf_counter()
    try:
        model = copy.deepcopy(base)
        # the schema's default method (ring attends across the row: where the model's own forward mixes the
        # documents, the first method that runs its packed rows takes over)
        cp_fn, prepared = bind_cp_method("ring", model, None, 1, packed=True)
        batch = {k: v.clone() for k, v in row.items()}
        batch["seq_lens_padded"] = batch["seq_lens"].clone()  # as the packing collator gives them
        count = int((batch["labels"] != -100).sum())
        ce = run_micro_batch(model, prepare_batch(batch, torch.device("cpu")), device_mesh=None, cp_fn=cp_fn,
                             train_context=functools.partial(get_train_context, False, False),
                             num_label_tokens=count)  # fmt: skip
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        out = compare(*ref(), float(ce) / count, grads)
        out["path"] = prepared.current_attn if prepared.switched else "own forward"
    except UserInputError as err:
        out = {"status": "refused", "detail": str(err).strip(), "alternatives": list(err.alternatives)}
    except Exception as err:  # noqa: BLE001 - every other exception is the cell's result
        out = {"status": "crash", "detail": _first_line(err), "traceback": traceback.format_exc()}
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _agree(outcomes: list[dict]) -> tuple[dict, bool]:
    """The cell's outcome from every rank's; ``True`` when the ranks disagreed."""
    if all(o.get("one_rank") for o in outcomes[1:]):  # a one-process cell: the group's first rank ran it
        return dict(outcomes[0]), False
    if outcomes[0]["status"] in ("exact", "wrong") and all(o["status"] == "ran" for o in outcomes[1:]):
        return dict(outcomes[0]), False  # every rank ran; the first compared the reduced numbers
    statuses = {o["status"] for o in outcomes}
    if len(statuses) == 1 and (statuses != {"crash"} or len({o["detail"] for o in outcomes}) == 1):
        worst = max(outcomes, key=lambda o: (o.get("grad_rel", 0.0), o.get("loss_rel", 0.0)))
        return dict(worst), False
    detail = "ranks disagree: " + "; ".join(f"rank {r} {o['status']}: {o['detail']}" for r, o in enumerate(outcomes))
    return {"status": "crash", "detail": detail, "per_rank": outcomes}, True


def _build_mesh(ranks: list[int], cell_timeout_s: float):
    """A fresh 1-D ``"cp"`` mesh over ``ranks``, on a new gloo group with a short timeout (only those ranks call it).

    ``ParallelDims(cp=world_size).build_mesh()["cp"]`` is the same 1-D mesh, but at cp = world size its
    group IS the default group, which a timed-out collective would break for good (and the launcher
    needs it at the end); a group of our own can be dropped and replaced.
    """
    from torch.distributed.device_mesh import DeviceMesh

    ParallelDims(cp=len(ranks))  # the sizes a user would give
    group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=cell_timeout_s),
                           use_local_synchronization=True)  # fmt: skip
    return DeviceMesh.from_group(group, "cpu", mesh_dim_names=("cp",))


def _auto_cell(pristine: torch.nn.Module, cells: dict, packed: bool, cp_size: int) -> dict:
    """What ``cp_method: auto`` picks for the model at ``cp_size`` (own loop: ``seq_len=SEQ``), with the outcome of
    that method's column; a refusal is the cell's outcome (it must then be that no column is exact)."""
    from automodel.distributed.cp import choose_cp_method, profile_model

    exact = [c for c, cell in cells.items() if c not in AUTO_COLUMNS + (CP1_PACKED,) and c.endswith(PACKED) == packed
             and cell["status"] == "exact"]  # fmt: skip (cp=1 packed: no CP method's column)
    try:
        choice = choose_cp_method(profile_model(pristine), cp_size, seq_len=SEQ, packed=packed)
    except UserInputError as err:
        if exact:  # auto must never refuse a model that some method computes
            return {"status": "wrong", "detail": f"auto refused ({err}), but {exact} compute it"}
        return {"status": "refused", "detail": str(err).strip()}
    except Exception as err:  # noqa: BLE001 - the chooser crashing is the cell's result
        return {"status": "crash", "detail": _first_line(err), "traceback": traceback.format_exc()}
    column = choice.name + (PACKED if packed else "")
    picked = cells.get(column, {"status": "crash", "detail": f"auto picked {choice.name}, which has no column"})
    out = {**picked, "picked": choice.name, "reason": choice.reason}
    if picked["status"] != "exact" and exact:  # auto must never pick a refusing method while another computes
        out.update(status="wrong", detail=f"auto picked {choice.name} ({picked['status']}), but {exact} compute it")
    return out


def _selftest(ranks: list[int], row: dict, agree_group, timeout_s: float, cell_timeout_s: float) -> tuple[dict, Any]:
    """A cell that fails on the group's second rank only while the first waits in a collective: the outcome, and
    the fresh mesh built after it."""
    mesh = _build_mesh(ranks, timeout_s)
    old_group = mesh["cp"].get_group()
    gathered: list[Any] = [None] * len(ranks)
    dist.all_gather_object(gathered, run_cell("_asymmetric", torch.nn.Linear(1, 1), row, mesh, 0.0, {}),
                           group=agree_group)  # fmt: skip
    result, disagreed = _agree(gathered)
    mesh = _build_mesh(ranks, cell_timeout_s)
    probe = torch.ones(1)
    dist.all_reduce(probe, group=mesh["cp"].get_group())
    result.update(disagreed=disagreed, fresh_group=mesh["cp"].get_group() is not old_group,
                  fresh_group_works=probe.item() == len(ranks))  # fmt: skip
    return result, mesh


def _family_info(fam, base: torch.nn.Module) -> dict:
    return {
        "model_class": type(base).__name__,
        "supports_sdpa": bool(getattr(type(base), "_supports_sdpa", False)),
        "attn_used": base.config._attn_implementation,
        "layer_types": list(getattr(base.config, "layer_types", None) or []),
        "n_params": sum(p.numel() for p in base.parameters()),
    }


def _refusals(profile, columns: tuple[str, ...], cp_size: int) -> dict[str, dict]:
    """The cells of ``columns`` (``context_parallel`` methods at ``cp_size``) that the model check refuses before
    any batch: the check ``context_parallel`` runs first (the registry's, on the model's profile), so a family
    whose every such cell is refused needs no model in that launch phase."""
    from automodel.distributed.cp import check_model_config_for_cp, get_cp_method
    from automodel.distributed.cp.context import _Options

    out = {}
    for column in columns:
        method = column_method(column)
        options = CP4_METHODS.get(method, {})
        try:
            check_model_config_for_cp(get_cp_method(method).configured(_Options(cp_size, options)), profile, cp_size)
        except UserInputError as err:
            out[column] = {"status": "refused", "detail": str(err).strip(), "seconds": 0.0,
                           "alternatives": list(err.alternatives)}  # fmt: skip
    return out


def _run_families(fams: list, columns: tuple[str, ...], ranks: list[int], agree_group, mesh, row: dict,
                  packed_row: dict, check_reference: bool, cell_timeout_s: float, later: tuple[str, ...] = (),
                  known_cells: dict | None = None) -> tuple[dict, dict, int]:  # fmt: skip
    """Every cell of ``columns`` for ``fams`` on the CP group of ``ranks``: ``(cells, meta, mesh rebuilds)``.

    Only the group's first rank computes references and compares. ``later``: the ``CP4_METHODS`` columns, whose
    refusals by the model check are recorded in the meta (``"cp4_refused"``); ``known_cells``: family ->
    those refusals (the cp=4 phase builds no model for a family they cover)."""
    first = dist.get_rank() == ranks[0]
    check_reference = check_reference and first
    cells: dict[str, dict] = {}
    meta: dict[str, dict] = {}
    rebuilt = 0
    for fam in fams:
        t0 = time.perf_counter()
        info = {"model_type": fam.model_type, "kinds": fam.kinds, "attn": fam.attn_implementation(), "note": fam.note}
        refs: dict[bool, tuple] = {}
        base = pristine = None
        known: dict[str, dict] = {}
        build_err = None
        try:
            known = dict((known_cells or {}).get(fam.name, {}))
            if len(known) < len(columns):
                base = fam.build_model(MODEL_SEED)
                info.update(_family_info(fam, base))
                pristine = copy.deepcopy(base)  # before any forward: some models cache tensors on the way
                if later and first:
                    from automodel.distributed.cp import profile_model

                    info["cp4_refused"] = _refusals(profile_model(pristine), later, 4)
            if check_reference:
                refs[False] = reference(base, row)
                again_loss, again_grads = reference(base, row)  # a random model (dropout, sampling router) can't compare
                ref_loss, ref_grads = refs[False]
                deterministic = again_loss == ref_loss and again_grads.keys() == ref_grads.keys() and all(
                    torch.equal(again_grads[n], g) for n, g in ref_grads.items()
                )
                info.update(ref_loss=ref_loss, n_ref_grads=len(ref_grads), deterministic=deterministic,
                            train_mode=base.training)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a family that cannot build fails all its cells
            build_err = {"status": "crash", "detail": f"building or the cp=1 reference failed: {_first_line(err)}",
                         "traceback": traceback.format_exc()}  # fmt: skip

        def ref(packed: bool, base=base, refs=refs) -> tuple:
            if packed not in refs:
                refs[packed] = reference_docs(base, packed_row) if packed else reference(base, row)
            return refs[packed]

        cells[fam.name] = {}
        for column in columns:
            packed = column.endswith(PACKED)
            if column in known:
                local = known[column]
            elif build_err:
                local = dict(build_err)
            elif column in AUTO_COLUMNS:
                local = _auto_cell(pristine, cells[fam.name], packed, len(ranks))
            elif column == CP1_PACKED:  # one process: the group's first rank computes it, the others wait
                local = run_cp1_packed_cell(pristine, packed_row, lambda: ref(True)) if first else {"one_rank": True}
            else:
                method = column_method(column)
                given = refs.get(packed, (None, None))
                local = run_cell(method, pristine, packed_row if packed else row, mesh, *given,
                                 ref=lambda packed=packed: ref(packed), compares=first)  # fmt: skip
            gathered: list[Any] = [None] * len(ranks)
            dist.all_gather_object(gathered, local, group=agree_group)
            outcome, disagreed = _agree(gathered)
            cells[fam.name][column] = outcome
            if disagreed:  # a rank may have left an unmatched collective on the CP group: start afresh
                mesh = _build_mesh(ranks, cell_timeout_s)
                rebuilt += 1
        info["seconds"] = round(time.perf_counter() - t0, 3)
        meta[fam.name] = info
    return cells, meta, rebuilt


def main(rank: int, world_size: int, families: list[str] | None = None, cell_timeout_s: float = 30.0,
         selftest_timeout_s: float = 0.0) -> dict:  # fmt: skip
    """Run the matrix; every rank returns ``{"cells": {family: {column: outcome}}, "meta": {...}}``.

    ``world_size`` 4 (or 2): the cp=2 columns (:func:`tests.family_matrix.columns`) run on pairs of ranks, the
    families dealt out over the pairs; then the ``CP4_METHODS`` columns on all 4 ranks (skipped on 2), a family
    whose model check refuses them all without building the model. ``families`` restricts the run to those
    names; ``selftest_timeout_s > 0`` first runs, on every pair, a cell that fails on one rank only while the
    other waits in a collective (CP group timeout ``selftest_timeout_s``) and returns what became of it under
    ``"selftest"``.
    """
    import transformers

    from tests.family_matrix import table_columns

    transformers.logging.set_verbosity_error()
    # a crashing cell's DTensor op logs its whole traceback from fake-tensor propagation; the cell records it
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    if world_size not in (2, 4):
        raise ValueError(f"the family matrix runs on 2 or 4 ranks, not {world_size}")
    pair_columns, cp4_columns = columns()
    t_start = time.perf_counter()
    row, packed_row = make_row(), make_packed_row()
    selected = [f for f in FAMILIES if families is None or f.name in families]
    pairs = [list(range(i, i + 2)) for i in range(0, world_size, 2)]
    agree_groups = [dist.new_group(p, backend="gloo") for p in pairs]  # outcomes never travel on a CP group
    world_agree = dist.new_group(backend="gloo")
    me = rank // 2
    mesh, selftest_result = None, None
    if selftest_timeout_s:  # prove that a one-rank failure inside a collective neither hangs nor poisons
        selftest_result, mesh = _selftest(pairs[me], row, agree_groups[me], selftest_timeout_s, cell_timeout_s)
    mesh = mesh or _build_mesh(pairs[me], cell_timeout_s)
    mine = [f for i, f in enumerate(selected) if i % len(pairs) == me]
    cp4 = world_size == 4 and bool(cp4_columns)
    cells, meta, rebuilt = _run_families(mine, pair_columns, pairs[me], agree_groups[me], mesh, row, packed_row,
                                         True, cell_timeout_s, later=cp4_columns if cp4 else ())  # fmt: skip
    t_pairs = time.perf_counter() - t_start
    everything: list[Any] = [None] * world_size
    dist.all_gather_object(everything, (cells, meta, rebuilt, selftest_result), group=world_agree)
    cp4_cells: dict[str, dict] = {}
    if cp4:
        # a pair that rebuilt its mesh after a disagreement created more groups: torch names a new group by how
        # many this process holds, so the others create as many (unused) for the 4 ranks to agree on its name
        for _ in range(max(e[2] for e in everything[::2]) - rebuilt):
            dist.new_group(pairs[me], backend="gloo", use_local_synchronization=True)
        known = {name: m["cp4_refused"] for e in everything[::2] for name, m in e[1].items() if "cp4_refused" in m}
        mesh4 = _build_mesh(list(range(4)), cell_timeout_s)
        cp4_cells, _, more = _run_families(selected, cp4_columns, list(range(4)), world_agree, mesh4, row,
                                           packed_row, False, cell_timeout_s, known_cells=known)  # fmt: skip
        rebuilt += more
    order = [c for c in table_columns() if c in pair_columns or (world_size == 4 and c in cp4_columns)]
    all_cells: dict[str, dict] = {}
    all_meta: dict[str, dict] = {}
    for part_cells, part_meta, _, _ in everything[::2]:  # one rank per pair
        all_cells.update(part_cells)
        all_meta.update(part_meta)
    merged = {f.name: {c: {**all_cells[f.name], **cp4_cells.get(f.name, {})}[c] for c in order} for f in selected}
    return {"cells": merged, "meta": {f.name: all_meta[f.name] for f in selected},
            "seconds": round(time.perf_counter() - t_start, 2), "pair_seconds": round(t_pairs, 2),
            "mesh_rebuilds": sum(e[2] for e in everything[::2]), "methods": order,
            "selftest": everything[0][3], "world_size": world_size}
