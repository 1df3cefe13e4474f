"""Parallel sizes -> one named ``DeviceMesh``, validated in one place.

:class:`ParallelDims` owns the rules (every size positive, ``dp_shard`` inferred when ``-1``, the
product equal to the world size) and builds the mesh. The training loop only reads it.

Mesh dims, outermost first: ``dp_replicate, dp_shard, cp, tp``. Flattened views, for the
collectives that span several dims:

- ``dp``          = ``dp_replicate x dp_shard``   (data loading: ranks that see different rows)
- ``dp_shard_cp`` = ``dp_shard x cp``              (FSDP2 shards parameters over it)
- ``dp_cp``       = ``dp_replicate x dp_shard x cp`` (loss / token-count all-reduce)

Ranks of one ``cp`` group see the same rows and split each row's sequence.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from automodel.distributed.torch_internals import concatenate_meshes, flatten_mesh, mesh_flattened_views

__all__ = [
    "ParallelDims",
    "destroy_distributed",
    "build_device_mesh",
    "default_backend",
    "default_device_type",
    "get_submesh",
    "init_distributed",
]

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "cp", "tp")


def default_device_type() -> str:
    """``"cuda"`` when a CUDA device is usable, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_backend(device_type: str | None = None) -> str:
    """``"nccl"`` for CUDA, ``"gloo"`` for CPU."""
    return "nccl" if (device_type or default_device_type()) == "cuda" else "gloo"


@dataclass
class ParallelDims:
    """Sizes of each parallel dimension; ``dp_shard=-1`` means "whatever is left of the world".

    Args:
        dp_replicate: replicas (HSDP outer dim). >= 1.
        dp_shard: FSDP shards; ``-1`` infers ``world_size // (dp_replicate * cp * tp)``.
        cp: context-parallel size (ranks that split one sequence). >= 1.
        tp: tensor-parallel size. >= 1.
        world_size: total ranks; defaults to ``torch.distributed`` / ``$WORLD_SIZE`` / 1.

    Raises:
        ValueError: a size is not a positive int (``-1`` allowed for ``dp_shard``), or the sizes do
            not multiply to the world size. The message names the sizes and the fix.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    world_size: int | None = None
    _inferred: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size is None:
            if dist.is_available() and dist.is_initialized():
                self.world_size = dist.get_world_size()
            else:
                self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        for name in ("dp_replicate", "cp", "tp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if (
            not isinstance(self.dp_shard, int)
            or isinstance(self.dp_shard, bool)
            or (self.dp_shard < 1 and self.dp_shard != -1)
        ):
            raise ValueError(f"dp_shard={self.dp_shard!r} must be a positive integer, or -1 to infer it")
        others = self.dp_replicate * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others != 0:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp = "
                    f"{self.dp_replicate}*{self.cp}*{self.tp} = {others}; choose sizes whose product "
                    f"divides the number of launched processes (torchrun --nproc-per-node)"
                )
            self.dp_shard = self.world_size // others
            self._inferred = True
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"dp_replicate*dp_shard*cp*tp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*{self.tp} = "
                f"{product} must equal the world size {self.world_size}; set dp_shard=-1 to infer it, "
                f"or launch {product} processes"
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different rows (``dp_replicate * dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """Build the 4-D mesh ``(dp_replicate, dp_shard, cp, tp)`` plus the flattened views.

        ``torch.distributed`` must be initialised with ``world_size`` ranks. Size-1 dims are kept,
        so ``mesh["cp"]`` always exists. Flattened views: ``mesh["dp"]``, ``mesh["dp_shard_cp"]``,
        ``mesh["dp_cp"]``.
        """
        device_type = device_type or default_device_type()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "torch.distributed is not initialised; call init_distributed() (or "
                "torch.distributed.init_process_group) before build_mesh()"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was built for world size {self.world_size} but torch.distributed has "
                f"{dist.get_world_size()} ranks"
            )
        mesh = init_device_mesh(
            device_type,
            (self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=MESH_DIM_NAMES,
        )
        flatten_mesh(mesh["dp_replicate", "dp_shard"], "dp")
        flatten_mesh(mesh["dp_shard", "cp"], "dp_shard_cp")
        flatten_mesh(mesh["dp_replicate", "dp_shard", "cp"], "dp_cp")
        return mesh


def get_submesh(device_mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """The sub-mesh of ``device_mesh`` over ``names``: mesh dims and/or flattened views.

    ``get_submesh(mesh, "cp")`` is ``mesh["cp"]``; ``get_submesh(mesh, "dp")`` is the flattened
    view built by :meth:`ParallelDims.build_mesh`; several names, e.g.
    ``("dp_replicate", "dp_shard_cp")`` for HSDP, are concatenated in order. Unlike
    ``mesh["dp"]`` this avoids torch's "slicing a flattened dim from root mesh" deprecation path.

    Raises:
        ValueError: a name is neither a mesh dim nor a flattened view of the root mesh.
    """
    if not names:
        raise ValueError("get_submesh needs at least one mesh dim name, e.g. get_submesh(mesh, 'cp')")
    flattened = mesh_flattened_views(device_mesh)
    dims = device_mesh.mesh_dim_names or ()
    if all(n in dims for n in names):
        return device_mesh[names[0]] if len(names) == 1 else device_mesh[names]
    parts = []
    for name in names:
        if name in dims:
            parts.append(device_mesh[name])
        elif name in flattened:
            parts.append(flattened[name])
        else:
            raise ValueError(
                f"mesh dim {name!r} is neither a dim of the mesh {tuple(dims)} nor a flattened view "
                f"{tuple(flattened)}; build the mesh with ParallelDims.build_mesh()"
            )
    return parts[0] if len(parts) == 1 else concatenate_meshes(parts)


def build_device_mesh(
    dp_replicate: int = 1,
    dp_shard: int = -1,
    cp: int = 1,
    tp: int = 1,
    device_type: str | None = None,
) -> DeviceMesh:
    """Shortcut: ``ParallelDims(dp_replicate, dp_shard, cp, tp).build_mesh(device_type)``."""
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp).build_mesh(device_type)


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Initialise ``torch.distributed`` from torchrun's environment (single process when absent).

    Returns ``(rank, world_size)``. Chooses NCCL on CUDA (and sets the local CUDA device), gloo on
    CPU. Without ``$WORLD_SIZE`` it initialises a 1-rank group on 127.0.0.1 so the same code path
    runs as a plain ``python`` process.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def destroy_distributed() -> None:
    """End ``torch.distributed`` in this process: destroy every process group, and free them now.

    ``dist.destroy_process_group()`` unregisters the groups, but a group that cyclic garbage still refers to (a
    ``DeviceMesh``, a CP handle) lives on, and so do its gloo worker threads. Freed later, during the
    interpreter's shutdown, such a thread can be releasing the tensors of its last collective, which needs the
    GIL the finalizing interpreter no longer gives: the process aborts ("terminate called without an active
    exception", SIGABRT) after its work is done (a torch issue: pytorch/pytorch#190489). Collecting the garbage
    here destroys the groups while the interpreter is alive, and each one joins its threads. Call it last, after
    the code that used the groups has returned (nothing of the run referenced any more). A no-op without an
    initialised process group.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
