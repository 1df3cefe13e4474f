"""Per-layer-kind attention kernels shared by the CP methods (ring, thd, Ulysses).

A CP method runs its own kernel for plain causal attention (torch's ring, thd's all-gather, Ulysses'
all-to-all). The layer kinds that kernel does not compute are routed here, per layer, from the layer's
:class:`~automodel.distributed.cp.profile.LayerSpec` (:mod:`.strategy`):

- :mod:`.token_layout`: which global tokens every CP rank holds (ring's head-tail split of a row, thd's
  partition of every packed document);
- :mod:`.halo`: the halo exchange, i.e. only the K/V tokens a rank's queries reach and it does not
  hold, sent by their owners (``all_to_all_single`` with per-rank splits); the backward returns the
  halo's dK/dV to their owners;
- :mod:`.masked_attention`: exact attention of the local queries over local + halo keys, with a sliding
  window, attention chunks, per-head sinks, logit softcapping and value heads of another size;
- :mod:`.strategy`: the kernel each layer gets, the MLA value padding and Llama 4's query temperature.

docs/cp_layer_kinds.md describes the exchange pattern.
"""
