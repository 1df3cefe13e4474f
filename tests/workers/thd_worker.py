"""Packed-batch builder for the THD tests, and the 2-rank worker that runs make_cp_batch_for_te on a real mesh."""

from __future__ import annotations

import torch

SENTINEL = -1000


def make_packed_batch(seed: int, batch_size: int, seq_len: int, multiple: int, vocab: int = 50) -> dict:
    """A random packed BSHD batch whose padded sequence lengths are multiples of ``multiple``.

    Each row of ``seq_len`` tokens (a multiple of ``multiple``) is cut into packed sequences; each has a
    real length in ``[1, padded]``; slack slots hold token 0, label -100 and loss_mask 0. ``seq_lens`` rows
    are right-padded with the -1000 sentinel. Token ids of real tokens are in ``[1, vocab)``.
    """
    assert seq_len % multiple == 0
    g = torch.Generator().manual_seed(seed)
    units = seq_len // multiple
    rows_real, rows_padded = [], []
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), -100, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for b in range(batch_size):
        real, padded, start, left = [], [], 0, units
        while left > 0:
            u = int(torch.randint(1, left + 1, (1,), generator=g))
            p = u * multiple
            r = int(torch.randint(1, p + 1, (1,), generator=g))
            input_ids[b, start : start + r] = torch.randint(1, vocab, (r,), generator=g)
            labels[b, start : start + r - 1] = input_ids[b, start + 1 : start + r]
            loss_mask[b, start : start + r - 1] = 1
            real.append(r)
            padded.append(p)
            start += p
            left -= u
        rows_real.append(real)
        rows_padded.append(padded)
    width = max(len(r) for r in rows_padded)

    def pad(rows):
        return torch.tensor([r + [SENTINEL] * (width - len(r)) for r in rows], dtype=torch.long)

    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": loss_mask,
        "seq_lens": pad(rows_real),
        "seq_lens_padded": pad(rows_padded),
    }


def main(rank: int, world_size: int) -> dict:
    """make_cp_batch_for_te on a real 1-D gloo CP mesh, for num_chunks 1 and 2."""
    from torch.distributed.device_mesh import init_device_mesh

    from automodel.distributed.cp.te_batch import make_cp_batch_for_te

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    batch = make_packed_batch(seed=7, batch_size=4, seq_len=16, multiple=2 * world_size)
    return {
        "mesh_rank": mesh.get_local_rank(),
        "one": make_cp_batch_for_te(mesh, batch),
        "two": make_cp_batch_for_te(mesh, batch, num_chunks=2),
    }
