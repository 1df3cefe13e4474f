"""Tensor parallelism (DTensor) for stock Hugging Face decoder LMs, with loss parallel and sequence parallel.

One module owns the plans. :func:`tp_plan` starts from transformers' own per-architecture plan
(``config.base_model_tp_plan``: column-parallel ``q/k/v/gate/up``, row-parallel ``o/down``, and for
Qwen3 ``replicated_with_grad_allreduce`` on the per-head ``q_norm``/``k_norm``) and goes further where
the training recipe needs it:

- **Embedding**: vocabulary-sharded (``RowwiseParallel`` on ``embed_tokens``: each rank looks up the
  ids of its vocabulary slice, the partial results are all-reduced). transformers leaves it replicated.
- **LM head**: with ``loss_parallel`` the head is column-parallel and returns the logits as a
  ``DTensor`` sharded on the vocabulary (``Shard(-1)``, never gathered); the cross-entropy then runs
  under ``torch.distributed.tensor.parallel.loss_parallel()``, so no rank holds the ``[tokens, vocab]``
  logits. Without it the sharded head gathers its output (transformers' ``colwise_gather_output``).
  Tied embeddings (``tie_word_embeddings``) keep one weight: the embedding and the head both shard it
  on the vocabulary dim (``Shard(0)``).
- **Per-head norms** (Qwen3 ``q_norm``/``k_norm``): their input holds this rank's heads only, so the
  weight gradient is partial over TP; the weight becomes a replicated ``DTensor`` whose input is marked
  ``Shard(2)`` (heads), and the gradient is all-reduced over TP (by FSDP2 when it redistributes the
  gradient to the weight's placement, or by DTensor's autograd without FSDP2).
- **Sequence parallel** (``sequence_parallel=True``): the RMSNorms and the residual stream between
  blocks hold ``1/tp`` of this rank's tokens (``Shard(1)``); each attention / MLP block all-gathers its
  input, row-parallel layers reduce-scatter their output. The rank's sequence (``S/cp`` under CP) must
  then be divisible by ``tp`` (:func:`automodel.distributed.sp.padding.get_padding_multiple`).

Attention heads (and KV heads) are split over TP by the column-parallel ``q/k/v`` projections; the HF
attention code infers the local head count from the projection's output (``view(..., -1, head_dim)``),
so the attention kernel, and every CP method around it (ring: sequence over CP; Ulysses: local heads
split again over CP), runs unchanged on ``H/tp`` heads.

Parameters that no plan entry names (RMSNorm weights without sequence parallel) stay plain tensors:
their input and gradient are identical on every TP rank, so each rank computes the full gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "TP_MODEL_TYPES",
    "ReplicatedWithGradAllReduce",
    "apply_tensor_parallel",
    "tp_config_problems",
    "tp_size_problems",
    "tp_plan",
]

#: ``model_type`` values whose decoder layout the plans below are written for (and tested on).
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# transformers' plan vocabulary that this module maps to torch parallel styles
_HF_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


# the config sizes TP splits, and why each must divide by tp_size
_TP_SPLIT_SIZES = {
    "num_attention_heads": "each TP rank computes num_attention_heads / tp_size query heads",
    "num_key_value_heads": "each TP rank holds num_key_value_heads / tp_size key/value heads",
    "intermediate_size": "the MLP is split column/row-wise",
    "vocab_size": "the embedding and the LM head are split on the vocabulary",
}


def tp_size_problems(sizes: dict[str, Any], tp_size: int, *, key_prefix: str = "model.config") -> list[str]:
    """Which of ``sizes`` (config key -> value; missing or non-int values skipped) ``tp_size`` does not divide."""
    problems = []
    for name, why in _TP_SPLIT_SIZES.items():
        value = sizes.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1 and value % tp_size:
            problems.append(
                f"{key_prefix}.{name}={value} is not divisible by distributed.tp_size={tp_size} ({why}); "
                f"set distributed.tp_size to a divisor of {value} ({_divisors(value)[:8]}), or to 1"
            )
    return problems


def tp_config_problems(
    config: Any,
    tp_size: int,
    *,
    sequence_parallel: bool = False,
    key_prefix: str = "model.config",
) -> list[str]:
    """Why a model with this (transformers) ``config`` cannot be tensor-parallel over ``tp_size`` ranks.

    ``config`` may also be the model's :class:`~automodel.distributed.cp.profile.ModelProfile` (what is
    read: its text model type and sizes). Checked before any weight is loaded: the architecture is one of :data:`TP_MODEL_TYPES`; the
    attention heads, KV heads, MLP width and vocabulary are divisible by ``tp_size`` (the column- and
    row-parallel layers and the vocabulary-sharded embedding/LM head split them evenly). Returns an
    empty list at ``tp_size <= 1``. Each message names the value, the rule and the fix.
    ``sequence_parallel`` is accepted for symmetry with :func:`apply_tensor_parallel`; it needs nothing
    of the config (the collator pads the rows so that the tokens split over TP).
    """
    if tp_size <= 1:
        return []
    from automodel.distributed.cp.profile import ModelProfile, profile_model

    profile = config if isinstance(config, ModelProfile) else profile_model(config)
    model_type = profile.text_model_type
    if model_type not in TP_MODEL_TYPES:
        return [
            f"distributed.tp_size={tp_size}: tensor parallelism supports model_type in {list(TP_MODEL_TYPES)} "
            f"(their layer layout is what the TP plan shards), got {model_type!r}; set distributed.tp_size=1 "
            f"and use distributed.dp_shard / cp_size for the other ranks"
        ]
    sizes = {name: getattr(profile, name) for name in _TP_SPLIT_SIZES}  # kv heads default to the heads
    problems = tp_size_problems(sizes, tp_size, key_prefix=key_prefix)
    # sequence_parallel adds no constraint on the config: the row length is padded for it (row_multiple)
    return problems


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A TP style for a module whose parameters are replicated but whose input is sharded on ``input_dim``.

    transformers' ``replicated_with_grad_allreduce`` (Qwen3's per-head ``q_norm``/``k_norm``): each
    rank applies the module to its own heads, so the parameter gradient is a partial sum that must be
    all-reduced over TP. The parameters become ``Replicate()`` DTensors, the input is wrapped as a
    ``Shard(input_dim)`` DTensor and the output handed back as this rank's local tensor; DTensor's
    autograd then produces the partial gradient and reduces it to the parameter's placement.
    """

    def __init__(self, input_dim: int = 2) -> None:
        super().__init__()
        self.input_dim = input_dim

    def __repr__(self) -> str:
        return f"ReplicatedWithGradAllReduce(input_dim={self.input_dim})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

        dim = self.input_dim

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), param.requires_grad)
                )

        def input_fn(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(
                DTensor.from_local(x, mesh, [Shard(dim)], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def output_fn(mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, partition, input_fn, output_fn)


def _decoder_prefix(model: nn.Module) -> str:
    """``"model."``: where the decoder (``embed_tokens``, ``layers``, ``norm``) sits in the causal LM."""
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "embed_tokens"):
        raise ValueError(
            f"{type(model).__name__} has no decoder at .{prefix} with .embed_tokens and .layers; tensor "
            f"parallelism supports causal LMs of model_type {list(TP_MODEL_TYPES)}"
        )
    return prefix + "."


def tp_plan(model: nn.Module, *, loss_parallel: bool, sequence_parallel: bool = False) -> dict[str, Any]:
    """The ``parallelize_module`` plan for ``model``: fully-qualified module pattern -> torch ``ParallelStyle``.

    Built from ``model.config.base_model_tp_plan`` (transformers' plan: ``colwise``, ``rowwise``,
    ``replicated_with_grad_allreduce``; the ``embed_tokens: embedding_rowwise`` entry that transformers 5.17
    (not 5.25) adds for tied embeddings is the vocabulary-sharded embedding this plan makes anyway) plus the
    embedding, the final norm and the LM head (see the module docstring). With ``sequence_parallel`` every
    RMSNorm is ``SequenceParallel``, each attention and MLP block all-gathers its ``Shard(1)`` input once
    (``PrepareModuleInput``) for its column-parallel projections, and the row-parallel ones return
    ``Shard(1)`` (reduce-scatter).

    Raises:
        ValueError: the config has no TP plan, or names a style this module does not map.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from automodel.distributed.cp.guard import cached_profile

    profile = cached_profile(model)
    hf_plan = dict(profile.base_model_tp_plan)
    if not hf_plan:
        raise ValueError(
            f"{type(model).__name__} ({profile.text_model_type}) has no base_model_tp_plan in its config; "
            f"tensor parallelism supports model_type in {list(TP_MODEL_TYPES)}"
        )
    prefix = _decoder_prefix(model)
    seq = Shard(1)
    plan: dict[str, Any] = {}
    for pattern, kind in hf_plan.items():
        if kind == "embedding_rowwise" and pattern == "embed_tokens":
            continue  # transformers 5.17 (not 5.25) adds it for tied embeddings: the vocabulary-sharded embedding below
        if kind not in _HF_STYLES:
            raise ValueError(
                f"transformers' TP plan of {type(model).__name__} uses {kind!r} for {pattern!r}, which this recipe "
                f"does not map (it maps {list(_HF_STYLES)}); set distributed.tp_size=1"
            )
        if kind == "colwise":
            style = ColwiseParallel()  # under sequence parallel its block's input is gathered once, below
        elif kind == "rowwise":
            style = (
                RowwiseParallel(output_layouts=seq, use_local_output=False)
                if sequence_parallel
                else RowwiseParallel()
            )
        else:
            style = ReplicatedWithGradAllReduce(input_dim=2)
        plan[prefix + pattern] = style
    # with sequence parallel the residual stream stays a Shard(1) DTensor between blocks, so that the
    # model code sees the rank's whole sequence length in .shape (positions, masks, head reshapes)
    plan[prefix + "embed_tokens"] = RowwiseParallel(
        input_layouts=Replicate(),
        output_layouts=seq if sequence_parallel else Replicate(),
        use_local_output=not sequence_parallel,
    )
    if sequence_parallel:
        # all-gather the sequence once per block (not once per projection: q, k and v, gate and up would
        # each gather and save their own [N, h] copy for the weight gradient)
        plan[prefix + "layers.*.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
        plan[prefix + "layers.*.mlp"] = PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan[prefix + "layers.*.input_layernorm"] = SequenceParallel()
        plan[prefix + "layers.*.post_attention_layernorm"] = SequenceParallel()
        plan[prefix + "norm"] = SequenceParallel()
    head_input = seq if sequence_parallel else Replicate()
    if loss_parallel:
        plan["lm_head"] = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1), use_local_output=False)
    else:
        plan["lm_head"] = ColwiseParallel(input_layouts=head_input, output_layouts=Replicate())
    return plan


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` with :func:`tp_plan`; returns ``model``.

    Call on the built model (identical on every rank, e.g. from one seed), after any attention switch
    of the CP method and before activation checkpointing and FSDP2. Mutates ``model``: the planned
    parameters become ``DTensor`` s on ``tp_mesh`` (``Shard(0)`` for column-parallel weights and the
    vocabulary, ``Shard(1)`` for row-parallel weights), and forward hooks redistribute activations.
    With tied embeddings the LM head is re-tied to the sharded embedding weight.

    After this, with ``loss_parallel`` the model's ``logits`` are a ``[B, S, V]`` DTensor with local
    shape ``[B, S, V / tp]``: compute the loss under ``loss_parallel()``.

    Raises:
        ValueError: ``tp_mesh`` is not 1-D, or the model is not a supported architecture.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tp mesh, got {tp_mesh.ndim}-D {tp_mesh}")
    from automodel.distributed.cp.guard import cached_profile

    profile = cached_profile(model)
    problems = tp_config_problems(profile, tp_mesh.size(), sequence_parallel=sequence_parallel)
    if problems:
        raise ValueError("; ".join(problems))
    tied = profile.tie_word_embeddings and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    plan = tp_plan(model, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel)
    if tied:  # one parameter, sharded once (by the embedding); the head re-uses it below
        head_style = plan.pop("lm_head")
        parallelize_module(model, tp_mesh, plan)
        head = model.get_output_embeddings()
        shared = model.get_input_embeddings().weight
        del head.weight  # so that the style does not distribute it a second time
        head.register_parameter("weight", None)
        parallelize_module(head, tp_mesh, head_style)
        head.weight = shared
    else:
        parallelize_module(model, tp_mesh, plan)
    return model
