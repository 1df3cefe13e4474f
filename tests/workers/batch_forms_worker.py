"""The batch-form matrix: every CP method's own-loop batch function x every batch form (tests/test_batch_forms.py).

One launched group of 2 gloo ranks. A tiny fp32 Llama; for each method (ring, ulysses, thd, thd_docs, usp with
``ulysses_size=2``) the model is prepared as the method's :class:`~automodel.distributed.cp.method.CPMethod`
prepares it, and each batch form goes through the method's own-loop batch function and one forward + backward
(the local CE sum, weighted by the local ``loss_mask`` where the batch has one, over the global label count;
loss and gradients all-reduced over the CP group). The reference is transformers in one process on the whole
batch (``use_cache=False``; ``position_ids`` / ``attention_mask`` passed as the batch has them, so restarts
mark documents exactly where transformers says they do).

A cell is ``exact`` (loss rel <= 1e-5, every parameter's gradient rel <= 1e-4), ``refused`` (a ``ValueError``:
its message is kept), ``wrong`` (it ran and differs) or ``crash`` (anything else).
"""

from __future__ import annotations

import copy
import time
import traceback

import torch
import torch.nn.functional as F

from tests.workers.cp_steps import reduce_over_group

VOCAB = 64
S = 16
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
METHODS = ("ring", "ulysses", "thd", "thd_docs", "usp")
#: the forms the matrix runs (mRoPE needs an mRoPE model: not a Llama)
FORMS = (
    "plain",
    "restarts",
    "seq_lens",
    "seq_lens_only",
    "right_padding",
    "left_padding",
    "masked_token",
    "loss_mask",
    "restarts_and_mask",
)
#: the mRoPE forms, run on a tiny Qwen2-VL (its text model takes [3, B, S] and [4, B, S] position_ids)
MROPE_FORMS = ("mrope", "mrope_text")


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def tiny_qwen2_vl():
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    cfg = AutoConfig.for_model(
        "qwen2_vl",
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        ),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=2, spatial_merge_size=1),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(cfg).float()


def mrope_batches() -> dict[str, dict[str, torch.Tensor]]:
    """``[3, 2, 16]`` mRoPE positions (a 2 x 4 image grid inside text), and the same with text positions in row 0."""
    plain = batches()["plain"]
    t = torch.arange(S)
    grid = (t >= 4) & (t < 12)
    temporal = torch.where(grid, 4, torch.where(t >= 12, t - 4, t))
    height = torch.where(grid, 4 + (t - 4) // 4, temporal)
    width = torch.where(grid, 4 + (t - 4) % 4, temporal)
    three = torch.stack([temporal, height, width])[:, None].expand(3, 2, S).contiguous()
    four = torch.cat([t.expand(1, 2, S), three]).contiguous()
    return {"mrope": {**plain, "position_ids": three}, "mrope_text": {**plain, "position_ids": four}}


def _restart_positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """One ``[2, 16]`` batch per form (the same tokens; labels -100 where nothing is predicted)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (2, S), generator=g)
    labels = torch.randint(0, VOCAB, (2, S), generator=g)
    labels[torch.rand(2, S, generator=g) < 0.2] = -100
    plain = {"input_ids": ids, "labels": labels}
    out: dict[str, dict[str, torch.Tensor]] = {"plain": plain}
    out["restarts"] = {**plain, "position_ids": _restart_positions([[6, 10], [3, 5, 8]])}
    # packed: real documents [[5, 7], [3, 2, 7]], each padded to a multiple of 2*cp = 4 (thd's partition)
    real, padded = [[5, 7], [3, 2, 7]], [[8, 8], [4, 4, 8]]
    pk_ids, pk_labels = ids.clone(), labels.clone()
    for b, (rr, pp) in enumerate(zip(real, padded)):
        at = 0
        for n, p in zip(rr, pp):
            pk_ids[b, at + n : at + p] = 0
            pk_labels[b, at + n : at + p] = -100
            at += p
    out["seq_lens"] = {
        "input_ids": pk_ids,
        "labels": pk_labels,
        "position_ids": _restart_positions(padded),
        "seq_lens": torch.tensor([[5, 7, -1000], [3, 2, 7]]),
        "seq_lens_padded": torch.tensor([[8, 8, -1000], [4, 4, 8]]),
    }

    out["seq_lens_only"] = {**out["restarts"], "seq_lens": torch.tensor([[6, 10, -1000], [3, 5, 8]])}

    def masked(mask: torch.Tensor) -> dict[str, torch.Tensor]:
        lab = labels.clone()
        lab[mask == 0] = -100
        return {"input_ids": torch.where(mask.bool(), ids, 0), "labels": lab, "attention_mask": mask}

    right = torch.ones(2, S, dtype=torch.long)
    right[1, -5:] = 0
    out["right_padding"] = masked(right)
    left = torch.ones(2, S, dtype=torch.long)
    left[1, :5] = 0
    out["left_padding"] = masked(left)
    hole = torch.ones(2, S, dtype=torch.long)
    hole[0, 7] = 0
    out["masked_token"] = {**plain, "attention_mask": hole}
    loss_mask = (torch.rand(2, S, generator=g) > 0.3).float()
    out["loss_mask"] = {**plain, "loss_mask": loss_mask}
    out["restarts_and_mask"] = {**out["restarts"], "attention_mask": torch.ones(2, S, dtype=torch.long)}
    return out


def _loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100, reduction="none")
    if loss_mask is not None:
        ce = ce * loss_mask.reshape(-1).to(ce.dtype)
    return ce.sum()


def reference(model, batch: dict, n_labels: int) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers in one process on the whole batch."""
    model.zero_grad(set_to_none=True)
    kw = {k: batch[k] for k in ("position_ids", "attention_mask") if k in batch}
    logits = model(input_ids=batch["input_ids"], use_cache=False, **kw).logits
    loss = _loss_sum(logits, batch["labels"], batch.get("loss_mask")) / n_labels
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()
    }


def cp_cell(model, fn, mesh, batch: dict, n_labels: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One step through the method's own-loop batch function; loss and gradients summed over the CP group."""
    model.zero_grad(set_to_none=True)
    ctx, local = fn(mesh, batch)
    with ctx():
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False).logits
        ce = _loss_sum(logits, local["labels"], local.get("loss_mask"))
        (ce / n_labels).backward()
    loss, grads = reduce_over_group(model, ce, mesh.get_group())
    return float(loss) / n_labels, grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def method_and_options(name: str):
    from automodel.distributed.cp import get_cp_method

    if name == "usp":
        from automodel.distributed.cp.usp import UspMethod

        return UspMethod(2)
    return get_cp_method(name)


def main(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    t0 = time.perf_counter()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    cells: dict[tuple[str, str], dict] = {}
    run_forms(cells, mesh, tiny_llama(), batches(), FORMS)
    run_forms(cells, mesh, tiny_qwen2_vl(), mrope_batches(), MROPE_FORMS)
    return {"cells": cells, "methods": METHODS, "forms": FORMS + MROPE_FORMS, "seconds": time.perf_counter() - t0}


def run_forms(cells: dict, mesh, base, forms: dict, names: tuple[str, ...]) -> None:
    """Every method x the forms ``names`` of ``forms`` on copies of ``base``; fills ``cells``."""
    refs = {}
    for form in names:
        batch = forms[form]
        n_labels = int((batch["labels"] != -100).sum())
        loss, grads = reference(base, batch, n_labels)
        assert all(torch.isfinite(g).all() for g in grads.values()), f"reference of {form} is not finite"
        refs[form] = (n_labels, loss, grads)
    for name in METHODS:
        m = method_and_options(name)
        model = copy.deepcopy(base)
        try:
            prepared = m.prepare_model(model, mesh)
        except ValueError as err:  # the model itself is refused: every cell of the row says so
            for form in names:
                cells[(name, form)] = {"status": "refused", "message": str(err), "type": type(err).__name__}
            continue
        fn = m.batch_function(prepared)
        for form in names:
            n_labels, ref_loss, ref_grads = refs[form]
            try:
                loss, grads = cp_cell(model, fn, mesh, forms[form], n_labels)
            except ValueError as err:  # UserInputError / CPUnsupportedError / BatchFormError are ValueErrors
                cells[(name, form)] = {"status": "refused", "message": str(err), "type": type(err).__name__}
                continue
            except Exception as err:  # noqa: BLE001 - a crash is a cell of the matrix
                cells[(name, form)] = {"status": "crash", "message": traceback.format_exc(), "type": type(err).__name__}
                continue
            loss_rel = abs(loss - ref_loss) / abs(ref_loss)
            grad_rel = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
            ok = loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL
            cells[(name, form)] = {"status": "exact" if ok else "wrong", "loss_rel": loss_rel, "grad_rel": grad_rel}
        prepared.undo()
