"""The CPU ring's rotation is synchronous (see tests/test_cpu_ring_rotation.py).

Runs causal SDPA forward + backward under ring CP on 2 gloo ranks, once with automodel's rotation
and once with torch's own rotaters put back (the control), counting the asynchronous functional
collectives torch's ring would issue, and comparing with the single-process result in fp64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def main(rank: int, world_size: int) -> dict:
    import torch.distributed._functional_collectives as ft_c

    from automodel.distributed.cp.ring import cpu_ring
    from automodel.distributed.cp_utils import create_context_parallel_ctx
    from automodel.distributed.mesh import ParallelDims
    from automodel.distributed.torch_internals import context_parallel_unshard, cp_attention_module

    attn = cp_attention_module()
    torch_rotater = attn._create_rotater
    mesh = ParallelDims(cp=world_size, world_size=world_size).build_mesh("cpu")["cp"]
    # torch's ring all-gathers with ft_c.all_gather_single (2.13+), ft_c.all_gather_tensor before
    gather = "all_gather_single" if hasattr(ft_c, "all_gather_single") else "all_gather_tensor"
    calls = {"permute_tensor": 0, gather: 0}
    originals = {name: getattr(ft_c, name) for name in calls}

    def counting(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return fn

    for name in calls:
        setattr(ft_c, name, counting(name))
    g = torch.Generator().manual_seed(0)
    seq = 16 * world_size
    q, k, v, dout = (torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=g) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref.backward(dout)
    expected = [ref.detach(), *(t.grad for t in ref_in)]
    results: dict = {}
    try:
        for variant in ("automodel", "torch"):
            for method in ("allgather", "alltoall"):
                for name in calls:
                    calls[name] = 0
                bufs = [q.clone(), k.clone(), v.clone(), dout.clone()]
                ctx = create_context_parallel_ctx(
                    mesh, bufs, [2, 2, 2, 2], set(bufs), cp_rotate_method=method
                )
                with ctx:
                    factory = attn._create_rotater
                    if variant == "torch":
                        attn._create_rotater = torch_rotater
                    try:
                        local = [t.detach().clone().requires_grad_() for t in bufs[:3]]
                        out = F.scaled_dot_product_attention(*local, is_causal=True)
                        out.backward(bufs[3])
                        issued = sum(calls.values())  # before the unshard below (an all-gather)
                    finally:
                        attn._create_rotater = factory
                    full = context_parallel_unshard(mesh, [out.detach(), *(t.grad for t in local)], [2] * 4)
                results[f"{variant}-{method}"] = {
                    "async_collectives": issued,
                    "factory_inside": factory is cpu_ring._sync_create_rotater,
                    "max_err": max((a - b).abs().max().item() for a, b in zip(full, expected)),
                }
    finally:
        for name, fn in originals.items():
            setattr(ft_c, name, fn)
    results["factory_restored"] = attn._create_rotater is torch_rotater
    return results
