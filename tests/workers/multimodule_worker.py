"""Multi-module pipeline communicator on 4 gloo ranks (run once by tests/test_multimodule_pipeline.py).

The same launch also checks the ring x Ulysses primitives (``hybrid_cp``), which need 4 ranks too.

Every scenario builds its own communicator over all 4 ranks; every rank also computes the
single-process reference (float64, the modules run in sequence on the whole batch) from the same
seeds, and returns the largest absolute differences between what it received / its gradients and
the reference, so the test asserts on numbers. Error scenarios return the messages.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from automodel.distributed.pipeline.bridge import cp_sequence_indices
from automodel.distributed.pipeline.multimodule import MultiModulePipelineCommunicator
from automodel.distributed.pipeline.schedule import run_gpipe
from automodel.distributed.pipeline.topology import ModuleGrid, compute_total_pipeline_stages

D = torch.float64


def _randn(seed: int, *shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=D)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return float((a - b).detach().abs().max())


def _ht(x: torch.Tensor, cp: int, c: int, dim: int = 1) -> torch.Tensor:
    return x.index_select(dim, cp_sequence_indices(x.size(dim), cp, c, "head_tail"))


def fan_in_cp(rank: int) -> dict:
    """image (rank 0, 3-D) and audio (rank 1, 2-D [S, H]) -> llm at cp=2 head_tail (ranks 2, 3)."""
    B, S, H, DIN = 2, 8, 4, 3
    xi, wi, xa, wa = _randn(1, B, S, DIN), _randn(2, DIN, H), _randn(3, S, DIN), _randn(4, DIN, H)
    wl, tgt = _randn(5, H), _randn(6, B, S, H)
    ref = {k: v.clone().requires_grad_() for k, v in dict(wi=wi, wa=wa, wl=wl).items()}
    img, aud = xi @ ref["wi"], xa @ ref["wa"]
    img.retain_grad(), aud.retain_grad()
    (torch.tanh(img + aud[None]) * ref["wl"] * tgt).sum().backward()
    grids = {
        "image": ModuleGrid.from_sizes(0),
        "audio": ModuleGrid.from_sizes(1),
        "llm": ModuleGrid.from_sizes(2, cp=2),
    }
    comm = MultiModulePipelineCommunicator(
        grids, {"image": ["llm"], "audio": ["llm"], "llm": []}, module_output_ndim={"audio": 2}, timeout=120
    )
    out: dict = {"total_stages": comm.total_stages, "current_stage": comm.current_stage}
    if rank in (0, 1):
        name, x, w, ref_out = ("image", xi, wi, img) if rank == 0 else ("audio", xa, wa, aud)
        w = w.clone().requires_grad_()
        y = x @ w
        comm.send_forward({name: y})
        g = comm.recv_backward()
        assert list(g) == [name]
        y.backward(g[name])
        out["out_grad_err"] = _err(g[name], ref_out.grad)
        out["w_grad_err"] = _err(w.grad, ref["wi" if rank == 0 else "wa"].grad)
    else:
        c = rank - 2
        got = comm.recv_forward()
        out["keys"] = sorted(got)
        out["shapes"] = {k: tuple(v.shape) for k, v in got.items()}
        out["image_err"] = _err(got["image"], _ht(img.detach(), 2, c))
        out["audio_err"] = _err(got["audio"], _ht(aud.detach(), 2, c, dim=0))
        i, a = got["image"].requires_grad_(), got["audio"].requires_grad_()
        w = wl.clone().requires_grad_()
        (torch.tanh(i + a[None]) * w * _ht(tgt, 2, c)).sum().backward()
        comm.send_backward({"image": i.grad, "audio": a.grad})
        out["wl_grad"] = w.grad  # the test sums the two cp ranks' shares
        out["wl_ref"] = ref["wl"].grad
    return out


def fan_out_dp(rank: int) -> dict:
    """enc (rank 0) -> llm at dp=2 (ranks 1, 2; rows split) and gen (rank 3); gradients sum at the encoder."""
    B, S, H = 4, 4, 3
    x, w, t1, t2 = _randn(11, B, S, H), _randn(12, H, H), _randn(13, B, S, H), _randn(14, B, S, H)
    wr = w.clone().requires_grad_()
    y = x @ wr
    y.retain_grad()
    ((torch.tanh(y) * t1).sum() + (y.pow(2) * t2).sum()).backward()
    grids = {"enc": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(1, dp=2), "gen": ModuleGrid.from_sizes(3)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm", "gen"], "llm": [], "gen": []}, timeout=120)
    out: dict = {}
    if rank == 0:
        w0 = w.clone().requires_grad_()
        y0 = x @ w0
        comm.send_forward({"enc": y0})
        g = comm.recv_backward()["enc"]
        y0.backward(g)
        out["out_grad_err"] = _err(g, y.grad)
        out["w_grad_err"] = _err(w0.grad, wr.grad)
    else:
        got = comm.recv_forward()["enc"].requires_grad_()
        rows = slice(0, 2) if rank == 1 else slice(2, 4) if rank == 2 else slice(0, 4)
        out["recv_err"] = _err(got, y.detach()[rows])
        loss = (torch.tanh(got) * t1[rows]).sum() if rank < 3 else (got.pow(2) * t2).sum()
        loss.backward()
        comm.send_backward({"enc": got.grad})
    return out


def chain_gpipe(rank: int) -> dict:
    """enc (rank 0) -> llm at pp=2 (ranks 1, 2; 2-D [b*S, H] outputs) -> gen (rank 3), GPipe over 2
    micro-batches, grids given as DeviceMeshes."""
    B, S, H, M = 4, 6, 3, 2
    x, tgt = _randn(21, B, S, H), _randn(22, B * S, H)
    ws = [_randn(30 + i, H, H) for i in range(4)]
    ref = [w.clone().requires_grad_() for w in ws]
    total = 0
    for mb in range(M):
        rows = slice(mb * B // M, (mb + 1) * B // M)
        h = torch.tanh(x[rows] @ ref[0])
        h = torch.tanh(h.reshape(-1, H) @ ref[1])
        h = torch.tanh(h @ ref[2])
        total = total + ((h @ ref[3]) * tgt[mb * B * S // M : (mb + 1) * B * S // M]).sum()
    total.backward()
    meshes = {
        "enc": DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("dp",)),
        "llm": DeviceMesh("cpu", torch.tensor([[1], [2]]), mesh_dim_names=("pp", "dp")),
        "gen": DeviceMesh("cpu", torch.tensor([3]), mesh_dim_names=("dp",)),
    }
    topo = {"enc": ["llm"], "llm": ["gen"], "gen": []}
    comm = MultiModulePipelineCommunicator(meshes, topo, module_output_ndim={"llm": 2}, timeout=120)
    w = ws[rank].clone().requires_grad_()

    def step(mb: int, inputs: dict) -> torch.Tensor:
        if rank == 0:
            return torch.tanh(x[mb * B // M : (mb + 1) * B // M] @ w)
        (h,) = inputs.values()
        if rank == 1:
            return torch.tanh(h.reshape(-1, H) @ w)
        if rank == 2:
            return torch.tanh(h @ w)
        return ((h @ w) * tgt[mb * B * S // M : (mb + 1) * B * S // M]).sum()

    losses = run_gpipe(comm, step, M)
    out = {
        "w_grad_err": _err(w.grad, ref[rank].grad),
        "stage": comm.current_stage,
        "stage_from_meshes": compute_total_pipeline_stages(topo, meshes, rank=rank),
        "total": comm.total_stages,
        "first": comm.is_pp_first_stage,
        "last": comm.is_pp_last_stage,
    }
    if rank == 3:
        out["loss_err"] = abs(float(sum(losses)) - float(total))
    return out


def one_f_one_b(rank: int) -> dict:
    """enc (rank 0) -> llm at dp=3 (ranks 1-3), 2 micro-batches with the combined 1F1B calls."""
    B, S, H = 6, 2, 2
    x, w, t = _randn(41, B, S, H), _randn(42, H, H), _randn(43, B, S, H)
    wr = w.clone().requires_grad_()
    (torch.sin(x @ wr) * t).sum().backward()
    grids = {"enc": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(1, dp=3)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": []}, timeout=120)
    if rank == 0:
        w0 = w.clone().requires_grad_()
        y0, y1 = x[:3] @ w0, x[3:] @ w0
        comm.send_forward({"enc": y0})
        g0 = comm.send_forward_recv_backward({"enc": y1})["enc"]
        y0.backward(g0)
        y1.backward(comm.recv_backward()["enc"])
        return {"w_grad_err": _err(w0.grad, wr.grad)}
    d = rank - 1  # one row of each micro-batch of 3 rows
    x0 = comm.recv_forward()["enc"].requires_grad_()
    (torch.sin(x0) * t[d : d + 1]).sum().backward()
    x1 = comm.send_backward_recv_forward({"enc": x0.grad})["enc"].requires_grad_()
    (torch.sin(x1) * t[3 + d : 4 + d]).sum().backward()
    comm.send_backward({"enc": x1.grad})
    return {"recv_err": _err(x1, (x @ w)[3 + d : 4 + d])}


def colocated(rank: int) -> dict:
    """image (dp=2) and audio (cp=2, contiguous) colocated on ranks 0-1 -> llm at cp=4 head_tail on ranks 0-3.

    Ranks 0-1 send both encoders' outputs and receive their llm shard in one exchange; the part of an
    encoder's output that stays on the same rank goes through the communicator's local mailbox.
    """
    B, S, H = 2, 8, 3
    xi, wi, xa, wa, tgt = _randn(51, B, S, H), _randn(52, H, H), _randn(53, B, S, H), _randn(54, H, H), _randn(55, B, S, H)
    ref = {k: v.clone().requires_grad_() for k, v in dict(wi=wi, wa=wa).items()}
    (torch.tanh(xi @ ref["wi"] + xa @ ref["wa"]) * tgt).sum().backward()
    grids = {
        "image": ModuleGrid.from_sizes(0, dp=2),
        "audio": ModuleGrid.from_sizes(0, cp=2),
        "llm": ModuleGrid.from_sizes(0, cp=4),
    }
    topo = {"image": ["llm"], "audio": ["llm"], "llm": []}
    comm = MultiModulePipelineCommunicator(grids, topo, cp_layout={"audio": "contiguous"}, timeout=120)
    out: dict = {"modules": list(comm.modules)}
    w_i, w_a = wi.clone().requires_grad_(), wa.clone().requires_grad_()
    if rank < 2:
        yi = xi[rank : rank + 1] @ w_i  # dp rank `rank`: one row
        ya = xa[:, rank * 4 : (rank + 1) * 4] @ w_a  # cp rank `rank`: contiguous half
        got = comm.communicate(send_forward={"image": yi, "audio": ya}, recv_forward="llm")[0]
    else:
        got = comm.recv_forward("llm")
    i, a = got["image"].requires_grad_(), got["audio"].requires_grad_()
    idx = cp_sequence_indices(S, 4, rank, "head_tail")
    out["recv_err"] = max(_err(i, (xi @ wi)[:, idx]), _err(a, (xa @ wa)[:, idx]))
    (torch.tanh(i + a) * tgt[:, idx]).sum().backward()
    if rank < 2:
        g = comm.communicate(send_backward={"image": i.grad, "audio": a.grad}, recv_backward=["image", "audio"])[1]
        yi.backward(g["image"])
        ya.backward(g["audio"])
        out["wi_grad"], out["wa_grad"] = w_i.grad, w_a.grad  # the test sums the two ranks' shares
        out["wi_ref"], out["wa_ref"] = ref["wi"].grad, ref["wa"].grad
    else:
        comm.send_backward({"image": i.grad, "audio": a.grad})
    return out


def tensor_parallel(rank: int) -> dict:
    """enc (rank 0) -> llm at tp=2 (ranks 1-2, replicated activations) -> gen (rank 3).

    Both tp ranks receive the activation; only tp rank 0 sends it on and the gradient back; both tp
    ranks receive the gradient from gen.
    """
    B, S, H = 2, 4, 3
    x, w, t = _randn(61, B, S, H), _randn(62, H, H), _randn(63, B, S, H)
    grids = {"enc": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(1, tp=2), "gen": ModuleGrid.from_sizes(3)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": ["gen"], "gen": []}, timeout=120)
    y = x @ w
    if rank == 0:
        comm.send_forward({"enc": y})
        return {"grad_err": _err(comm.recv_backward()["enc"], 2 * t * torch.cos(y))}
    if rank in (1, 2):
        h = comm.recv_forward()["enc"].requires_grad_()
        z = torch.sin(h)
        # tp rank 1 sends a wrong activation: it must not reach gen (only tp rank 0's copy is sent)
        comm.send_forward({"llm": z if rank == 1 else z + 1})
        g = comm.recv_backward()["llm"]
        z.backward(g)
        comm.send_backward({"enc": h.grad if rank == 1 else h.grad + 1})
        return {"recv_err": _err(h, y), "grad_err": _err(g, 2 * t)}
    got = comm.recv_forward()["llm"].requires_grad_()
    (2 * got * t).sum().backward()
    comm.send_backward({"llm": got.grad})
    return {"recv_err": _err(got, torch.sin(y))}


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "<no error>"


def errors(rank: int) -> dict:
    """enc at dp=2 (ranks 0, 1) -> llm at cp=2 (ranks 2, 3): mismatches fail on both sides, then a good round trip."""
    grids = {"enc": ModuleGrid.from_sizes(0, dp=2), "llm": ModuleGrid.from_sizes(2, cp=2)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": []}, timeout=120)
    out: dict = {}
    if rank < 2:
        seq = 8 if rank == 0 else 6  # the dp ranks disagree on the sequence length
        out["disagree"] = _error(lambda: comm.send_forward({"enc": torch.ones(1, seq, 2)}))
        out["indivisible"] = _error(lambda: comm.send_forward({"enc": torch.ones(1, 6, 2)}))
        out["ndim"] = _error(lambda: comm.send_forward({"enc": torch.ones(6, 2)}))
        y = torch.full((1, 8, 2), float(rank))
        comm.send_forward({"enc": y})
        out["bad_grad"] = _error(lambda: comm.recv_backward())
        comm.send_forward({"enc": y})
        g = comm.recv_backward()["enc"]
        out["round_trip_err"] = _err(g, 2 * y)
        # the same shapes again: headers equal the accepted ones, no acknowledgement round
        comm.send_forward({"enc": y + 1})
        out["steady_err"] = _err(comm.recv_backward()["enc"], 2 * (y + 1))
        # a new sequence length on a remembered edge is validated again and works
        y16 = torch.full((1, 16, 2), float(rank))
        comm.send_forward({"enc": y16})
        out["longer_err"] = _err(comm.recv_backward()["enc"], 2 * y16)
        # a stale gradient shape that matches the remembered header: the receiver still rejects it
        comm.send_forward({"enc": y})
        out["stale_grad"] = _error(lambda: comm.recv_backward())
    else:
        for key in ("disagree", "indivisible", "ndim"):
            out[key] = _error(lambda: comm.recv_forward())
        x = comm.recv_forward()["enc"]
        out["bad_grad"] = _error(lambda: comm.send_backward({"enc": torch.ones(2, 4, 3)}))
        x = comm.recv_forward()["enc"]
        comm.send_backward({"enc": 2 * x})
        for _ in range(2):
            x = comm.recv_forward()["enc"]
            comm.send_backward({"enc": 2 * x})
        out["longer_shape"] = tuple(x.shape)
        comm.recv_forward()
        out["stale_grad"] = _error(lambda: comm.send_backward({"enc": torch.ones(2, 8, 2)}))  # [2, 4, 2] now
    return out


def timeout(rank: int) -> dict:
    """A receive whose sender never sends raises TimeoutError after the communicator's timeout.

    On its own process group: with gloo a timeout closes that group's connections.
    """
    group = dist.new_group(list(range(4)))
    grids = {"enc": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(1, dp=3)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": []}, timeout=3, group=group)
    if rank != 1:
        return {}
    start = time.monotonic()
    try:
        comm.recv_forward()
    except TimeoutError as e:
        return {"message": str(e), "waited": time.monotonic() - start}
    return {"message": "<no error>"}


def vision_2d_fan_out(rank: int) -> dict:
    """A vision encoder emitting [B*S, H] at dp=1 feeds an LLM at dp=2 (rank 3 idles), then at dp=4 (4 ranks,
    the encoder colocated on rank 0); every gradient against one process."""
    B, S, DIN, H = 4, 3, 2, 5
    x, we, wl, tgt = _randn(81, B, S, DIN), _randn(82, DIN, H), _randn(83, H, H), _randn(84, B, S, H)
    ref = {k: v.clone().requires_grad_() for k, v in dict(we=we, wl=wl).items()}
    y = (x @ ref["we"]).reshape(B * S, H)
    y.retain_grad()
    (torch.tanh(y.reshape(B, S, H) @ ref["wl"]) * tgt).sum().backward()
    out: dict = {}
    for dp, first in ((2, 1), (4, 0)):
        grids = {"vision": ModuleGrid.from_sizes(0), "llm": ModuleGrid.from_sizes(first, dp=dp)}
        comm = MultiModulePipelineCommunicator(
            grids, {"vision": ["llm"], "llm": []}, module_output_ndim={"vision": 2}, timeout=120
        )
        res: dict = {"stage": comm.current_stage, "modules": list(comm.modules)}
        if rank == 0:
            w0 = we.clone().requires_grad_()
            y0 = (x @ w0).reshape(B * S, H)
            comm.send_forward({"vision": y0})
        if "llm" in comm.modules:
            d = rank - first
            got = comm.recv_forward(module_name="llm")["vision"].requires_grad_()
            rows = slice(d * B // dp, (d + 1) * B // dp)
            res["recv_err"] = _err(got, y.detach()[rows.start * S : rows.stop * S])
            w1 = wl.clone().requires_grad_()
            (torch.tanh(got.reshape(-1, S, H) @ w1) * tgt[rows]).sum().backward()
            res["wl_grad"] = w1.grad
            comm.send_backward({"vision": got.grad})
        if rank == 0:
            g = comm.recv_backward(module_name="vision")["vision"]
            y0.backward(g)
            res["out_grad_err"], res["we_grad_err"] = _err(g, y.grad), _err(w0.grad, ref["we"].grad)
        if not comm.modules:
            res["idle"] = (comm.recv_forward(), comm.recv_backward())
        res["wl_ref"] = ref["wl"].grad
        out[f"dp{dp}"] = res
    # fan-in: the encoder at dp=2 (ranks 0, 1; 2-D token blocks) into an LLM at dp=1 (rank 2)
    grids = {"vision": ModuleGrid.from_sizes(0, dp=2), "llm": ModuleGrid.from_sizes(2)}
    comm = MultiModulePipelineCommunicator(grids, {"vision": ["llm"], "llm": []}, module_output_ndim={"vision": 2}, timeout=120)
    res = {}
    if rank < 2:
        rows = slice(rank * B // 2, (rank + 1) * B // 2)
        w0 = we.clone().requires_grad_()
        y0 = (x[rows] @ w0).reshape(-1, H)
        comm.send_forward({"vision": y0})
        g = comm.recv_backward()["vision"]
        y0.backward(g)
        res["out_grad_err"] = _err(g, y.grad[rows.start * S : rows.stop * S])
        res["we_grad"] = w0.grad
    elif rank == 2:
        got = comm.recv_forward()["vision"].requires_grad_()
        res["recv_err"] = _err(got, y.detach())
        w1 = wl.clone().requires_grad_()
        (torch.tanh(got.reshape(B, S, H) @ w1) * tgt).sum().backward()
        res["wl_grad_err"] = _err(w1.grad, ref["wl"].grad)
        comm.send_backward({"vision": got.grad})
    res["we_ref"] = ref["we"].grad
    out["fan_in"] = res
    return out


class _HyperCommGrid:
    """The attributes of Megatron's HyperCommGrid the communicator reads (first dim name varies fastest)."""

    def __init__(self, shape, dim_names, rank_offset=0):
        self.shape, self.dim_names, self.rank_offset = shape, dim_names, rank_offset
        self.size = int(torch.tensor(shape).prod())


def megatron_call_forms(rank: int) -> dict:
    """Megatron's constructor (grids, topology, config, dim_mapping), [S, B, H] activations, tensor_shape
    arguments, a gradient sent before any activation on its edge; rank 3 idles."""
    S, B, H = 4, 2, 3
    grids = {"enc": _HyperCommGrid([1, 1, 1, 1], ["tp", "cp", "dp", "pp"]), "llm": _HyperCommGrid([1, 1, 2, 1], ["tp", "cp", "dp", "pp"], 1)}
    comm = MultiModulePipelineCommunicator(grids, {"enc": ["llm"], "llm": []}, object(), {"s": 0, "b": 1, "h": 2}, timeout=120)
    y, tgt = _randn(91, S, B, H), _randn(92, S, B, H)
    out: dict = {"stage": comm.current_stage, "in_enc_grid": comm.is_current_rank_in_grid(grids["enc"])}
    if rank == 0:
        gb = comm.recv_backward([S, B, H])["enc"]  # before any forward on the edge
        out["early_grad_err"] = _err(gb, 3 * tgt)
        comm.send_forward({"enc": y})
        out["grad_err"] = _err(comm.recv_backward([S, B, H])["enc"], tgt)
    elif rank in (1, 2):
        cols = slice(rank - 1, rank)
        comm.send_backward({"enc": 3 * tgt[:, cols]})
        got = comm.recv_forward([S, 1, H])["enc"]
        out["recv_err"] = _err(got, y[:, cols])
        comm.send_backward({"enc": tgt[:, cols]})
    return out


def hybrid_cp(rank: int) -> dict:
    """Ring 2 x Ulysses 2 split/gather primitives (bshd and packed) on 4 ranks, every grad_scale, against
    one process: rank r = ring_rank * 2 + ulysses_rank."""
    from automodel.distributed.sp.all_to_all import cal_split_sizes, cal_split_sizes_multi
    from automodel.distributed.sp.hybrid import (
        gather_forward_split_backward_with_cp,
        new_hybrid_cp_groups,
        packed_data_gather_forward_split_backward_with_cp,
        packed_data_split_forward_gather_backward_with_cp,
        packed_split_indices,
        split_forward_gather_backward_with_cp,
    )
    from automodel.distributed.sp.split_gather import load_balanced_indices

    groups = new_hybrid_cp_groups(2)
    out: dict = {"sizes": (groups.get_ring_group_size(), groups.get_ulysses_group_size()),
                 "ranks": (groups.get_ring_rank(), groups.get_ulysses_rank())}
    S, lens = 12, [5, 7, 3]

    def piece(idx: torch.Tensor, u: int) -> torch.Tensor:
        sizes = cal_split_sizes(len(idx), 2)
        return idx[sum(sizes[:u]) : sum(sizes[:u]) + sizes[u]]

    bshd = [piece(load_balanced_indices(S, 2, c // 2), c % 2) for c in range(4)]
    ring_packed = packed_split_indices(cal_split_sizes_multi(lens, 2))
    packed = [piece(ring_packed[c // 2], c % 2) for c in range(4)]
    factor = {"down": 0.25, "up": 4.0, None: 1.0}
    for kind, idx, n, dim in (("bshd", bshd, S, 1), ("packed", packed, sum(lens), 0)):
        shape = (2, n, 3) if dim == 1 else (n, 3)
        x = _randn(100, *shape)
        for scale in ("down", "up", None):
            xr = x.clone().requires_grad_()
            if kind == "bshd":
                y = split_forward_gather_backward_with_cp(xr, dim, grad_scale=scale)
            else:
                y = packed_data_split_forward_gather_backward_with_cp(xr, dim, lens, grad_scale=scale)
            gs = [_randn(110 + c, *(shape[:dim] + (len(idx[c]),) + shape[dim + 1 :])) for c in range(4)]
            (y * gs[rank]).sum().backward()
            full_g = torch.zeros(shape, dtype=D)
            for c in range(4):
                full_g.index_copy_(dim, idx[c], gs[c])
            err = {"y": _err(y, x.index_select(dim, idx[rank])), "grad": _err(xr.grad, full_g * factor[scale])}
            # the gather twin: every rank's piece back in order; a replicated loss gives this rank its slice
            mine = x.index_select(dim, idx[rank]).clone().requires_grad_()
            if kind == "bshd":
                z = gather_forward_split_backward_with_cp(mine, dim, S, grad_scale=scale)
            else:
                z = packed_data_gather_forward_split_backward_with_cp(mine, dim, lens, grad_scale=scale)
            gz = _randn(120, *shape)
            (z * gz).sum().backward()
            err["gather"] = _err(z, x)
            err["gather_grad"] = _err(mine.grad, gz.index_select(dim, idx[rank]) * factor[scale])
            out[f"{kind}/{scale}"] = err
    try:
        split_forward_gather_backward_with_cp(torch.zeros(1, 10, 1), 1)
    except ValueError as e:
        out["error"] = str(e)
    from automodel.distributed.sp.hybrid import HybridCPGroups, set_hybrid_cp_groups

    set_hybrid_cp_groups(HybridCPGroups())
    return out


def main(rank: int, world_size: int) -> dict:
    assert world_size == 4
    out, seconds = {}, {}
    for fn in (
        fan_in_cp, fan_out_dp, chain_gpipe, one_f_one_b, colocated, tensor_parallel, errors,
        vision_2d_fan_out, megatron_call_forms, hybrid_cp, timeout,
    ):
        start = time.monotonic()
        out[fn.__name__] = fn(rank)
        seconds[fn.__name__] = round(time.monotonic() - start, 2)
    out["seconds"] = seconds
    return out
