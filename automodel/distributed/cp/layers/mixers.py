"""Imports every module that registers a :class:`~automodel.distributed.cp.layers.mixer_kernel.MixerKernel`
(each registers its mixer classes on import). A new kernel module adds one line here and its class names
to :data:`automodel.distributed.cp.layers.linear_support.STATE_MIXERS`."""

from automodel.distributed.cp.layers import (  # noqa: F401
    cca,
    gated_deltanet,
    kimi_delta,
    lightning,
    mamba1,
    mamba2,
    rg_lru,
    rwkv,
    short_conv,
    xlstm,
)

__all__: list[str] = []
