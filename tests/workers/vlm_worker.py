"""VLM CP parity on a tiny Qwen2-VL (gloo ranks, run by tests/test_vlm_cp.py).

Each rank computes the single-process reference (the stock HF forward on the whole batch: vision tower
on every image, the model's own mRoPE, sdpa) and the CP run (vision on this rank's share of the
images, gathered and merged, mRoPE on the whole sequence, the language model under ring or Ulysses
CP). Loss under CP: sum of token cross-entropies over the local labels / GLOBAL label count; the
parameter gradients (vision tower included) are all-reduced (SUM) over the CP group.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from automodel.models.vlm_cp import make_vlm_cp_batch_and_ctx, prepare_vlm_for_cp
from automodel.models.vlm_tiny import tiny_qwen2_5_vl_config, tiny_qwen2_vl_config
from tests.workers.cp_steps import sum_over_group

PATCH_DIM = 3 * 2 * 4 * 4  # channels * temporal_patch_size * patch_size**2
IMAGE, VIDEO, VSTART, VEND = 250, 251, 248, 249


def tiny_model(dtype: torch.dtype = torch.float32, family: str = "qwen2_vl"):
    """A tiny Qwen2-VL (``family="qwen2_vl"``) or Qwen2.5-VL (``"qwen2_5_vl"``, window attention)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    torch.manual_seed(1234)
    if family == "qwen2_5_vl":
        return Qwen2_5_VLForConditionalGeneration._from_config(tiny_qwen2_5_vl_config(), dtype=dtype)
    return Qwen2VLForConditionalGeneration._from_config(tiny_qwen2_vl_config(), dtype=dtype)


def make_batch(kind: str, multiple: int, dtype: torch.dtype = torch.float32) -> dict:
    """Two rows with images of mixed sizes (and a video), right-padded to a multiple of ``multiple``.

    ``kind``: ``"mixed"`` (3 images + 1 video over 2 rows) or ``"one_image"`` (fewer images than ranks).
    """
    g = torch.Generator().manual_seed(7)
    if kind == "mixed":
        rows = [[("image", (1, 4, 4)), ("image", (1, 2, 6))], [("image", (1, 8, 4)), ("video", (2, 4, 4))]]
    else:
        rows = [[("image", (1, 6, 4))], []]
    seqs, images, videos = [], [], []
    for row in rows:
        ids = torch.randint(3, 200, (5,), generator=g).tolist()
        for what, (t, h, w) in row:
            n = t * h * w // 4
            ids += [VSTART] + [IMAGE if what == "image" else VIDEO] * n + [VEND]
            ids += torch.randint(3, 200, (4,), generator=g).tolist()
            (images if what == "image" else videos).append((t, h, w))
        seqs.append(ids)
    seq = max(len(s) for s in seqs)
    seq = -(-seq // multiple) * multiple
    input_ids = torch.zeros(len(seqs), seq, dtype=torch.long)
    labels = torch.full((len(seqs), seq), -100, dtype=torch.long)
    for b, ids in enumerate(seqs):
        t = torch.tensor(ids)
        input_ids[b, : len(ids)] = t
        nxt = t[1:].clone()
        nxt[(nxt == IMAGE) | (nxt == VIDEO)] = -100
        labels[b, : len(ids) - 1] = nxt
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long(),
    }
    for key, grids in (("image", images), ("video", videos)):
        if grids:
            grid = torch.tensor(grids, dtype=torch.long)
            pv = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g, dtype=torch.float64).to(dtype)
            batch["pixel_values" if key == "image" else "pixel_values_videos"] = pv
            batch["image_grid_thw" if key == "image" else "video_grid_thw"] = grid
    return batch


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _case(mesh, world, cp_method, kind, dtype, family="qwen2_vl"):
    batch = make_batch(kind, 2 * world, dtype)
    count = int((batch["labels"] != -100).sum())
    ref = tiny_model(dtype, family)
    model = copy.deepcopy(ref)
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    ref_loss = ce_sum(ref(**kwargs, use_cache=False).logits, batch["labels"]) / count
    ref_loss.backward()

    prepare_vlm_for_cp(model, mesh, cp_method)
    ctx_factory, local = make_vlm_cp_batch_and_ctx(model, mesh, batch, cp_method=cp_method)
    with ctx_factory():
        logits = model(inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], use_cache=False).logits
        loss = ce_sum(logits, local["labels"]) / count
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss, group=mesh["cp"].get_group())
    errs, missing = {}, []
    ref_params = dict(ref.named_parameters())
    summed = sum_over_group({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                            mesh["cp"].get_group())  # fmt: skip
    for name, p in model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        errs[name] = rel(summed[name], ref_params[name].grad)
    vision = [v for k, v in errs.items() if ".visual." in k]
    return {
        "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad_rel": max(errs.values()),
        "worst": max(errs, key=errs.get),
        "vision_grad_rel": max(vision),
        "n_vision": len(vision),
        "n_params": len(errs),
        "missing": missing,
        "local_seq": int(local["inputs_embeds"].shape[1]),
        "seq": int(batch["input_ids"].shape[1]),
    }


def run(rank: int, world_size: int, cases: list[tuple[str, ...]]) -> dict:
    """``cases``: ``(cp_method, batch kind, dtype name[, family])``; returns the results keyed by case."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    out = {}
    for case in cases:
        cp_method, kind, dtype_name, *family = case
        out[case] = _case(mesh, world_size, cp_method, kind, getattr(torch, dtype_name), *family)
    return out
