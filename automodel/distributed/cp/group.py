"""The one place that turns what a user passes as "the CP group" into a process group, size and rank."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["get_cp_mesh", "resolve_cp_group"]


def get_cp_mesh(device_mesh: Any) -> Any:
    """The ``cp`` sub-mesh of ``device_mesh``, or ``None`` if there is no mesh or no ``cp`` dim."""
    if device_mesh is None:
        return None
    names = tuple(device_mesh.mesh_dim_names or ())
    if "cp" not in names:
        return None
    return device_mesh["cp"] if len(names) > 1 else device_mesh


def resolve_cp_group(
    device_mesh: Any, *, default_world: bool = False, keep_single: bool = False, any_1d_mesh: bool = False
) -> tuple[Any, int, int]:
    """``(group, world_size, rank)`` of the CP group given as a mesh, a process group or ``None``.

    Args:
        device_mesh: a ``DeviceMesh`` with a ``"cp"`` dim, an unnamed 1-D (CP) mesh, a ``ProcessGroup``, or ``None``.
        default_world: with ``None``, take the default group's size and rank (the group is still
            returned as ``None``); otherwise ``None`` means no CP: ``(None, 1, 0)``.
        keep_single: return the group even when its size is 1 (the multimodal primitives' convention).
        any_1d_mesh: take any 1-D mesh as the CP mesh, whatever its dim name (else only an unnamed one).

    Returns:
        ``group`` is ``None`` when ``device_mesh`` is ``None``, and when the CP size is 1 (nothing to
        communicate) unless ``keep_single``.

    Raises:
        TypeError: not a mesh, a process group or ``None``.
        ValueError: a multi-dimensional mesh without a ``"cp"`` dim.
    """
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    if device_mesh is None:
        if default_world and dist.is_available() and dist.is_initialized():
            return None, dist.get_world_size(), dist.get_rank()
        return None, 1, 0
    if isinstance(device_mesh, ProcessGroup):
        group = device_mesh
    elif isinstance(device_mesh, DeviceMesh):
        names = tuple(device_mesh.mesh_dim_names or ())
        if "cp" in names:
            mesh = device_mesh["cp"] if device_mesh.ndim > 1 else device_mesh
        elif device_mesh.ndim == 1 and (not names or any_1d_mesh):
            mesh = device_mesh  # an unnamed 1-D mesh is taken as the CP mesh
        else:
            raise ValueError(
                f"the device mesh has dims {names} and none is named 'cp'; pass a mesh with a 'cp' dim "
                "(automodel.distributed.mesh) or the 1-D CP mesh itself"
            )
        group = mesh.get_group()
    else:
        raise TypeError(
            f"expected a DeviceMesh with a 'cp' dim, a 1-D CP mesh, a ProcessGroup or None; got "
            f"{type(device_mesh).__name__}"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return (group if world > 1 or keep_single else None), world, rank
