"""Installs every sparse-attention CP kernel a model's profile needs: DSA's
(:mod:`~automodel.distributed.cp.layers.sparse_attention`: DeepSeek-V3.2, GLM-5, dots3, HY-V4) and DeepSeek-V4's
compressed attention (:mod:`~automodel.distributed.cp.layers.compressed_attention`). Every CP method and the cp_size 1
packed path call :func:`install_sparse_attention` here, so a method never needs to know which kernel a layer takes."""

from __future__ import annotations

from typing import Any

import torch

from automodel.distributed.cp.layers import compressed_attention, sparse_attention

__all__ = ["install_sparse_attention", "installed_on", "uninstall_sparse_attention"]


def install_sparse_attention(model: torch.nn.Module, profile: Any) -> int:
    """Give every ``sparse_attention`` layer of ``profile`` its CP kernel (mutates ``model``; idempotent). Returns how
    many attention modules carry one."""
    return sparse_attention.install_sparse_attention(model, profile) + (
        compressed_attention.install_compressed_attention(model, profile)
    )


def installed_on(model: torch.nn.Module) -> int:
    """How many attention modules of ``model`` carry a sparse-attention CP kernel."""
    return sparse_attention.installed_on(model) + compressed_attention.installed_compressed_on(model)


def uninstall_sparse_attention(model: torch.nn.Module) -> None:
    """Undo :func:`install_sparse_attention` (mutates ``model``)."""
    compressed_attention.uninstall_compressed_attention(model)
    sparse_attention.uninstall_sparse_attention(model)
