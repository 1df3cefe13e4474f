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
- :mod:`.mixer_kernel`: the interface a linear / state-space mixer implements (project / core / finish) and
  the registry by class name; :mod:`.mixers` imports every kernel module (:mod:`.gated_deltanet`,
  :mod:`.mamba2`, ...);
- :mod:`.state_chain`: the shared kernels of every mixer: the per-document loop, the Ulysses head shard and
  the state chain (:mod:`automodel.distributed.cp.exchange.state`);
- :mod:`.linear_mixer`: the installed forward, dispatching per method (ulysses, thd, thd_docs, ring, usp);
- :mod:`.linear_support`: which linear mixers each method runs exactly (no torch import);
- :mod:`.sparse_attention`: DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5, dots3), queries local, the
  latent KV and the indexer keys all-gathered, top-k per document; :mod:`.sparse_support`: which DSA classes
  and methods it runs (no torch import).

Which tokens each rank holds comes from :mod:`automodel.distributed.cp.layout`. docs/cp_layer_kinds.md
describes the exchange pattern.
"""
