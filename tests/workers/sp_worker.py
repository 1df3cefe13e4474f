"""Multi-process checks of the sequence-parallel primitives (run on 3 gloo ranks by tests/test_sp_primitives.py).

Three ranks, because near-even splits with a remainder of 2 (``100 -> [34, 33, 33]``) and routing between
more than one peer cannot be seen with two. Every case returns detached outputs and input gradients;
the test recomputes them with a single-process simulation (see ``inputs`` and the test's references).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from automodel.distributed.sp.all_to_all import all_to_all, cal_split_sizes_multi
from automodel.distributed.sp.hybrid import (
    packed_data_gather_forward_split_backward,
    packed_data_split_forward_gather_backward,
)
from automodel.distributed.sp.sharding import (
    ShardingValidator,
    get_sharding_validator,
    sp_gather,
    sp_gather_with_grad,
    sp_gather_with_padding,
    sp_shard,
    sp_shard_with_padding,
)
from automodel.distributed.sp.split_gather import (
    gather_forward_split_backward,
    gather_forward_split_backward_load_balanced,
    gather_forward_split_backward_per_sequence,
    load_balanced_gather_forward_split_backward,
    load_balanced_split_forward_gather_backward,
    per_sequence_indices,
    split_forward_gather_backward,
    split_forward_gather_backward_load_balanced,
    split_forward_gather_backward_per_sequence,
)

#: all_to_all cases: name -> (per-rank input shapes as a function of rank, scatter_dim, gather_dim, gather_size)
A2A_CASES = {
    "aligned": (lambda r: (2, 6, 3, 4), 1, 2, None),
    "scatter_uneven": (lambda r: (2, 7, 3, 4), 1, 2, None),
    "gather_uneven": (lambda r: (2, 6, [34, 33, 33][r], 4), 1, 2, 100),
    "both_uneven": (lambda r: (7, [34, 33, 33][r], 2), 0, 1, 100),
    "negative_dims": (lambda r: (3, 5, 4), -1, -2, None),
}

PACKED_CU = [0, 6, 18, 24]  # sequence lengths 6, 12, 6: each divisible by 2*3
PACKED_LENS = [5, 7, 2]  # MindSpeed-MM's packed split: any lengths, each cut near-evenly


def inputs(case: str, rank: int, shape: tuple[int, ...], *, same_on_all_ranks: bool = False) -> torch.Tensor:
    """Deterministic float64 input of ``shape`` for ``case`` on ``rank`` (or shared by every rank)."""
    seed = sum(map(ord, case)) * 101 + (0 if same_on_all_ranks else rank + 1)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _check_error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"


def main(rank: int, world_size: int) -> dict:
    out: dict = {}

    # --- all_to_all
    for name, (shape_of, sd, gd, gsize) in A2A_CASES.items():
        x = inputs("a2a_" + name, rank, shape_of(rank)).requires_grad_(True)
        y = all_to_all(x, None, sd, gd, gather_size=gsize)
        g = inputs("a2a_g_" + name, rank, tuple(y.shape))
        (y * g).sum().backward()
        out[f"a2a/{name}"] = {"y": y.detach(), "grad": x.grad}
    # round trip on uneven sequence shards: heads <-> sequence and back
    x = inputs("a2a_rt", rank, (2, 6, [34, 33, 33][rank], 4))
    mid = all_to_all(x, None, 1, 2, gather_size=100)
    back = all_to_all(mid, None, 2, 1)
    out["a2a/roundtrip"] = {"x": x, "mid_shape": tuple(mid.shape), "back": back}
    out["a2a/error"] = _check_error(lambda: all_to_all(torch.zeros(2, 6, 10), None, 1, 2, gather_size=100))

    # --- split / gather, contiguous
    full_shape = (2, 12, 3)
    for scale in (None, "up", "down"):
        x = inputs("split", rank, full_shape, same_on_all_ranks=True).requires_grad_(True)
        y = split_forward_gather_backward(x, None, 1, grad_scale=scale)
        g = inputs("split_g", rank, tuple(y.shape))
        (y * g).sum().backward()
        out[f"split/even/{scale}"] = {"y": y.detach(), "grad": x.grad}

        x = inputs("gather", rank, (2, 4, 3)).requires_grad_(True)
        y = gather_forward_split_backward(x, None, 1, grad_scale=scale)
        g = inputs("gather_g", rank, tuple(y.shape), same_on_all_ranks=True)
        (y * g).sum().backward()
        out[f"gather/even/{scale}"] = {"y": y.detach(), "grad": x.grad}

    sizes = [5, 3, 4]
    x = inputs("split_uneven", rank, full_shape, same_on_all_ranks=True).requires_grad_(True)
    y = split_forward_gather_backward(x, None, 1, sizes)  # default grad_scale: "down" (MindSpeed-MM)
    g = inputs("split_uneven_g", rank, tuple(y.shape))
    (y * g).sum().backward()
    out["split/uneven"] = {"y": y.detach(), "grad": x.grad}

    x = inputs("gather_uneven", rank, (2, sizes[rank], 3)).requires_grad_(True)
    y = gather_forward_split_backward(x, None, 1, gather_sizes=sizes)  # default grad_scale: "up"
    g = inputs("gather_uneven_g", rank, tuple(y.shape), same_on_all_ranks=True)
    (y * g).sum().backward()
    out["gather/uneven"] = {"y": y.detach(), "grad": x.grad}
    out["split/error"] = _check_error(lambda: split_forward_gather_backward(torch.zeros(2, 7), None, 1, [3, 3, 3]))

    # --- load-balanced and per-sequence
    x = inputs("lb", rank, full_shape, same_on_all_ranks=True).requires_grad_(True)
    y = split_forward_gather_backward_load_balanced(x, None, 1)
    g = inputs("lb_g", rank, tuple(y.shape))
    (y * g).sum().backward()
    back = gather_forward_split_backward_load_balanced(y.detach(), None, 1)
    out["lb/split"] = {"y": y.detach(), "grad": x.grad, "back": back}

    xl = inputs("lb_gather", rank, (2, 4, 3)).requires_grad_(True)
    yl = gather_forward_split_backward_load_balanced(xl, None, 1)
    g = inputs("lb_gather_g", rank, tuple(yl.shape), same_on_all_ranks=True)
    (yl * g).sum().backward()
    out["lb/gather"] = {"y": yl.detach(), "grad": xl.grad}

    cu = torch.tensor(PACKED_CU, dtype=torch.int32)
    x = inputs("ps", rank, (24, 2), same_on_all_ranks=True).requires_grad_(True)
    y = split_forward_gather_backward_per_sequence(x, cu, None, 0)
    g = inputs("ps_g", rank, tuple(y.shape))
    (y * g).sum().backward()
    back = gather_forward_split_backward_per_sequence(y.detach(), cu, None, 0)
    out["ps/split"] = {
        "y": y.detach(),
        "grad": x.grad,
        "back": back,
        "idx": per_sequence_indices(cu, world_size, rank),
    }

    xl = inputs("ps_gather", rank, (8, 2)).requires_grad_(True)
    yl = gather_forward_split_backward_per_sequence(xl, cu, None, 0)
    g = inputs("ps_gather_g", rank, tuple(yl.shape), same_on_all_ranks=True)
    (yl * g).sum().backward()
    out["ps/gather"] = {"y": yl.detach(), "grad": xl.grad}

    # --- sharding helpers: sp_gather(f(sp_shard(x))) with a replicated loss, and a parameter inside f
    x = inputs("shard", rank, (2, 9, 3), same_on_all_ranks=True).requires_grad_(True)
    w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    validator = ShardingValidator()
    with validator.track():
        s = sp_shard(x, 1, name="hidden")
        y = sp_gather(torch.sin(s) * w, 1, name="hidden")
    g = inputs("shard_g", rank, tuple(y.shape), same_on_all_ranks=True)
    (y * g).sum().backward()
    validator.validate()  # every named shard was gathered
    w_grad = w.grad.clone()
    dist.all_reduce(w_grad)  # parameters inside the sharded region: SUM over the group
    out["shard/compose"] = {
        "y": y.detach(),
        "grad": x.grad,
        "w_grad_sum": w_grad,
        "shard_shape": tuple(s.shape),
    }

    x = inputs("shard_pad", rank, (2, 7, 3), same_on_all_ranks=True).requires_grad_(True)
    s, pad = sp_shard_with_padding(x, 1, pad_value=-5.0)
    y = sp_gather_with_padding(torch.cos(s), 1, pad)
    g = inputs("shard_pad_g", rank, tuple(y.shape), same_on_all_ranks=True)
    (y * g).sum().backward()
    out["shard/padding"] = {"shard": s.detach(), "pad": pad, "y": y.detach(), "grad": x.grad}

    out["shard/error_divisible"] = _check_error(lambda: sp_shard(torch.zeros(2, 7), 1))
    out["shard/error_short"] = _check_error(lambda: sp_shard(torch.zeros(2, 2), 1))

    validator = ShardingValidator()
    with validator.track():
        sp_shard(torch.zeros(2, 6), 1, name="kept_sharded")
        sp_gather(sp_shard(torch.zeros(2, 6), 1, name="ok"), 1, name="ok")
    out["validator/error"] = _check_error(validator.validate)
    out.update(seed_examples(rank, world_size))
    return out


def seed_examples(rank: int, world_size: int) -> dict:
    """The seeds' documented calls, ported with only the import changed (MindSpeed-MM, vllm-omni)."""
    out: dict = {}
    # MindSpeed-MM all_to_all defaults: scatter_dim=2, gather_dim=1 ([B, S/W, H, D] -> [B, S, H/W, D])
    x = inputs("ms_a2a", rank, (2, 4, 6, 3)).requires_grad_(True)
    y = all_to_all(x, None)
    g = inputs("ms_a2a_g", rank, tuple(y.shape))
    (y * g).sum().backward()
    out["ms/a2a_default"] = {"y": y.detach(), "grad": x.grad}
    # split without split_sizes: near-even (7 over 3 -> [3, 2, 2]), every grad_scale; the older argument
    # order (grad_scale 4th) ports too
    for scale in ("down", "up", None, "positional"):
        x = inputs("ms_split", rank, (7, 2), same_on_all_ranks=True).requires_grad_(True)
        if scale == "positional":
            y = split_forward_gather_backward(x, None, 0, "up")
        elif scale == "down":
            y = split_forward_gather_backward(x, None, 0)
        else:
            y = split_forward_gather_backward(x, None, 0, grad_scale=scale)
        g = inputs("ms_split_g", rank, tuple(y.shape))
        (y * g).sum().backward()
        out[f"ms/split_uneven/{scale}"] = {"y": y.detach(), "grad": x.grad}
    # the load-balanced names: reference scales fixed ("down" split, "up" gather)
    x = inputs("ms_lb", rank, (12, 2), same_on_all_ranks=True).requires_grad_(True)
    y = load_balanced_split_forward_gather_backward(x, None)
    g = inputs("ms_lb_g", rank, tuple(y.shape))
    (y * g).sum().backward()
    xl = inputs("ms_lbg", rank, (4, 2)).requires_grad_(True)
    yl = load_balanced_gather_forward_split_backward(xl, None)
    gl = inputs("ms_lbg_g", 0, tuple(yl.shape), same_on_all_ranks=True)
    (yl * gl).sum().backward()
    out["ms/lb"] = {"y": y.detach(), "grad": x.grad, "gy": yl.detach(), "ggrad": xl.grad}
    # packed sequences of uneven lengths, each cut near-evenly; every grad_scale
    lens = PACKED_LENS
    for scale in ("down", "up", None):
        x = inputs("ms_packed", rank, (sum(lens), 2), same_on_all_ranks=True).requires_grad_(True)
        y = packed_data_split_forward_gather_backward(x, None, lens, 0, grad_scale=scale)
        g = inputs("ms_packed_g", rank, tuple(y.shape))
        (y * g).sum().backward()
        split = cal_split_sizes_multi(lens, world_size)
        xl = inputs("ms_packed_l", rank, (int(split[rank].sum()), 2)).requires_grad_(True)
        yl = packed_data_gather_forward_split_backward(xl, split, None, 0, grad_scale=scale)
        gl = inputs("ms_packed_lg", 0, tuple(yl.shape), same_on_all_ranks=True)
        (yl * gl).sum().backward()
        out[f"ms/packed/{scale}"] = {"y": y.detach(), "grad": x.grad, "gy": yl.detach(), "ggrad": xl.grad}
    out["ms/packed_error"] = _check_error(lambda: packed_data_split_forward_gather_backward(torch.zeros(9, 1), None, [4, 4]))

    # vllm-omni: sp_shard(validate=False) gives torch.chunk pieces; sp_gather puts them back
    x = inputs("vo_chunk", rank, (2, 17), same_on_all_ranks=True).requires_grad_(True)
    s = sp_shard(x, 1, validate=False)
    y = sp_gather(torch.sin(s), dim=1)
    g = inputs("vo_chunk_g", 0, tuple(y.shape), same_on_all_ranks=True)
    (y * g).sum().backward()
    out["vo/chunk"] = {"shard": s.detach(), "y": y.detach(), "grad": x.grad}
    # the docstring examples: "In model forward" / "At end of model forward"
    hidden_states = inputs("vo_doc", rank, (2, 6, 3), same_on_all_ranks=True)
    hidden_states = sp_shard(hidden_states, dim=1)
    output = hidden_states + 1
    output = sp_gather(output, dim=1)
    out["vo/doc"] = {"shard": hidden_states, "y": output}
    # the documented usage: with validator.track(): validator.shard / validator.gather; validate()
    validator = get_sharding_validator()
    hidden_states = inputs("vo_val", rank, (2, 6, 3), same_on_all_ranks=True)
    with validator.track():
        hidden_states = validator.shard(hidden_states, "hidden_states", dim=1)
        output = validator.gather(hidden_states * 2, "hidden_states", dim=1)
    validator.validate()
    out["vo/validator"] = {"y": output}
    with validator.track():  # track() starts afresh, as vllm-omni's does
        validator.shard(torch.zeros(2, 6), "leaked", dim=1)
    out["vo/validator_error"] = _check_error(validator.validate)
    # docstring examples: shard with padding, gather, trim the padding at the end
    hidden_states = inputs("vo_pad", rank, (2, 7), same_on_all_ranks=True)
    sharded, pad_size = sp_shard_with_padding(hidden_states, dim=1)
    output = sp_gather(sharded, dim=1)
    if pad_size > 0:
        output = output[..., :-pad_size]  # Remove padding
    out["vo/padding"] = {"y": output, "pad": pad_size}
    x = inputs("vo_grad", rank, (2, 3)).requires_grad_(True)
    y = sp_gather_with_grad(x, dim=1)
    g = inputs("vo_grad_g", 0, tuple(y.shape), same_on_all_ranks=True)
    (y * g).sum().backward()
    out["vo/with_grad"] = {"y": y.detach(), "grad": x.grad}
    return out
