"""Multimodal CP primitives on gloo ranks vs one process (run by tests/test_multimodal_cp.py).

Every rank builds the same toy encoder and inputs, computes the single-process reference on all the
media, then the CP run: split, encode the local share, gather, and a loss that uses the gathered
rows the way CP does (each rank's loss covers only its contiguous share of the rows; the objective is
the sum over ranks). Encoder gradients are all-reduced (SUM). Returned per case: the largest relative
errors of the gathered values and of every encoder gradient, plus what the split decided.
"""

from __future__ import annotations

import torch

from automodel.distributed.multimodal.cp import (
    GatherFromContextParallelRanks,
    PackedSeqParams,
    gather_from_context_parallel_ranks,
    gather_from_context_parallel_ranks_dynamic_res,
    split_to_context_parallel_ranks,
    split_to_context_parallel_ranks_dynamic_res,
)
from tests.workers.cp_steps import sum_over_group

D_IN, H0, H = 6, 8, 5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class ToyEncoder(torch.nn.Module):
    """Per-segment mixing (fails if a segment is cut) then an ``m x m`` merge, like a NaViT encoder."""

    def __init__(self, m: int, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.m = m
        self.lin1 = torch.nn.Linear(D_IN, H0, dtype=dtype)
        self.lin2 = torch.nn.Linear(H0 * m * m, H, dtype=dtype)

    def forward(self, x: torch.Tensor, grid_thw: torch.Tensor, tps: int, pad: int = 0) -> torch.Tensor:
        lengths = []
        for t, h, w in grid_thw.tolist():
            per = min(t, tps)
            lengths += [per * h * w] * (t // per)
        if pad:
            lengths.append(pad)
        y = self.lin1(x)
        y = torch.cat([s + s.mean(0, keepdim=True) for s in y.split(lengths)], dim=0).tanh()
        return self.lin2(y.reshape(-1, H0 * self.m * self.m))


def _share(n: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, world)
    sizes = [base + (r < extra) for r in range(world)]
    return sum(sizes[:rank]), sizes[rank]


def _cp_loss(rows: torch.Tensor, weights: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    start, n = _share(rows.size(0), world, rank)
    return (rows.narrow(0, start, n) * weights.narrow(0, start, n)).sum()


def _grads(module: torch.nn.Module, reduce: bool) -> dict[str, torch.Tensor]:
    out = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    return sum_over_group(out) if reduce else out


def _dynamic_case(rank, world, grids, m, tps, dtype, split_videos=True, **split_kwargs):
    grid_thw = torch.tensor(grids, dtype=torch.long)
    g = torch.Generator().manual_seed(11)
    total = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(total, D_IN, generator=g, dtype=dtype)
    weights = torch.randn(total // (m * m), H, generator=g, dtype=dtype)

    ref_enc = ToyEncoder(m, dtype)
    ref_rows = ref_enc(pixels, grid_thw, tps)
    (ref_rows * weights).sum().backward()
    ref_grads = _grads(ref_enc, reduce=False)

    enc = ToyEncoder(m, dtype)
    local, split = split_to_context_parallel_ranks_dynamic_res(
        pixels, grid_thw, spatial_merge_size=m, temporal_patch_size=tps, split_videos=split_videos, **split_kwargs
    )
    pad = split.padded_patches_per_rank[rank] - split.patches_per_rank[rank] - (m * m if split.has_dummy[rank] else 0)
    local_rows = enc(local, split.local_grid_thw, tps, pad)
    rows = gather_from_context_parallel_ranks_dynamic_res(local_rows, split)
    _cp_loss(rows, weights, world, rank).backward()
    grads = _grads(enc, reduce=True)
    return {
        "value_rel": rel(rows.detach(), ref_rows.detach()),
        "grad_rel": max(rel(grads[k], ref_grads[k]) for k in ref_grads),
        "split_points": split.split_points,
        "patches_per_rank": split.patches_per_rank,
        "padded_patches_per_rank": split.padded_patches_per_rank,
        "has_dummy": split.has_dummy,
        "local_grid_thw": split.local_grid_thw.tolist(),
        "local_media": split.local_media,
        "local_rows": local.size(0),
        "cu_seqlens": split.local_cu_seqlens.tolist(),
        "cu_seqlens_padded": split.local_cu_seqlens_padded.tolist(),
    }


def _fixed_case(rank, world, n_samples, dtype):
    """Fixed-size images [N, C, 2, 2] through a per-sample encoder; split/gather along dim 0."""
    g = torch.Generator().manual_seed(5)
    images = torch.randn(n_samples, 3, 2, 2, generator=g, dtype=dtype)
    weights = torch.randn(n_samples * 4, H, generator=g, dtype=dtype)
    torch.manual_seed(4)
    ref = torch.nn.Linear(3, H, dtype=dtype)
    enc = torch.nn.Linear(3, H, dtype=dtype)
    enc.load_state_dict(ref.state_dict())

    def encode(module, x):  # [n, 3, 2, 2] -> [n, 4, H]: per-pixel tokens, then mixed within the image
        tok = module(x.flatten(2).transpose(1, 2))
        return (tok + tok.mean(1, keepdim=True)).tanh()

    ref_rows = encode(ref, images).reshape(-1, H)
    (ref_rows * weights).sum().backward()
    local, global_pad = split_to_context_parallel_ranks(images, pad_value=0.0)
    rows = gather_from_context_parallel_ranks(encode(enc, local), global_pad, dim=0).reshape(-1, H)
    _cp_loss(rows, weights, world, rank).backward()
    grads = _grads(enc, reduce=True)
    return {
        "value_rel": rel(rows.detach(), ref_rows.detach()),
        "grad_rel": max(rel(grads[k], p.grad) for k, p in ref.named_parameters()),
        "local_shape": list(local.shape),
        "global_pad": global_pad,
    }


def _gather_dim1(rank, world, dtype):
    """The autograd function itself along dim 1: forward = concatenation, backward = group sum of blocks."""
    x = torch.arange(6, dtype=dtype).reshape(2, 3, 1).repeat(1, 1, 2) + 10 * rank
    x.requires_grad_(True)
    full = GatherFromContextParallelRanks.apply(x, None, 1)
    expected = torch.cat([torch.arange(6, dtype=dtype).reshape(2, 3, 1).repeat(1, 1, 2) + 10 * r for r in range(world)], 1)
    upstream = torch.full_like(full, float(rank + 1))
    full.backward(upstream)
    return {
        "forward_ok": bool(torch.equal(full.detach(), expected)),
        "grad": x.grad.unique().tolist(),  # sum over ranks of (rank+1) = 3 at world 2
    }


def _megatron_forms(rank, world):
    """Megatron's calls with only the import changed: gather along dim 1 by default; the dynamic-resolution
    gather with an int (rows of every rank, the last num_padded_imgs ranks dropped)."""
    x = torch.arange(12.0).reshape(3, 4)  # [samples, H] identical on every rank
    local, pad = split_to_context_parallel_ranks(x)  # ceil(3/2) = 2 samples per rank, 1 pad
    emb = local.unsqueeze(0).requires_grad_(True)  # [1, k, H]: samples on dim 1, as Megatron's encoders
    full = gather_from_context_parallel_ranks(emb, pad)
    full.backward(torch.ones_like(full) * (rank + 1))
    rows = torch.full((rank + 1, 2), float(rank)).requires_grad_(True)  # rank r encodes r + 1 rows
    both = gather_from_context_parallel_ranks_dynamic_res(rows)
    both.backward(torch.ones_like(both))
    first = gather_from_context_parallel_ranks_dynamic_res(rows.detach(), num_padded_imgs=1)
    # Megatron's dynamic-resolution split -> encode -> gather, with the CP loss (rank r: rows r, r+W, ...)
    dyn = {}
    for name, lens, kwargs in (
        ("images", [4, 6, 2], {}),
        ("one_image", [4], {}),
        ("tubelets", [2] * 6, {"num_frames": torch.tensor([4, 2]), "temporal_patch_size": 2}),
    ):
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        params = PackedSeqParams(cu, cu, None, None, max(lens), max(lens), "thd")
        g = torch.arange(sum(lens) * 8, dtype=torch.float64).reshape(1, sum(lens), 8).requires_grad_(True)
        sizes = torch.tensor([[4, 4]] * len(lens))
        local_t, local_sizes, local_params, has_pad, padded, frames = split_to_context_parallel_ranks_dynamic_res(
            g, sizes, params, patch_dim=4, **kwargs
        )
        out_rows = gather_from_context_parallel_ranks_dynamic_res((local_t[0] * 2).contiguous(), padded)
        w = torch.linspace(-1, 1, out_rows.numel(), dtype=torch.float64).reshape(out_rows.shape)
        (out_rows * w)[rank::world].sum().backward()
        dyn[name] = {
            "local_t": local_t.detach().tolist(), "cu": local_params.cu_seqlens_q.tolist(), "padded": padded,
            "has_pad": has_pad, "frames": None if frames is None else frames.tolist(), "sizes": local_sizes.tolist(),
            "rows": out_rows.detach(), "grad": g.grad,
        }
    return {
        "dyn": dyn,
        "full_ok": bool(torch.equal(full.detach()[0], x)),
        "grad": emb.grad.tolist(),
        "both": both.detach().tolist(),
        "rows_grad": rows.grad.tolist(),
        "first": first.tolist(),
    }


def run(rank: int, world_size: int) -> dict:
    out = {"megatron_forms": _megatron_forms(rank, world_size)}
    for dtype in (torch.float32, torch.float64):
        tag = str(dtype).split(".")[-1]
        out[f"fixed_uneven_{tag}"] = _fixed_case(rank, world_size, 3, dtype)
        out[f"fixed_fewer_{tag}"] = _fixed_case(rank, world_size, 1, dtype)
        # uneven images of mixed sizes (patches 16, 4, 24, 8)
        mixed = [(1, 4, 4), (1, 2, 2), (1, 6, 4), (1, 2, 4)]
        out[f"uneven_{tag}"] = _dynamic_case(rank, world_size, mixed, 2, 1, dtype)
        out[f"fewer_{tag}"] = _dynamic_case(rank, world_size, [(1, 4, 4)], 2, 1, dtype)
        # one video of 4 temporal patches (Qwen2-VL layout: t counts tubelets) and an image
        out[f"video_qwen_{tag}"] = _dynamic_case(rank, world_size, [(4, 4, 2), (1, 2, 2)], 2, 1, dtype)
        # frame layout: 8 frames, tubelets of 2 frames, plus a 4-frame video and an image
        out[f"video_tubelets_{tag}"] = _dynamic_case(
            rank, world_size, [(1, 2, 2), (8, 2, 2), (4, 2, 2)], 2, 2, dtype
        )
        out[f"video_whole_{tag}"] = _dynamic_case(
            rank, world_size, [(8, 2, 2), (1, 2, 2)], 2, 2, dtype, split_videos=False
        )
        out[f"fp8_{tag}"] = _dynamic_case(rank, world_size, mixed, 2, 1, dtype, fp8_enabled=True)
        out[f"fp8_mx_{tag}"] = _dynamic_case(rank, world_size, mixed, 1, 1, dtype, fp8_enabled=True, fp8_recipe="mxfp8")
        out[f"caller_split_{tag}"] = _dynamic_case(rank, world_size, mixed, 2, 1, dtype, split_points=[0, 20, 52])
    out["gather_dim1"] = _gather_dim1(rank, world_size, torch.float32)
    try:
        _dynamic_case(rank, world_size, [(1, 4, 4), (1, 2, 4)], 2, 1, torch.float32, split_points=[0, 8, 24])
        out["bad_split"] = None
    except ValueError as e:
        out["bad_split"] = str(e)
    return out
