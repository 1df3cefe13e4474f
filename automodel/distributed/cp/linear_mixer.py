"""Moved: :mod:`automodel.distributed.cp.layers.linear_mixer` (re-exports only)."""

from automodel.distributed.cp.layers.linear_mixer import (
    install_linear_mixers,
    linear_mixer_forward,
    uninstall_linear_mixers,
)

__all__ = ["install_linear_mixers", "linear_mixer_forward", "uninstall_linear_mixers"]
