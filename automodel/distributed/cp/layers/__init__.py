"""Per-layer-kind kernels every CP method uses (imports nothing: the config rules read
:mod:`.linear_support` without torch).

A CP method runs its own kernel for plain causal attention (torch's ring, thd's all-gather, Ulysses'
all-to-all). The layer kinds that kernel does not compute are routed here, per layer, from the layer's
:class:`~automodel.distributed.cp.profile.LayerSpec`:

- :mod:`.strategy`: the router: the kernel each layer gets, the MLA value padding and Llama 4's query
  temperature;
- :mod:`.masked_attention`: exact attention of the local queries over local + halo keys
  (:mod:`automodel.distributed.cp.exchange.halo`), with a sliding window, attention chunks, per-head
  sinks, logit softcapping and value heads of another size;
- :mod:`.linear_mixer`, :mod:`.gated_deltanet`: Gated DeltaNet under Ulysses (head shard), thd and ring
  (the state chain, :mod:`automodel.distributed.cp.exchange.state`);
- :mod:`.linear_support`: which linear mixers each method runs exactly (no torch import).

Which tokens each rank holds comes from :mod:`automodel.distributed.cp.layout`. docs/cp_layer_kinds.md
describes the exchange pattern.
"""
