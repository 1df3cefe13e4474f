"""What ``distributed.cp_method: thd`` adds to the recipe: kernel options, per-document padding, checks.

- :func:`thd_batch_kwargs`: ``distributed.thd_kernel`` / ``thd_cp_comm_type`` for the batch function;
- :func:`thd_dataset_kwargs`: a packed dataset (``pack: true``) pads every document to a multiple of
  ``2*cp_size`` (TE's partition splits every document into ``2*cp`` chunks; ``*tp_size`` with sequence parallelism) unless the config
  sets ``seq_pad_multiple`` itself;
- :func:`thd_config_problems`: the config rules (called from :mod:`automodel.config.rules`).
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = [
    "thd_batch_kwargs",
    "thd_dataset_kwargs",
    "thd_config_problems",
    "THD_KERNELS",
    "THD_CP_COMM_TYPES",
]

# Mirrors automodel.distributed.thd_attention (kept import-free: the config layer must not import torch.distributed)
THD_KERNELS = ("portable", "flash_attn", "te")
THD_CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _uses_thd(cfg: Any) -> bool:
    return cfg.distributed.cp_method == "thd" and cfg.distributed.cp_size > 1


def thd_batch_kwargs(cfg: Any) -> dict[str, Any]:
    """Keyword arguments bound to :func:`~automodel.distributed.thd_attention.make_thd_batch_and_ctx` ({} unless thd)."""
    if cfg.distributed.cp_method != "thd":
        return {}
    return {"kernel": cfg.distributed.thd_kernel, "cp_comm_type": cfg.distributed.thd_cp_comm_type}


def thd_dataset_kwargs(cfg: Any, node: Any) -> dict[str, Any]:
    """``{"seq_pad_multiple": 2*cp}`` (``2*cp*tp`` with sequence parallelism) for a packed dataset node under thd CP without its own value, else {}."""
    if (
        not _uses_thd(cfg)
        or node is None
        or node.get("pack") is not True
        or node.get("seq_pad_multiple") is not None
    ):
        return {}
    return {"seq_pad_multiple": _document_multiple(cfg)[0]}


def _document_multiple(cfg: Any) -> tuple[int, str]:
    """What every packed document is padded to under thd: ``2*cp_size`` (TE's partition), ``*tp_size``
    with sequence parallelism (each TP rank an equal share of the rank's tokens)."""
    from automodel.training.cp_dispatch import row_multiple

    d = cfg.distributed
    return row_multiple("thd", d.cp_size, d.tp_size, d.sequence_parallel)


def thd_config_problems(cfg: Any, cuda_available: bool | None) -> list[str]:
    """Problems of the thd keys (empty list: fine); each names the key, the value and the fix."""
    d, problems = cfg.distributed, []
    if d.thd_kernel not in THD_KERNELS:
        problems.append(f"distributed.thd_kernel={d.thd_kernel!r} is not one of {' | '.join(THD_KERNELS)}")
    if d.thd_cp_comm_type not in THD_CP_COMM_TYPES:
        problems.append(
            f"distributed.thd_cp_comm_type={d.thd_cp_comm_type!r} is not one of {' | '.join(THD_CP_COMM_TYPES)}"
        )
    if not _uses_thd(cfg):
        return problems
    on_cpu = cuda_available is False or d.backend == "gloo"
    if d.thd_kernel in ("flash_attn", "te"):
        package = "flash_attn" if d.thd_kernel == "flash_attn" else "transformer_engine"
        if on_cpu:
            problems.append(
                f"distributed.thd_kernel={d.thd_kernel} needs CUDA, but this run is on CPU; set "
                "distributed.thd_kernel=portable (exact on every device)"
            )
        elif importlib.util.find_spec(package) is None:
            problems.append(
                f"distributed.thd_kernel={d.thd_kernel} needs the {package!r} package, which is not installed; "
                "install it or set distributed.thd_kernel=portable"
            )
    multiple, what = _document_multiple(cfg)
    for key in ("dataset", "validation_dataset"):
        node = getattr(cfg.data, key)
        if node is None or node.get("pack") is not True:
            continue
        m = node.get("seq_pad_multiple")
        if isinstance(m, int) and m % multiple:
            problems.append(
                f"data.{key}.seq_pad_multiple={m} is not a multiple of {what}: "
                f"distributed.cp_method=thd splits every packed document into {multiple} equal chunks; "
                f"remove data.{key}.seq_pad_multiple (thd then pads to {multiple}) or set it to a multiple of {multiple}"
            )
    return problems
