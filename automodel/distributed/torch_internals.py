"""Every private torch API that automodel uses, resolved in one place, per torch version (and the
private transformers internals it uses, at the end).

automodel is tested with torch 2.11.0, 2.12.1, 2.13.0, 2.14.1 and 2.15.0 (``pyproject.toml``:
``torch>=2.11,<2.16``; ``scripts/compat.sh VERSION`` runs the parity subset on any of them). torch's context-parallel
internals are private and move between releases, so no other module imports them: each one is
resolved here by feature detection, and a missing one is a ``RuntimeError`` naming the torch
version, the symbol and the fix (:func:`require`), never an ``AttributeError`` deep in a run.
``python -m automodel.distributed.torch_internals`` prints what resolves on the installed torch and
transformers (exit status 1 if anything is missing; ``tests/test_torch_internals.py`` asserts the same).

What moved (checked by reading and running each release; CUDA paths import-checked only):

- **2.11 -> 2.12 -> 2.13**: no private symbol automodel uses moved or changed its signature (2.11 and
  2.12 resolve exactly as 2.13: ``_op_strategy_context``). One behaviour did: torch's
  ``context_parallel`` context manager before 2.13 has no ``try/finally``, so an exception raised
  inside the ``with`` block left SDPA patched, the CP DTensor dispatcher on and the buffers sharded,
  i.e. every later attention call of the process would have run as CP. :func:`context_parallel`
  (what automodel enters) restores both on such an exception there, as 2.13+ does itself.
- **2.13 -> 2.14**: ``_context_parallel._sharding_rules._op_strategy_context`` (register an
  *op strategy*: ``register_op_strategy`` + ``expand_to_full_mesh_op_strategy`` over ``OpStrategy``
  args) is gone; its successor ``_single_dim_strategy_context`` registers a *single-dim strategy*
  (``register_single_dim_strategy``: placements over one mesh dim, ``_ShardingPlaceholder`` for a
  shard, ``TensorMeta`` args, the all-``Replicate`` rule implied). :func:`seq_shard_strategy_context`
  hides the difference; the placements it registers are the same on every version. torch's ring
  itself changed only inside (``max_q``/``max_k`` per step for the CUDA flash kernel, an assertion),
  not in the signatures automodel calls.
- **2.14 -> 2.15**: nothing automodel uses changed (``BLOCK_SIZE`` plumbing of the flex-attention
  CP path, which automodel does not use).

The private torch symbols, and where automodel uses them:

- ``torch.distributed.tensor.experimental._context_parallel._attention``:
  ``_templated_ring_attention`` and ``_templated_ring_attention_backward`` (the ring math),
  ``custom_ops`` (the CP dispatcher's handler table), ``_create_rotater`` (patched: synchronous
  rotation) — cpu_ring; ``_cp_options`` (``convert_to_f32``, ``rotate_method``) — cpu_ring,
  ring/batch; ``set_rotate_method`` — ring/batch; ``context_parallel_unshard`` — tests;
  ``_disable_context_parallel_dispatcher_impl`` (torch < 2.13 only) — :func:`context_parallel`;
- ``..._context_parallel._sharding_rules``: ``_op_strategy_context`` (2.11 .. 2.13) or
  ``_single_dim_strategy_context`` (2.14+) — cpu_ring;
- ``torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy`` and
  ``torch.distributed.tensor._op_schema.OpStrategy`` (2.11 .. 2.13), ``torch.distributed.tensor._ops
  .single_dim_strategy._ShardingPlaceholder`` and ``torch.distributed.tensor._dtensor_spec.TensorMeta``
  (2.14+), ``torch.distributed.tensor._op_schema.RuntimeSchemaInfo`` (all) — cpu_ring;
- ``DTensor._op_dispatcher`` (``unwrap_to_op_info``, ``sharding_propagator.propagate``, ``wrap``)
  — cpu_ring;
- ``DeviceMesh._flatten``, ``._get_root_mesh``, ``._flatten_mapping``, ``._concatenate`` — mesh;
- ``torch._dynamo.compiled_autograd._enable`` / ``._disable`` — compiled_autograd;
  ``torch._dynamo.utils.counters`` — compiled_autograd, training/compile_stats;
  ``torch._dynamo.utils.calculate_time_spent`` — training/compile_stats;
- ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` — cpu_ring
  (through :func:`cpu_flash_attention_ops`) and thd_attention (directly).
- ``torch.distributed._functional_collectives.AsyncCollectiveTensor`` (``.wait()``) —
  training/activation_offload (:func:`wait_async_collective`: a tensor TP's redistribution left pending).

A public torch API that is new in 2.13 is here too: ``torch.distributed.all_gather_single``, called
``all_gather_into_tensor`` before (:data:`all_gather_single`: sp/, multimodal/; cp/exchange/gather.py
picks the name itself).

Not moved here (documented aliases of public APIs, same on 2.11 .. 2.15): ``torch._dynamo.disable``
(= ``torch.compiler.disable``; models/compile.py, compiled_autograd.py) and ``torch._dynamo.reset``
(= ``torch.compiler.reset``; training/trainer.py). cp/blocks.py and cp/ring/cpu_ring.py call the ``aten`` CPU
flash ops directly (op names, checked by :func:`missing_torch_internals`). ``torch.compile``,
``torch.distributed.tensor.experimental.context_parallel``, ``torch.distributed.tensor.parallel`` and
``DTensor`` itself are public.

The private *transformers* internals automodel uses (tested with transformers 5.17.0 and 5.24.0) are
lazy attributes of this module too (``from automodel.distributed.torch_internals import and_masks``
inside a function imports transformers then; a missing one is an ``ImportError`` naming the
transformers version and the symbol). Each is looked up afresh on every import, so a patched module
global is seen patched:

- ``transformers.masking_utils``: ``find_packed_sequence_indices`` (cp/ulysses/attention.py; also
  replaced, as a module global, by cp/ring/causal_mask.py, which imports the module itself
  and is a no-op where transformers has no such function), ``ALL_MASK_ATTENTION_FUNCTIONS`` (and its
  private ``_global_mapping``; cp/hf_attention.py, cp/ring/router.py), ``and_masks``,
  ``causal_mask_function``, ``bidirectional_mask_function``, ``sliding_window_overlay``
  (cp/ulysses/attention.py);
- ``transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS`` (cp/ulysses/attention.py, cp/ring/router.py, models/compile.py, which
  also replaces entries in it);
- ``transformers.models.auto.modeling_auto``: ``MODEL_FOR_CAUSAL_LM_MAPPING`` (models/loader.py),
  ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING`` (models/vlm_cp.py);
- ``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil``
  (data/vlm_dataset.py).

One transformers behaviour changed inside the tested range: in rows packed transformers-style
(restarting ``position_ids``, no mask) 5.23+ cuts Llama 4's attention chunks at multiples of the chunk
in each document's ``position_ids``, 5.17 .. 5.22 at multiples of the chunk from the row start
(:func:`transformers_chunks_per_document`; Ulysses, the one method that takes that batch form, builds
the same mask as the installed transformers).

Not movable by an import line: ``config._attn_implementation``, read or written in cp/hf_attention.py,
cp/bind.py, cp/guard.py, models/compile.py, models/vlm_tiny.py, training/self_check.py and
training/trainer.py; and cp/ring/causal_mask.py's patch of ``masking_utils.find_packed_sequence_indices``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "TESTED_TORCH_VERSIONS",
    "TESTED_TRANSFORMERS_VERSIONS",
    "TORCH_REQUIREMENT",
    "TRANSFORMERS_REQUIREMENT",
    "all_gather_single",
    "compiled_autograd_disable",
    "compiled_autograd_enable",
    "concatenate_meshes",
    "context_parallel",
    "context_parallel_unshard",
    "cp_attention_module",
    "cp_options",
    "cpu_flash_attention_ops",
    "doge_skips_causal_mask",
    "dtensor_op_dispatcher",
    "dynamo_calculate_time_spent",
    "dynamo_counters",
    "flatten_mesh",
    "mesh_flattened_views",
    "missing_torch_internals",
    "missing_transformers_internals",
    "require",
    "seq_shard_strategy_context",
    "sdpa_problem",
    "set_rotate_method",
    "sharding_rule_api",
    "templated_ring_attention",
    "templated_ring_attention_backward",
    "torch_release",
    "transformers_chunks_per_document",
    "wait_async_collective",
]

#: The torch releases the parity subset passes on (``scripts/compat.sh``).
TESTED_TORCH_VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
#: The range ``pyproject.toml`` allows.
TORCH_REQUIREMENT = "torch>=2.11,<2.16"
#: The transformers releases the parity subset passes on (``scripts/compat.sh``, ``COMPAT_TRANSFORMERS``).
TESTED_TRANSFORMERS_VERSIONS = ("5.17.0", "5.24.0")
#: The range ``pyproject.toml`` allows.
TRANSFORMERS_REQUIREMENT = "transformers>=5.17,<6"


#: ``torch.distributed.all_gather_single(output, input, group=None, async_op=False)`` (torch 2.13+),
#: the same collective as ``all_gather_into_tensor``, its name before 2.13 (deprecated from 2.13 on).
all_gather_single: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def torch_release() -> tuple[int, int]:
    """``(major, minor)`` of the installed torch (``2.11.0+cu130`` -> ``(2, 11)``)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


CP_ATTENTION = "torch.distributed.tensor.experimental._context_parallel._attention"
CP_SHARDING_RULES = "torch.distributed.tensor.experimental._context_parallel._sharding_rules"
_OPS_UTILS = "torch.distributed.tensor._ops.utils"
_SINGLE_DIM = "torch.distributed.tensor._ops.single_dim_strategy"
_OP_SCHEMA = "torch.distributed.tensor._op_schema"
_DTENSOR_SPEC = "torch.distributed.tensor._dtensor_spec"

#: Symbols the CPU ring needs on every version, as ``module:attribute``.
_RING_COMMON = (
    f"{CP_ATTENTION}:_templated_ring_attention",
    f"{CP_ATTENTION}:_templated_ring_attention_backward",
    f"{CP_ATTENTION}:_cp_options",
    f"{CP_ATTENTION}:custom_ops",
    f"{CP_ATTENTION}:_create_rotater",
    f"{_OP_SCHEMA}:RuntimeSchemaInfo",
    "torch.distributed.tensor:DTensor._op_dispatcher",
)
#: The two ways torch has had of installing a temporary DTensor sharding rule (newest first).
_SHARDING_RULE_APIS = {
    "single_dim": (  # torch 2.14, 2.15
        f"{CP_SHARDING_RULES}:_single_dim_strategy_context",
        f"{_SINGLE_DIM}:_ShardingPlaceholder",
        f"{_DTENSOR_SPEC}:TensorMeta",
    ),
    "op_strategy": (  # torch 2.11, 2.12, 2.13
        f"{CP_SHARDING_RULES}:_op_strategy_context",
        f"{_OPS_UTILS}:expand_to_full_mesh_op_strategy",
        f"{_OP_SCHEMA}:OpStrategy",
    ),
}
_CPU_FLASH_OPS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")
#: Feature -> symbols it needs on every version (the CPU ring's sharding rule is checked separately).
_FEATURES = {
    "ring context parallelism on CPU": _RING_COMMON,
    "ring context parallelism": (
        "torch.distributed.tensor.experimental:context_parallel",
        f"{CP_ATTENTION}:_cp_options",
        f"{CP_ATTENTION}:set_rotate_method",
        f"{CP_ATTENTION}:context_parallel_unshard",
        # before 2.13, context_parallel() undoes its patch on an exception only through this
        *((f"{CP_ATTENTION}:_disable_context_parallel_dispatcher_impl",) if torch_release() < (2, 13) else ()),
    ),
    "the device mesh's flattened views": (
        "torch.distributed.device_mesh:DeviceMesh._flatten",
        "torch.distributed.device_mesh:DeviceMesh._concatenate",
    ),
    "compiled autograd": (
        "torch._dynamo.compiled_autograd:_enable",
        "torch._dynamo.compiled_autograd:_disable",
        "torch._dynamo.utils:counters",
        "torch._dynamo.utils:calculate_time_spent",
    ),
}
_FIXES = {
    "ring context parallelism on CPU": "run CP on CUDA, or use distributed.cp_method=ulysses",
    "ring context parallelism": "use distributed.cp_method=ulysses or thd",
    "compiled autograd": "set distributed.enable_compiled_autograd=false",
}


def _lookup(spec: str) -> Any:
    """The object named ``module:attr[.attr]``; ``AttributeError`` / ``ImportError`` if it is missing."""
    module_name, _, path = spec.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _has(spec: str) -> bool:
    try:
        _lookup(spec)
    except (ImportError, AttributeError):
        return False
    return True


def _dotted(spec: str) -> str:
    return spec.replace(":", ".")


def _cpu_flash_missing() -> list[str]:
    return [f"torch.ops.aten.{op}" for op in _CPU_FLASH_OPS if not hasattr(torch.ops.aten, op)]


def sharding_rule_api() -> str | None:
    """``"single_dim"`` (torch 2.14+), ``"op_strategy"`` (torch 2.11 .. 2.13) or ``None`` (neither complete)."""
    for name, specs in _SHARDING_RULE_APIS.items():
        if all(_has(s) for s in specs):
            return name
    return None


def missing_torch_internals(feature: str | None = None) -> list[str]:
    """The private torch symbols ``feature`` needs that this torch lacks (all features when ``None``)."""
    features = [feature] if feature is not None else list(_FEATURES)
    missing: list[str] = []
    for name in features:
        missing += [_dotted(s) for s in _FEATURES[name] if not _has(s) and _dotted(s) not in missing]
        if name == "ring context parallelism on CPU":
            if sharding_rule_api() is None:
                missing.append(
                    " or ".join(
                        f"{', '.join(_dotted(s) for s in specs if not _has(s))} ({version})"
                        for specs, version in zip(_SHARDING_RULE_APIS.values(), ("torch 2.14+", "torch 2.11 .. 2.13"))
                    )
                )
            missing += _cpu_flash_missing()
    return missing


def _error(feature: str, missing: list[str], fix: str | None) -> RuntimeError:
    fix = fix or _FIXES.get(feature, "")
    return RuntimeError(
        f"{feature} needs private torch APIs that torch {torch.__version__} does not have: "
        f"{', '.join(missing)}. automodel is tested with torch {', '.join(TESTED_TORCH_VERSIONS)} "
        f"({TORCH_REQUIREMENT}); install one of them (e.g. pip install torch==2.13.0)"
        + (f", or {fix}" if fix else "")
    )


def require(feature: str, fix: str | None = None) -> None:
    """Raise ``RuntimeError`` naming the torch version, the missing symbols and the fix, if any is missing."""
    missing = missing_torch_internals(feature)
    if missing:
        raise _error(feature, missing, fix)


def _resolve(spec: str, feature: str) -> Any:
    try:
        return _lookup(spec)
    except (ImportError, AttributeError):
        raise _error(feature, [_dotted(spec)], None) from None


# ---------------------------------------------------------------------------------------------
# torch's ring attention (experimental context parallelism)
# ---------------------------------------------------------------------------------------------
def cp_attention_module() -> Any:
    """torch's CP attention module (``custom_ops`` and ``_create_rotater`` are looked up on it at call time)."""
    return importlib.import_module(CP_ATTENTION)


def templated_ring_attention() -> Callable[..., Any]:
    """torch's ``_templated_ring_attention(group, seq_dim, op, query=, key=, value=, is_causal=, **kwargs)``."""
    return _resolve(f"{CP_ATTENTION}:_templated_ring_attention", "ring context parallelism on CPU")


def templated_ring_attention_backward() -> Callable[..., Any]:
    """torch's ``_templated_ring_attention_backward(group, seq_dim, op, grad_out=, grad_out_name=, ...)``."""
    return _resolve(f"{CP_ATTENTION}:_templated_ring_attention_backward", "ring context parallelism on CPU")


def cp_options() -> Any:
    """torch's ``_cp_options`` (``convert_to_f32``, ``enable_load_balance``, ``rotate_method``); mutable."""
    return _resolve(f"{CP_ATTENTION}:_cp_options", "ring context parallelism")


def set_rotate_method(method: str) -> None:
    """torch's ``set_rotate_method`` (``"allgather"`` or ``"alltoall"``)."""
    _resolve(f"{CP_ATTENTION}:set_rotate_method", "ring context parallelism")(method)


def context_parallel(
    mesh: Any,
    *,
    buffers: list[torch.Tensor],
    buffer_seq_dims: list[int],
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> contextlib.AbstractContextManager:
    """torch's ``context_parallel(mesh, buffers=, buffer_seq_dims=, no_restore_buffers=)``: inside the
    block SDPA runs as ring attention and ``buffers`` are replaced in place by this rank's head-tail
    shards; on exit SDPA is restored and the buffers not in ``no_restore_buffers`` are restored.

    torch 2.13+ does the restoring in a ``finally``. torch 2.11 and 2.12 do it only on a normal exit,
    so an exception raised in the block would leave SDPA patched (every later attention call of the
    process running as CP) and the buffers sharded; there this wrapper does the same restoring before
    the exception propagates (it keeps its own copy of the restored buffers: one extra clone).
    """
    cp = _resolve("torch.distributed.tensor.experimental:context_parallel", "ring context parallelism")
    kwargs = dict(buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers)
    if torch_release() >= (2, 13):
        return cp(mesh, **kwargs)
    disable = _resolve(f"{CP_ATTENTION}:_disable_context_parallel_dispatcher_impl", "ring context parallelism")
    return _restoring_context_parallel(cp, disable, mesh, **kwargs)


@contextlib.contextmanager
def _restoring_context_parallel(
    cp: Callable[..., Any],
    disable: Callable[[], None],
    mesh: Any,
    *,
    buffers: list[torch.Tensor],
    buffer_seq_dims: list[int],
    no_restore_buffers: set[torch.Tensor] | None,
) -> Any:
    skip = no_restore_buffers or set()
    originals = [None if b in skip else b.clone() for b in buffers]
    with cp(mesh, buffers=buffers, buffer_seq_dims=buffer_seq_dims, no_restore_buffers=no_restore_buffers):
        try:
            yield
        except BaseException:
            # torch < 2.13's generator re-raises at its `yield` without undoing anything: undo it here
            disable()
            for buffer, original in zip(buffers, originals):
                if original is not None:
                    buffer.resize_(original.shape)
                    buffer.copy_(original)
            raise


def context_parallel_unshard(mesh: Any, buffers: list[torch.Tensor], seq_dims: list[int]) -> list[torch.Tensor]:
    """torch's ``context_parallel_unshard``: the full tensors back from head-tail sequence shards."""
    return _resolve(f"{CP_ATTENTION}:context_parallel_unshard", "ring context parallelism")(mesh, buffers, seq_dims)


def wait_async_collective(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or the plain tensor it stands for when it is an ``AsyncCollectiveTensor`` (a functional
    collective's pending result, e.g. the local shard of a DTensor that TP's sequence-parallel redistribution
    made): waited for. Without the class (another torch), ``tensor``."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:
        return tensor
    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def cpu_flash_attention_ops() -> tuple[Any, Any]:
    """``(aten._scaled_dot_product_flash_attention_for_cpu, ..._backward)`` (``OpOverloadPacket`` s)."""
    missing = _cpu_flash_missing()
    if missing:
        raise _error("ring context parallelism on CPU", missing, None)
    return tuple(getattr(torch.ops.aten, op) for op in _CPU_FLASH_OPS)  # type: ignore[return-value]


def dtensor_op_dispatcher() -> Any:
    """``DTensor._op_dispatcher`` (``unwrap_to_op_info``, ``sharding_propagator.propagate``, ``wrap``)."""
    return _resolve("torch.distributed.tensor:DTensor._op_dispatcher", "ring context parallelism on CPU")


def seq_shard_strategy_context(
    op: Any,
    *,
    seq_dim: int,
    num_outputs: int,
    num_tensor_inputs: int,
    static_argnum: int,
    arity_error: Callable[[], Exception],
    validate_mesh: bool = True,
) -> contextlib.AbstractContextManager:
    """Install, for the ``with`` block, a DTensor sharding rule for ``op``: every tensor (its
    ``num_outputs`` outputs, then its tensor inputs) is ``Replicate()``, or every one is
    ``Shard(seq_dim)`` — on each mesh dim. A call with a number of tensor inputs other than
    ``num_tensor_inputs`` raises ``arity_error()`` during sharding propagation. ``static_argnum``:
    the first positional argument that is part of the sharding cache key (``RuntimeSchemaInfo``).

    torch 2.11 .. 2.13 register this as an op strategy (``_op_strategy_context``), torch 2.14+ as a
    single-dim strategy (``_single_dim_strategy_context``; the all-Replicate rule is implied there);
    the placements are the same. Restores whatever rule ``op`` had on exit.
    """
    feature = "ring context parallelism on CPU"
    api = sharding_rule_api()
    if api is None:
        require(feature)
    schema_info = _resolve(f"{_OP_SCHEMA}:RuntimeSchemaInfo", feature)(static_argnum)

    if api == "single_dim":
        placeholder = _lookup(f"{_SINGLE_DIM}:_ShardingPlaceholder")
        tensor_meta = _lookup(f"{_DTENSOR_SPEC}:TensorMeta")

        def single_dim_strategy(op_overload: Any, args_schema: Any, kwargs_schema: Any) -> list[list[Any]]:
            args = (*args_schema, *kwargs_schema.values())
            if sum(isinstance(a, tensor_meta) for a in args) != num_tensor_inputs:
                raise arity_error()
            return [[placeholder(seq_dim)] * (num_outputs + num_tensor_inputs)]

        return _lookup(f"{CP_SHARDING_RULES}:_single_dim_strategy_context")(op, single_dim_strategy, schema_info)

    from torch.distributed.tensor import Replicate, Shard

    op_strategy = _lookup(f"{_OP_SCHEMA}:OpStrategy")
    expand = _lookup(f"{_OPS_UTILS}:expand_to_full_mesh_op_strategy")

    def strategy(op_schema: Any) -> Any:
        args = (*op_schema.args_schema, *op_schema.kwargs_schema.values())
        if sum(isinstance(a, op_strategy) for a in args) != num_tensor_inputs:
            raise arity_error()
        mesh = op_schema.get_mesh_from_args(validate=validate_mesh)
        n = num_outputs + num_tensor_inputs
        return expand(mesh, op_schema, [[Replicate()] * n, [Shard(seq_dim)] * n], input_index=num_outputs)

    return _lookup(f"{CP_SHARDING_RULES}:_op_strategy_context")(op, strategy, schema_info)


# ---------------------------------------------------------------------------------------------
# DeviceMesh: flattened views
# ---------------------------------------------------------------------------------------------
def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh._flatten(mesh_dim_name=name)``: a 1-D view of ``mesh`` reachable from its root as ``name``."""
    return _resolve("torch.distributed.device_mesh:DeviceMesh._flatten", "the device mesh's flattened views")(
        mesh, mesh_dim_name=name
    )


def mesh_flattened_views(mesh: Any) -> dict[str, Any]:
    """The flattened views of ``mesh``'s root mesh (``{}`` if this torch keeps none)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return dict(getattr(root, "_flatten_mapping", {}))


def concatenate_meshes(parts: list[Any]) -> Any:
    """``DeviceMesh._concatenate(parts)``: one mesh over the dims of ``parts`` (sub-meshes of one root)."""
    return _resolve("torch.distributed.device_mesh:DeviceMesh._concatenate", "the device mesh's flattened views")(
        parts
    )


# ---------------------------------------------------------------------------------------------
# dynamo: compiled autograd and counters
# ---------------------------------------------------------------------------------------------
def compiled_autograd_enable(compiler_fn: Callable[..., Any], *, dynamic: bool) -> contextlib.AbstractContextManager:
    """``torch._dynamo.compiled_autograd._enable(compiler_fn, dynamic=...)``."""
    return _resolve("torch._dynamo.compiled_autograd:_enable", "compiled autograd")(compiler_fn, dynamic=dynamic)


def compiled_autograd_disable() -> contextlib.AbstractContextManager:
    """``torch._dynamo.compiled_autograd._disable()``: compiled autograd off inside the block."""
    return _resolve("torch._dynamo.compiled_autograd:_disable", "compiled autograd")()


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters`` (a ``defaultdict`` of ``Counter`` s)."""
    return _resolve("torch._dynamo.utils:counters", "compiled autograd")


def dynamo_calculate_time_spent() -> dict[str, float]:
    """``torch._dynamo.utils.calculate_time_spent()``: compile seconds by phase (``total_wall_time``)."""
    return _resolve("torch._dynamo.utils:calculate_time_spent", "compiled autograd")()


# ---------------------------------------------------------------------------------------------
# transformers internals: lazy module attributes (PEP 562), looked up on every import
# ---------------------------------------------------------------------------------------------
_TRANSFORMERS = {
    "find_packed_sequence_indices": "transformers.masking_utils",
    "ALL_MASK_ATTENTION_FUNCTIONS": "transformers.masking_utils",
    "and_masks": "transformers.masking_utils",
    "bidirectional_mask_function": "transformers.masking_utils",
    "causal_mask_function": "transformers.masking_utils",
    "sliding_window_overlay": "transformers.masking_utils",
    "ALL_ATTENTION_FUNCTIONS": "transformers.modeling_utils",
    "MODEL_FOR_CAUSAL_LM_MAPPING": "transformers.models.auto.modeling_auto",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING": "transformers.models.auto.modeling_auto",
    "Qwen2VLImageProcessorPil": "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
}


def transformers_chunks_per_document() -> bool:
    """Whether this transformers cuts attention chunks (Llama 4's ``attention_chunk_size``) per document
    in a row packed transformers-style (``position_ids`` restarting, no mask).

    transformers 5.23+ does (``masking_utils.remap_positions_for_packed_sequence``: the mask functions
    see each token's ``position_ids`` value, not its row index, so chunks break at multiples of the
    chunk in each document's positions); 5.17 .. 5.22 at multiples of the chunk from the row start (and
    at document boundaries). Ulysses follows whichever the installed one computes.
    """
    import transformers

    if _has("transformers.masking_utils:remap_positions_for_packed_sequence"):
        return True
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return (major, minor) >= (5, 23)


def sdpa_problem(model_class: Any, config: Any = None) -> str | None:
    """Why ``model_class`` (with ``config``) cannot run ``attn_implementation="sdpa"`` exactly; ``None``: it can.

    Three reasons: the class has no SDPA path (``_supports_sdpa`` false: gpt-oss), the config soft-caps the
    attention logits (``attn_logit_softcapping``: Gemma 2, VaultGemma), which SDPA cannot apply, or the model
    skips its causal mask under SDPA although its attention needs it (:func:`doge_skips_causal_mask`). transformers
    5.25 marks the soft-capping classes ``_supports_sdpa = False`` itself and builds Doge's mask; 5.17 .. 5.24 let
    Gemma 2 pick SDPA and run it without the cap (its ``sdpa_attention_forward`` ignores ``softcap``) and Doge
    attend to later tokens, so the class flag alone would let a run train a different model on the older releases.
    Pure: reads the class, the config and the installed transformers' source.
    """
    if not getattr(model_class, "_supports_sdpa", False):
        return f"{getattr(model_class, '__name__', model_class)} has no SDPA path"
    cap = getattr(config, "attn_logit_softcapping", None) if config is not None else None
    if isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap:
        return f"SDPA cannot apply its attention logit softcapping (attn_logit_softcapping={cap})"
    if getattr(model_class, "__name__", "").startswith("Doge") and doge_skips_causal_mask():
        import transformers

        return (f"transformers {transformers.__version__}'s Doge skips its causal mask under SDPA (it hands the "
                "attention its dynamic-mask bias alone), so every token would attend to later tokens of its row")
    return None


def doge_skips_causal_mask() -> bool:
    """Whether the installed transformers' ``DogeModel`` lets ``create_causal_mask`` skip the causal mask under SDPA
    (5.17 .. 5.24: no ``allow_is_causal_skip=False``): its attention then gets the dynamic-mask bias alone, with no
    causal part, and each token's logits depend on later tokens (5.17, one process: 0.1 in a tiny model's logits);
    5.25 always builds the mask. Eager builds it on every release. ``False`` where transformers has no Doge."""
    import inspect

    try:
        from transformers.models.doge.modeling_doge import DogeModel

        source = inspect.getsource(DogeModel.forward)
    except (ImportError, OSError, TypeError):
        return False
    return "allow_is_causal_skip=False" not in source


def missing_transformers_internals() -> list[str]:
    """The transformers internals (``module.name``) this transformers lacks."""
    missing = []
    for name, module_name in _TRANSFORMERS.items():
        if not _has(f"{module_name}:{name}"):
            missing.append(f"{module_name}.{name}")
    return missing


def __getattr__(name: str) -> Any:
    module_name = _TRANSFORMERS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        try:
            version = importlib.import_module("transformers").__version__
        except ImportError:
            raise ImportError(f"automodel needs transformers ({TRANSFORMERS_REQUIREMENT}) for {module_name}.{name}") from None
        raise ImportError(
            f"automodel needs the transformers internal {module_name}.{name}, which transformers {version} "
            f"does not have; automodel is tested with transformers {', '.join(TESTED_TRANSFORMERS_VERSIONS)} "
            f"({TRANSFORMERS_REQUIREMENT}): install one of those"
        ) from None


def _main() -> int:
    print(f"torch {torch.__version__}; sharding-rule API: {sharding_rule_api()}")
    bad = 0
    for feature in _FEATURES:
        missing = missing_torch_internals(feature)
        bad += bool(missing)
        print(f"  {feature}: {'ok' if not missing else 'MISSING ' + ', '.join(missing)}")
    missing = missing_transformers_internals()
    bad += bool(missing)
    print(f"  transformers internals: {'ok' if not missing else 'MISSING ' + ', '.join(missing)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(_main())
