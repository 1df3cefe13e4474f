"""Moved: the per-layer-kind kernels live in :mod:`automodel.distributed.cp.layers`, the token layout in
:mod:`automodel.distributed.cp.layout`, the halo exchange in :mod:`automodel.distributed.cp.exchange.halo`
and ring's router in :mod:`automodel.distributed.cp.ring.router`. The modules of this package re-export
them under their old paths."""
