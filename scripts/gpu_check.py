#!/usr/bin/env python
"""GPU check for the THD path (not run in CI: it needs CUDA, and flash-attn / Transformer Engine).

Launch on a GPU host with 2 (or more) GPUs::

    torchrun --standalone --nproc-per-node 2 scripts/gpu_check.py

1. **Partition**: :func:`automodel.distributed.thd_utils.thd_partition_indices` (pure torch) against
   Transformer Engine's ``thd_get_partitioned_indices`` kernel, for random packed layouts, every rank
   of W = 1, 2, 4, 8 (on rank 0 only; skipped when TE is not installed).
2. **Kernels**: THD attention over the CP group (NCCL) with ``kernel="flash_attn"`` and ``kernel="te"``
   against ``kernel="portable"`` on the same bf16 inputs upcast to fp32 (exact math blocks on CUDA):
   outputs and the gradients of q, k, v, relative error (bf16 bar: 2e-2). A kernel whose package is
   missing is reported as unavailable, not skipped silently.

Prints one line per check and exits 1 if any available check fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from automodel.distributed.thd_attention import THDPlan, thd_attention  # noqa: E402
from automodel.distributed.thd_utils import thd_partition_indices  # noqa: E402

BAR = 2e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check_partition() -> bool:
    try:
        import transformer_engine_torch as tex
    except ImportError:
        print("partition: transformer_engine_torch not installed: UNAVAILABLE")
        return True
    g = torch.Generator().manual_seed(0)
    ok = True
    for world in (1, 2, 4, 8):
        for _ in range(20):
            n = int(torch.randint(1, 9, (1,), generator=g))
            lens = (torch.randint(1, 9, (n,), generator=g) * 2 * world).tolist()
            cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
            total = int(cu[-1])
            for r in range(world):
                ours = thd_partition_indices(cu, total, world, r).long()
                theirs = tex.thd_get_partitioned_indices(cu.cuda(), total, world, r).long().cpu()
                ok &= torch.equal(ours, theirs)
    print(f"partition vs TE thd_get_partitioned_indices: {'OK' if ok else 'MISMATCH'}")
    return ok


def check_kernels(rank: int, world: int) -> bool:
    device = torch.device("cuda", torch.cuda.current_device())
    lens = [1, 22, 13, 7, 40]
    padded = [-(-n // (2 * world)) * 2 * world for n in lens]
    cu_p = [0]
    cu = [0]
    for n, p in zip(lens, padded):
        cu_p.append(cu_p[-1] + p)
        cu.append(cu[-1] + n)
    total = cu_p[-1]
    g = torch.Generator().manual_seed(0)
    hq, hkv, d = 8, 2, 64
    full = [torch.randn(1, h, total, d, generator=g) for h in (hq, hkv, hkv)]
    grad_full = torch.randn(1, hq, total, d, generator=g)
    idx = thd_partition_indices(torch.tensor(cu_p), total, world, rank).long()
    local = [t[:, :, idx].to(device, torch.bfloat16) for t in full]
    dout = grad_full[:, :, idx].to(device)

    def run(kernel: str, dtype: torch.dtype):
        plan = THDPlan(
            dist.group.WORLD if world > 1 else None, world, rank, cu_p, cu, max(padded), kernel=kernel
        )
        q, k, v = (t.to(dtype).detach().requires_grad_() for t in local)
        out = thd_attention(q, k, v, plan)
        out.backward(dout.to(out.dtype))
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    ref = run("portable", torch.float32)
    ok = True
    for kernel in ("flash_attn", "te"):
        package = "flash_attn" if kernel == "flash_attn" else "transformer_engine"
        try:
            __import__(package)
        except ImportError:
            if rank == 0:
                print(f"kernel {kernel}: {package} not installed: UNAVAILABLE")
            continue
        try:
            got = run(kernel, torch.bfloat16)
            errs = [_rel(a, b) for a, b in zip(got, ref)]
            good = max(errs) <= BAR
        except Exception as err:  # noqa: BLE001 - report and continue with the next kernel
            errs, good = [repr(err)], False
        ok &= good
        if rank == 0:
            names = "out, dq, dk, dv"
            print(
                f"kernel {kernel} vs portable (cp={world}, bf16): rel err [{names}] = {errs}: {'OK' if good else 'FAIL'}"
            )
    return ok


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the THD CUDA kernels are unverified here)")
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl")
    ok = check_partition() if rank == 0 else True
    ok &= check_kernels(rank, world)
    if world > 1:
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
