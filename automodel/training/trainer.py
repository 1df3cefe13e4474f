"""The fine-tuning loop: build every component from a validated config, train, checkpoint, export.

``FinetuneTrainer(loaded).run()`` is what ``recipes/finetune.py`` does after parsing the command
line. Pieces live in their own modules (loss, step, optim, checkpoint, metrics, export, plot);
this file wires them in order:

1. process group, ``DeviceMesh`` (``ParallelDims``), one shared run directory, logging;
2. tokenizer and model *config* (checked against the run before any weight is read);
3. datasets and resumable dp loaders;
4. model (pretrained or from config), the CP method's one-time switch (Ulysses attention; none at
   cp_size=1, except on packed rows that the model's own forward would mix), LoRA, TP, the tiled MLP, activation
   checkpointing, compilation, activation offload, FSDP2;
5. optimizer, LR scheduler, checkpointer (and resume);
6. the loop: ``grad_acc`` micro-batches per step, the loss normalised by the global number of
   label tokens, gradient clipping, validation / checkpoints every N steps, SIGTERM handling;
7. final checkpoint, Hugging Face export, loss plot, ``summary.json``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from automodel.config import LoadedConfig
from automodel.data.collator import label_token_count
from automodel.distributed.cp import get_cp_method
from automodel.distributed.cp.attention_kernels import run_kernel_line
from automodel.distributed.cp.bind import bind_cp_method, no_cp_batch_and_ctx
from automodel.distributed.mesh import ParallelDims, default_backend, get_submesh, init_distributed
from automodel.errors import UserInputError
from automodel.training.checkpoint import Checkpointer, CheckpointLayout, SigtermFlag, latest_checkpoint
from automodel.training.elastic import reseed_for_step
from automodel.training.metrics import (
    SUPERSEDED_METRICS,
    MetricsWriter,
    peak_memory_gib,
    reset_peak_memory,
    supersede_metrics,
)
from automodel.training.nonfinite import (
    EXIT_NONFINITE,
    NonFiniteStop,
    agree_nonfinite_step,
    first_nonfinite_weight,
    nonfinite_message,
)
from automodel.training.optim import clip_grad_norm
from automodel.training.resume_policy import (
    apply_schedule,
    check_resume_schedule,
    run_identity,
    schedule_of,
    select_resume_checkpoint,
    write_run_identity,
)
from automodel.training.row_padding import document_padding_line, pad_multiple
from automodel.training.run_dir import checkpoint_root, shared_run_dir, supersede_later_checkpoints
from automodel.training.step import check_model_for_chunked_loss, prepare_batch, run_micro_batch
from automodel.training.user_errors import stop_run_agreed

__all__ = ["TrainHooks", "TrainResult", "FinetuneTrainer", "pad_multiple"]

logger = logging.getLogger("automodel.training")


@dataclass
class TrainHooks:
    """Callbacks for tests and tools. ``on_step_end(step, record)`` runs on every rank after each step."""

    on_step_end: Callable[[int, dict[str, Any]], None] | None = None


@dataclass
class TrainResult:
    """What a run did. Losses are keyed by optimizer step (1-based)."""

    run_dir: Path
    start_step: int
    final_step: int
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    stopped_by_sigterm: bool = False
    nonfinite_steps: list[int] = field(default_factory=list)  # skipped (recipe.on_nonfinite=skip)
    last_checkpoint: Path | None = None
    export_dir: Path | None = None
    metrics_path: Path | None = None
    plot_path: Path | None = None
    samples_path: Path | None = None
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0


def _with_eager_attention_backward(cp_fn: Callable, model: torch.nn.Module) -> Callable:
    """``cp_fn`` whose context also runs the attention backward eagerly (compiled autograd with CP)."""
    import contextlib

    from automodel.models.compile import attention_backward_eager

    def fn(device_mesh: Any, batch: dict[str, Any]) -> tuple[Callable, dict[str, Any]]:
        factory, batch = cp_fn(device_mesh, batch)

        @contextlib.contextmanager
        def context() -> Iterator[Any]:
            with attention_backward_eager(model), factory() as value:
                yield value

        return context, batch

    return fn


class FinetuneTrainer:
    """Owns every component of one fine-tuning run. Call :meth:`run` (or :meth:`setup` + :meth:`train`)."""

    def __init__(self, loaded: LoadedConfig, hooks: TrainHooks | None = None):
        self.loaded = loaded
        self.cfg = loaded.cfg
        self.hooks = hooks or TrainHooks()
        self.step = 0

    # ================================================================== setup
    def setup(self) -> None:
        cfg = self.cfg
        d = cfg.distributed
        backend = None if d.backend == "auto" else d.backend
        self.rank, self.world_size = init_distributed(backend)
        if self.world_size != self.loaded.world_size:
            raise ValueError(
                f"the config was validated for world size {self.loaded.world_size} but the process group has "
                f"{self.world_size} ranks"
            )
        be = backend or default_backend()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if be == "nccl" else torch.device("cpu")
        )
        self.dims = ParallelDims(
            dp_replicate=d.dp_replicate,
            dp_shard=d.dp_shard,
            cp=d.cp_size,
            tp=d.tp_size,
            world_size=self.world_size,
        )
        self.mesh = self.dims.build_mesh(self.device.type)
        dp_mesh = get_submesh(self.mesh, "dp")
        self.dp_rank = dp_mesh.get_local_rank()
        self.dp_size = dp_mesh.size()
        self.dp_group = dp_mesh.get_group()
        self.dp_cp_group = get_submesh(self.mesh, "dp_cp").get_group()

        self._open_run_dir()
        self._auto_profile: Any = None  # the profile auto chose from (cp_method: auto)
        self.cp_choice = self._resolve_auto_cp_method()  # cp_method: auto -> the method chosen for this model
        self.cp_method = get_cp_method(d.cp_method)  # the strategy: nothing below branches on its name
        logger.info(
            "world %d on %s: dp_replicate=%d dp_shard=%d cp=%d tp=%d (%s)",
            self.world_size,
            self.device.type,
            self.dims.dp_replicate,
            self.dims.dp_shard,
            self.dims.cp,
            self.dims.tp,
            f"cp_method={d.cp_method}",  # why: the "cp_method ..." line after the model profile
        )
        if cfg.recipe.deterministic:
            torch.use_deterministic_algorithms(True)
        seed = cfg.recipe.seed + self.rank  # dropout etc.; the model init uses recipe.seed on every rank
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

        self._build_data_and_model()
        self._build_optimization()
        self._maybe_resume()
        if cfg.recipe.cp_self_check:  # one step with CP and without, compared (weights untouched)
            from automodel.training.self_check import run_cp_self_check
            from automodel.training.user_errors import agree_before_collectives

            if d.cp_size > 1:  # a rank whose setup failed (a data file missing on one node) waits in the
                agree_before_collectives()  # setup agreement: meet it there before the check's collectives
            self.cp_self_check_report = run_cp_self_check(self)

    def _resolve_auto_cp_method(self) -> Any:
        """``distributed.cp_method: auto``: the model profiled on the meta device (no weights), the method chosen
        for it written into the config (:func:`automodel.config.cp_auto.resolve_cp_method`); its
        :class:`~automodel.distributed.cp.Choice`, or ``None`` when the config names a method."""
        from automodel.distributed.cp import AUTO

        cfg = self.cfg
        if cfg.distributed.cp_method != AUTO:
            return None
        from automodel.config.cp_auto import resolve_cp_method
        from automodel.models.cp_check import profile_for_run
        from automodel.models.loader import resolve_model_config

        attn = cfg.model.attn_implementation or "sdpa"
        profile = profile_for_run(cfg, resolve_model_config(cfg.model), attn)
        self._auto_profile = profile  # logged with the method (cp_size 1 has no other profile)
        return resolve_cp_method(cfg, profile, self.world_size, torch.cuda.is_available())

    def _log_profile_and_method(self) -> None:
        """Rank 0 logs the model profile (layer kinds with counts, heads) and the CP method with why it runs:
        ``auto``'s reason, or "named in the config" and what ``auto`` would pick instead."""
        if self.rank != 0:
            return
        from automodel.distributed.cp.choose import method_line
        from automodel.distributed.cp.profile import profile_line
        from automodel.errors import CPUnsupportedError

        d = self.cfg.distributed
        profile = self.model_profile or self._auto_profile
        if profile is not None:
            logger.info("%s", profile_line(profile))
        auto = None
        if self.cp_choice is None and profile is not None and d.cp_size > 1:
            from automodel.config.cp_auto import auto_choice

            try:
                auto = auto_choice(self.cfg, profile, self.world_size, torch.cuda.is_available())
            except CPUnsupportedError:  # auto's config rules refuse every method; the named one was checked
                auto = None
        logger.info("%s", method_line(d.cp_method, d.cp_size, self.cp_choice, auto, vars(d)))

    def _open_run_dir(self) -> None:
        """The run directory (refused if it holds another run's outputs and this run does not resume it),
        logging into it, and this run's ``config.yaml`` and identity (rank 0)."""
        identity, run_notes = run_identity(self.loaded.effective), []  # resume=auto: a run of this config only
        self.run_dir = shared_run_dir(self.cfg.recipe, self.cfg.checkpoint, identity, run_notes)
        from automodel.training.logs import setup_logging

        setup_logging(self.run_dir, self.rank, self.cfg.logging.level)
        for level, note in run_notes:
            logger.log(level, note)
        if self.rank == 0:
            from omegaconf import OmegaConf

            (self.run_dir / "config.yaml").write_text(
                OmegaConf.to_yaml(OmegaConf.create(self.loaded.effective))
            )
            write_run_identity(self.run_dir, identity)
        logger.info("run directory: %s", self.run_dir)

    def _build_data_and_model(self) -> None:
        """Setup steps 2-4 in order: model config checks, data, model, the CP method, wrapping."""
        resolved = self._check_model_config()
        self._build_data(resolved)
        self._build_model(resolved)
        self._bind_cp_method()
        self._wrap_model()

    def _check_model_config(self) -> Any:
        """Tokenizer and model config, checked against the run before data or weights load; the resolved config."""
        from automodel.data.tokenizer import load_run_tokenizer, own_tokenizer_note
        from automodel.models.cp_check import check_model_for_cp_run
        from automodel.models.loader import check_model_for_run, resolve_model_config
        from automodel.models.parallelize import check_model_config_for_tp

        cfg = self.cfg
        resolved = resolve_model_config(cfg.model)  # first: a wrong model path is named before its tokenizer
        self.tokenizer = load_run_tokenizer(
            cfg.data.tokenizer, cfg.model.pretrained_model_name_or_path, allow_download=cfg.model.allow_download
        )
        own = own_tokenizer_note(cfg.data.tokenizer, cfg.model.pretrained_model_name_or_path)
        logger.info("tokenizer: %s%s, %d ids", self.tokenizer.name_or_path, own, len(self.tokenizer))
        self.attn_implementation = cfg.model.attn_implementation or "sdpa"
        check_model_for_run(
            resolved.config,
            attn_implementation=self.attn_implementation,
            cp_size=cfg.distributed.cp_size,
            cp_method=cfg.distributed.cp_method,
            seq_len=cfg.data.seq_len,
            vocab_needed=len(self.tokenizer),
            trust_remote_code=cfg.model.trust_remote_code,
            allow_position_extrapolation=cfg.model.allow_position_extrapolation,
        )
        # exact or refused, before data or weights load: every layer kind of the model (profiled on the meta
        # device), its heads against the method's split, VLM or not (automodel.distributed.cp)
        self.model_profile = check_model_for_cp_run(cfg, resolved, self.attn_implementation)
        self._log_profile_and_method()
        check_model_config_for_tp(
            resolved.config, cfg.distributed.tp_size, sequence_parallel=cfg.distributed.sequence_parallel
        )
        if cfg.model.tiled_mlp is not False:  # every layer's MLP found and tileable, on a weightless model
            from automodel.models.tiled_mlp import check_tiled_mlp_for_model_config

            check_tiled_mlp_for_model_config(
                cfg.model, resolved, attn_implementation=self.attn_implementation, seed=cfg.recipe.seed
            )
        if cfg.model.tiled_layer is not False:  # every decoder layer a structure the tiled layer is proven for
            from automodel.models.tiled_layer import check_tiled_layer_for_model_config

            check_tiled_layer_for_model_config(
                cfg.model, resolved, attn_implementation=self.attn_implementation, seed=cfg.recipe.seed
            )
        if cfg.model.attention_head_chunks not in (None, 1):  # the heads and layer kinds, on a weightless model
            from automodel.models.attention_head_chunks import check_attention_head_chunks_for_model_config

            check_attention_head_chunks_for_model_config(
                cfg.model, resolved, attn_implementation=self.attn_implementation, seed=cfg.recipe.seed
            )
        if cfg.peft is not None:  # peft.target_modules against a weightless model, before data or weights
            from automodel.models.lora import check_lora_for_model_config

            check_lora_for_model_config(
                cfg.model, resolved, cfg.peft, attn_implementation=self.attn_implementation
            )
        logger.info("model config: %s", resolved.source)
        return resolved

    def _build_data(self, resolved: Any) -> None:
        """Datasets and resumable dp loaders (train, optional validation), ``grad_acc``, the epoch plan."""
        from hydra.utils import instantiate

        from automodel.data import build_dataloader
        from automodel.data.epoch_plan import epoch_plan
        from automodel.data.file_readers import data_path_key
        from automodel.models.vlm_cp import check_data_for_model

        cfg, sched = self.cfg, self.cfg.step_scheduler
        common = {"tokenizer": self.tokenizer, "seq_len": cfg.data.seq_len}

        def dataset(node: Any, split: str, key: str = "dataset") -> Any:
            options = self.cp_method.dataset_options(cfg, node)
            if options and split == cfg.data.train_split:  # once: the validation rows follow the same rule
                logger.info("%s", document_padding_line(cfg, options["seq_pad_multiple"], key))
            with data_path_key(f"data.{key}.path"):  # a missing file's error names the key it came from
                return instantiate(node, split=split, **common, **options, _convert_="all")

        self.train_dataset = dataset(cfg.data.dataset, cfg.data.train_split)
        check_data_for_model(self.train_dataset, resolved.config)  # images need a VLM
        loader_kwargs = dict(
            local_batch_size=sched.local_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            seed=cfg.recipe.seed,
            pad_to_multiple_of=pad_multiple(cfg),
            pad_token_id=self.tokenizer.pad_token_id,
        )
        self.train_loader = build_dataloader(
            self.train_dataset, shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last, **loader_kwargs
        )
        self.val_loader = None
        if cfg.data.validation_split is not None and sched.val_every_steps:
            own = cfg.data.validation_dataset is not None
            self.val_dataset = dataset(
                cfg.data.validation_dataset if own else cfg.data.dataset,
                cfg.data.validation_split,
                "validation_dataset" if own else "dataset",
            )
            self.val_loader = build_dataloader(self.val_dataset, shuffle=False, drop_last=False, **loader_kwargs)
        self.grad_acc = sched.global_batch_size // (sched.local_batch_size * self.dp_size)
        plan = epoch_plan(
            len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None,  # None: streaming
            global_batch_size=sched.global_batch_size,
            local_batch_size=sched.local_batch_size,
            dp_size=self.dp_size,
            drop_last=cfg.data.drop_last,
            seq_len=cfg.data.seq_len,
        )
        logger.info("%s", plan.line)
        if plan.warning:
            logger.warning("%s", plan.warning)

    def _build_model(self, resolved: Any) -> None:
        """The model (pretrained or from config) on this rank's device, unwrapped."""
        from automodel.models.loader import build_model

        cfg = self.cfg
        self.model = build_model(
            cfg.model,
            resolved,
            attn_implementation=self.attn_implementation,
            seed=cfg.recipe.seed,
            device=self.device,
        )
        if cfg.loss.chunk_tokens == "auto":  # resolved from the memory planner, before any step
            self._resolve_loss_auto()
        if cfg.loss.chunk_tokens is not None:
            check_model_for_chunked_loss(self.model)
        if cfg.distributed.ulysses_head_chunks == "auto":  # from the memory planner too, before the batch is bound
            from automodel.training.memory_plan import resolve_head_chunks

            self._resolve_from_plan("distributed", "ulysses_head_chunks", resolve_head_chunks)
        if cfg.model.attention_head_chunks == "auto":  # cp_size 1: the same rule (memory_plan.head_chunks_auto_choice)
            from automodel.training.memory_plan import resolve_attention_head_chunks

            self._resolve_from_plan("model", "attention_head_chunks", resolve_attention_head_chunks)
        if cfg.model.checkpoint_group_layers == "auto":  # from the memory planner: the node's host memory
            from automodel.training.memory_plan import resolve_checkpoint_group
            from automodel.training.plan_search import HOST_GIB_PER_GPU

            self._resolve_from_plan("model", "checkpoint_group_layers", resolve_checkpoint_group,
                                    HOST_GIB_PER_GPU * 2**30)  # fmt: skip
        n_params = sum(p.numel() for p in self.model.parameters())
        logger.info(
            "model: %s, %.2fM parameters, dtype %s",
            type(self.model).__name__,
            n_params / 1e6,
            cfg.model.dtype,
        )

    def _resolve_loss_auto(self) -> None:
        """``loss.chunk_tokens: auto`` -> on (an int) or off (None) in ``self.cfg`` (mutated), with the reason logged
        (:func:`automodel.training.memory_plan.loss_auto_choice`). A model that cannot return hidden states
        without logits keeps the plain loss."""
        from automodel.config import parallel_sizes
        from automodel.training.memory_plan import model_dims, resolve_chunk_tokens
        from automodel.training.step import check_model_for_chunked_loss

        cfg = self.cfg
        sizes, _ = parallel_sizes(cfg, self.world_size)
        mult = pad_multiple(cfg)
        seq = -(-cfg.data.seq_len // mult) * mult
        value, reason = resolve_chunk_tokens(cfg, model_dims(self.model), sizes, seq, self.grad_acc)
        if value is not None:
            try:
                check_model_for_chunked_loss(self.model)
            except ValueError as e:
                value, reason = None, f"{reason}; but this model cannot use it ({str(e).split(';')[0]}): the plain loss"
        cfg.loss.chunk_tokens = value
        logger.info("%s", reason)

    def _resolve_from_plan(self, section: str, key: str, resolve: Any, *extra: Any) -> None:
        """A config key's ``auto`` resolved from the memory plan: ``resolve(cfg, dims, sizes, seq, grad_acc, *extra)``
        (one of :mod:`automodel.training.memory_plan`'s ``resolve_*``) -> ``(value, reason)``; ``cfg.<section>.<key>``
        is set to the value (mutated) and the reason logged."""
        from automodel.config import parallel_sizes
        from automodel.training.memory_plan import model_dims

        cfg = self.cfg
        sizes, _ = parallel_sizes(cfg, self.world_size)
        mult = pad_multiple(cfg)
        seq = -(-cfg.data.seq_len // mult) * mult
        value, reason = resolve(cfg, model_dims(self.model), sizes, seq, self.grad_acc, *extra)
        setattr(getattr(cfg, section), key, value)
        logger.info("%s", reason)

    def _bind_cp_method(self) -> None:
        """The CP method's batch/context function ``cp_fn``; the method may prepare the model once.

        Ulysses, thd: their own attention implementation around the inner kernel
        ``model.attn_implementation``. At cp_size=1 nothing is prepared (the model is the plain
        single-device run), except on packed rows where the model's own forward mixes the documents: a
        method's document-aware attention then runs on the one rank
        (:func:`~automodel.distributed.cp.bind.bind_cp_method`). ``no_cp_fn`` and ``cp_prepared`` (what
        the method did, and how to undo it) give the same pipeline without CP: the CP self-check's
        reference (on packed rows, a document-aware path on one rank: ``automodel.training.self_check``).
        """
        from automodel.models.vlm_cp import bind_vlm_cp, is_vlm

        cfg, d = self.cfg, self.cfg.distributed
        if is_vlm(self.model):  # vision on each rank's share, then the text model under CP
            self.cp_fn, self.cp_prepared = bind_vlm_cp(
                self.model, self.mesh, self.cp_method, d.cp_size, self.attn_implementation
            )
            self.no_cp_fn, _ = bind_vlm_cp(self.model, self.mesh, self.cp_method, 1, self.attn_implementation)
        else:
            from automodel.config.cp_auto import packed_rows

            # cp_size=1 on packed rows: the model's own forward where a probe shows it keeps documents apart,
            # else a method's document-aware attention on the one rank (or packing refused with the reason)
            self.cp_fn, self.cp_prepared = bind_cp_method(
                self.cp_method,
                self.model,
                self.mesh,
                d.cp_size,
                packed=d.cp_size <= 1 and packed_rows(cfg),
                **self.cp_method.recipe_batch_options(cfg),
            )
            self.no_cp_fn = no_cp_batch_and_ctx
        if self.cp_prepared.single_rank:
            logger.info("packed rows at cp_size=1: %s", self.cp_prepared.single_rank)
        self.inner_attn = self.cp_prepared.previous_attn
        if self.cp_prepared.switched:
            logger.info(
                "cp_method=%s: model attention switched to %r around the inner kernel %r",
                d.cp_method,
                self.cp_prepared.current_attn,
                self.inner_attn,
            )
        if d.enable_compiled_autograd and d.cp_size > 1:  # the CP attention backward runs eagerly
            self.cp_fn = _with_eager_attention_backward(self.cp_fn, self.model)

    def _wrap_model(self) -> None:
        """LoRA, TP, the tiled MLP, activation checkpointing, compilation, activation offload, then FSDP2 (or
        replication) over dp x cp. Checkpointing, compilation and offload share each decoder block's
        :class:`~automodel.models.block_call.BlockCall`, which fixes their order whatever order they are applied in."""
        from automodel.models.loader import torch_dtype
        from automodel.models.parallelize import apply_activation_checkpointing, apply_fsdp2, apply_tp

        cfg, d = self.cfg, self.cfg.distributed
        if cfg.peft is not None:  # LoRA adapters in place; everything else frozen (automodel.models.lora)
            from automodel.models.lora import apply_lora

            apply_lora(self.model, cfg.peft, seed=cfg.recipe.seed)
        # TP inside (the tp mesh dim), then FSDP2 over dp_shard_cp: 2-D parameters
        apply_tp(
            self.model,
            self.mesh,
            loss_parallel=d.enable_loss_parallel,
            sequence_parallel=d.sequence_parallel,
        )
        # each tile enters the MLP through TP's hooks: tiles of the tokens the rank holds after the TP split
        if cfg.model.tiled_mlp is not False:
            from automodel.models.tiled_mlp import apply_tiled_mlp

            apply_tiled_mlp(
                self.model, cfg.model.tiled_mlp, tp_size=d.tp_size, sequence_parallel=d.sequence_parallel
            )
        if cfg.model.tiled_layer is not False:  # the layer's forward in tiles; checkpointing etc. wrap it
            from automodel.models.tiled_layer import apply_tiled_layer

            apply_tiled_layer(self.model, cfg.model.tiled_layer)
        if cfg.model.attention_head_chunks not in (None, 1):  # cp_size 1: around the attention the bind left
            from automodel.models.attention_head_chunks import apply_attention_head_chunks

            apply_attention_head_chunks(self.model, cfg.model.attention_head_chunks)
        if cfg.model.activation_checkpointing:
            apply_activation_checkpointing(self.model)
        if cfg.model.activation_checkpointing and cfg.model.checkpoint_group_layers != 1:  # before the offload
            from automodel.models.checkpoint_groups import apply_checkpoint_groups

            groups = apply_checkpoint_groups(self.model, cfg.model.checkpoint_group_layers)
            if groups is not None:
                logger.info(
                    "model.checkpoint_group_layers=%d: %d of %d layer inputs kept (layers %s)%s; the others rebuilt in "
                    "the backward from their group's first one", groups.size, len(groups.starts), len(groups.calls),
                    ", ".join(map(str, groups.starts)), " and offloaded" if cfg.model.activation_offload else "",
                )  # fmt: skip
        if cfg.model.compile or d.enable_compiled_autograd:
            torch._dynamo.reset()  # a fresh compile cache per run: no graphs of an earlier run in this process
        if cfg.model.compile:  # per decoder block, after the CP method switched the attention
            from automodel.models.compile import compile_decoder_blocks

            compile_decoder_blocks(self.model, cfg.model.compile_backend)
        self.activation_offload = None  # model.activation_offload: the host store of the checkpointed layer inputs
        if cfg.model.activation_offload:  # its hooks sit outside the checkpoint and the compiled code
            from automodel.training.activation_offload import apply_activation_offload

            self.activation_offload = apply_activation_offload(self.model)
            logger.info("model.activation_offload: the checkpointed layer inputs live in host memory")
        param_dtype = cfg.fsdp.param_dtype
        if param_dtype == "auto":
            param_dtype = "bfloat16" if self.device.type == "cuda" else None
        if cfg.fsdp.enabled:
            apply_fsdp2(
                self.model,
                self.mesh,
                param_dtype=torch_dtype(param_dtype) if param_dtype else None,
                reduce_dtype=torch_dtype(cfg.fsdp.reduce_dtype),
                reshard_after_forward=cfg.fsdp.reshard_after_forward,
                offload=cfg.fsdp.offload == "all",  # parameters, gradients and optimizer on the host
            )
        else:  # replicated: gradients summed over dp x cp after the backward (automodel.distributed.replicate)
            from automodel.distributed.replicate import broadcast_parameters

            broadcast_parameters(self.model, self.dp_cp_group)

    def _build_optimization(self) -> None:
        from automodel.distributed.train_context import get_train_context
        from automodel.training.optim import build_lr_scheduler, build_optimizer

        cfg = self.cfg
        # fsdp.offload=optimizer: state and step on the host (automodel.training.optimizer_offload)
        self.optimizer = build_optimizer(cfg.optimizer, self.model, offload=cfg.fsdp.offload == "optimizer")
        if cfg.fsdp.offload:
            logger.info("fsdp.offload=%s: %s on the host", cfg.fsdp.offload,
                        "optimizer state and step" if cfg.fsdp.offload == "optimizer"
                        else "parameters, gradients, optimizer state and step")  # fmt: skip
        self.scheduler = build_lr_scheduler(cfg.lr_scheduler, self.optimizer, cfg.step_scheduler.max_steps)
        self.train_context = functools.partial(
            get_train_context,
            cfg.distributed.enable_loss_parallel,
            cfg.distributed.enable_compiled_autograd,
            compiled_autograd_backend=cfg.model.compile_backend,
            attention_backend=cfg.model.attention_backend,
            device_type=self.device.type,
            cudnn_packed_blocks=cfg.model.cudnn_packed_blocks,
        )
        cuda = self.device.type == "cuda"
        logger.info("%s", run_kernel_line(
            cfg.model.attention_backend, self.device.type,
            tuple(torch.cuda.get_device_capability(self.device)) if cuda else None,
            torch.backends.cudnn.version() if cuda and torch.backends.cudnn.is_available() else None,
        ))  # fmt: skip
        from automodel.training.compile_stats import CompileClock

        self.compile_clock = CompileClock()
        self.compile_time_s = 0.0
        self._stepped = False
        self.layout = CheckpointLayout(
            world_size=self.world_size,
            dp_replicate=self.dims.dp_replicate,
            dp_shard=self.dims.dp_shard,
            cp=self.dims.cp,
            tp=self.dims.tp,
        )
        self.checkpointer = Checkpointer(
            checkpoint_root(self.run_dir, cfg.checkpoint),
            self.layout,
            keep_last=cfg.checkpoint.keep_last,
            trainable_only=cfg.peft is not None,
            global_batch_size=cfg.step_scheduler.global_batch_size,
            schedule=schedule_of(self.loaded.effective),
        )

    def _maybe_resume(self) -> None:
        ck = self.cfg.checkpoint
        self.resumed_from: Path | None = None
        if not ck.resume and not ck.resume_from:
            return
        path = select_resume_checkpoint(  # verified before any rank reads it (skips / names a damaged one)
            self.checkpointer.root, Path(ck.resume_from).expanduser().resolve() if ck.resume_from else None
        )
        if path is None:
            if ck.resume == "auto":
                logger.info(
                    "checkpoint.resume=auto: no checkpoint under %s, starting from step 0",
                    self.checkpointer.root,
                )
                return
            raise UserInputError(
                f"checkpoint.resume=true but there is no complete checkpoint under {self.checkpointer.root}; "
                f"set checkpoint.resume=false to start fresh, checkpoint.resume=auto to resume only if one "
                f"exists, or checkpoint.resume_from=<step_N directory>"
            )
        changes = check_resume_schedule(path, self.loaded.effective, self.scheduler, ck.allow_schedule_change)
        payload = self.checkpointer.load(path, self.model, self.optimizer, self.scheduler, self.train_loader)
        self.step = int(payload["step"])
        if changes:  # allowed: this run's schedule from here on (the checkpoint restored the old base lr)
            apply_schedule(self.optimizer, self.scheduler, self.cfg.optimizer.get("lr"))
            logger.warning(
                "checkpoint.allow_schedule_change=true: resuming %s with a changed LR schedule (%s); step %d "
                "trains at lr %.4g", path, "; ".join(changes), self.step + 1, self.optimizer.param_groups[0]["lr"],
            )  # fmt: skip
        self.resumed_from = path
        if self.rank == 0:  # every rank listed the checkpoints before the (collective) load
            for moved in supersede_later_checkpoints(self.checkpointer.root, self.step):
                logger.warning(
                    "resumed step_%d: moved %s, a checkpoint of a later step that this run abandons, to %s "
                    "(checkpoint.resume=auto never picks it)", self.step, moved.name.rsplit("-", 2)[0], moved.parent,
                )  # fmt: skip
        if self.step >= self.cfg.step_scheduler.max_steps:
            logger.warning(
                "checkpoint %s is at step %d >= step_scheduler.max_steps=%d: nothing left to train",
                path,
                self.step,
                self.cfg.step_scheduler.max_steps,
            )

    # ================================================================== loop pieces
    def _train_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            got = False
            for batch in self.train_loader:
                got = True
                yield batch
            if not got and len(self.train_loader) == 0:
                raise RuntimeError("the training data loader yields no batches")

    def _all_reduce(self, t: torch.Tensor, group: Any) -> torch.Tensor:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        return t

    def train_step(self, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
        """One optimizer step over ``grad_acc`` micro-batches; returns the step's metrics (all ranks)."""
        t0 = time.perf_counter()
        local = torch.zeros(3, dtype=torch.float64, device=self.device)  # label tokens, positions, -
        prepared = []
        for b in batches:
            p = self._fixed_length(prepare_batch(b, self.device))
            local[0] += label_token_count(p["labels"]).to(torch.float64)
            local[1] += p["input_ids"].numel()
            prepared.append(p)
        self._all_reduce(local, self.dp_group)  # counted before CP sharding, over dp (CP peers share rows)
        num_label_tokens = local[0].clamp(min=1.0).to(torch.float32)

        ce_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in prepared:
            ce_sum += run_micro_batch(
                self.model,
                p,
                device_mesh=self.mesh,
                cp_fn=self.cp_fn,
                train_context=self.train_context,
                chunk_tokens=self.cfg.loss.chunk_tokens,
                num_label_tokens=num_label_tokens,
            )
        if not self.cfg.fsdp.enabled:  # replicated model: sum the gradients over dp x cp
            from automodel.distributed.replicate import all_reduce_gradients

            all_reduce_gradients(self.model, self.dp_cp_group)
        grad_norm = clip_grad_norm(self.model, self.cfg.clip_grad.max_norm, self.cfg.clip_grad.norm_type)
        lr = self.optimizer.param_groups[0]["lr"]
        self._all_reduce(ce_sum, self.dp_cp_group)  # each CP rank holds a disjoint part of the tokens
        loss = (ce_sum / num_label_tokens).item()
        nonfinite = agree_nonfinite_step(loss, grad_norm, self.model, self.device)  # the same on every rank
        if nonfinite is None:  # else no update: the gradients are dropped (automodel.training.nonfinite)
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        compiled = self.compile_clock.delta()  # compile time is reported apart from the step time
        self.compile_time_s += compiled.seconds
        if compiled.graphs:  # this process's first step: the startup cost; any later step: a recompile
            logger.info(
                "step %d: %d graph(s) compiled in %.1fs%s (compile total %.1fs)",
                self.step + 1,
                compiled.graphs,
                compiled.seconds,
                "" if not self._stepped else ", a RECOMPILE",
                self.compile_time_s,
            )
        step_time = max(time.perf_counter() - t0 - compiled.seconds, 1e-9)
        self._stepped = True
        tokens = local[1].item()
        mem, mem_kind = peak_memory_gib(self.device)
        return {
            "type": "train",
            "step": self.step + 1,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "label_tokens": int(local[0].item()),
            "tokens": int(tokens),
            "tokens_per_s": tokens / step_time,
            "tokens_per_s_per_device": tokens / step_time / self.world_size,
            "step_time_s": step_time,
            "compile_time_s": compiled.seconds,
            "graphs_compiled": compiled.graphs,
            "peak_mem_gib": mem,
            "mem_kind": mem_kind,
            "epoch": self.train_loader.epoch,
            **({"nonfinite": nonfinite, "skipped": True} if nonfinite is not None else {}),
        }

    @torch.no_grad()
    def validate(self) -> float:
        """Mean CE per label token over the validation split (or its first ``val_max_batches`` global batches)."""
        assert self.val_loader is not None
        self.model.eval()
        self.val_loader.set_epoch(0)
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        # val_max_batches counts global batches (global_batch_size rows): the same rows whatever dp is
        limit = self.cfg.step_scheduler.val_max_batches
        limit = None if limit is None else limit * self.grad_acc
        for i, batch in enumerate(self.val_loader):
            if limit is not None and i >= limit:
                break
            p = self._fixed_length(prepare_batch(batch, self.device))
            totals[1] += label_token_count(p["labels"]).to(torch.float64)
            ce = run_micro_batch(
                self.model,
                p,
                device_mesh=self.mesh,
                cp_fn=self.cp_fn,
                train_context=self.train_context,
                chunk_tokens=self.cfg.loss.chunk_tokens,
                num_label_tokens=1.0,
                backward=False,
            )
            totals[0] += ce.to(torch.float64)
        self.model.train()
        compiled = self.compile_clock.delta()  # no-grad forward graphs: not counted against the next step
        self.compile_time_s += compiled.seconds
        if compiled.graphs:
            logger.info("validation: %d graph(s) compiled in %.1fs", compiled.graphs, compiled.seconds)
        self._all_reduce(totals[:1], self.dp_cp_group)
        self._all_reduce(totals[1:], self.dp_group)
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _reset_techniques(self) -> None:
        """Counters of the per-layer techniques zeroed; the offload pool emptied (no buffer of the self-check's
        shapes stays for the run)."""
        from automodel.training.technique_report import reset_technique_counts

        self.technique_report = None
        reset_technique_counts(self.model, self.activation_offload)
        if self.activation_offload is not None:
            self.activation_offload.pool.clear()

    def _report_techniques(self) -> None:
        """Once, after the first training step: what each technique did (``automodel.training.technique_report``),
        one line each; a technique that is on but did not act is a warning."""
        from automodel.training.technique_report import (
            collect_technique_report,
            technique_lines,
            technique_problems,
        )

        chunks = self.cfg.distributed.ulysses_head_chunks if self.cfg.distributed.cp_size > 1 else 1
        chunks = chunks if isinstance(chunks, int) and self.cp_method.head_chunk_ranks(self.cfg.distributed.cp_size) else 1
        own = self.cfg.model.attention_head_chunks if self.cfg.distributed.cp_size <= 1 else None
        report = collect_technique_report(self.model, self.activation_offload, self.grad_acc, chunks,
                                          attention_head_chunks=own if isinstance(own, int) else 1)  # fmt: skip
        self.technique_report = report
        for line in technique_lines(report):
            logger.info("step %d: %s", self.step, line)
        for problem in technique_problems(report):
            logger.warning("step %d: %s; please report it with this log (docs/long_context.md)", self.step, problem)

    def _fixed_length(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """With ``model.compile`` / compiled autograd: ``batch`` right-padded to one length (no recompiles)."""
        cfg = self.cfg
        if not (cfg.model.compile or cfg.distributed.enable_compiled_autograd):
            return batch
        from automodel.training.compile_stats import pad_batch_to_length

        multiple = pad_multiple(cfg)
        length = max(-(-cfg.data.seq_len // multiple) * multiple, batch["input_ids"].shape[1])
        return pad_batch_to_length(batch, length, self.tokenizer.pad_token_id or 0)

    def save_checkpoint(self) -> Path:
        """A checkpoint of the current step; never one with non-finite weights (:meth:`_check_weights`)."""
        self._check_weights("checkpoint")
        return self.checkpointer.save(
            self.step, self.model, self.optimizer, self.scheduler, self.train_loader
        )

    def _check_weights(self, what: str) -> None:
        """Stop the run (exit :data:`EXIT_NONFINITE`) if any weight is not finite, before a ``what`` is written."""
        name = first_nonfinite_weight(self.model, self.device)
        if name is not None:
            self._stop_nonfinite(f"parameter {name} holds non-finite weights; the {what} was not written")

    def _stop_nonfinite(self, what: str, in_row: int | None = None, lr: float | None = None) -> None:
        """End the run on a non-finite number (every rank, agreed): one ``error:`` line, :data:`EXIT_NONFINITE`."""
        message = nonfinite_message(
            self.step,
            what,
            lr=self.optimizer.param_groups[0]["lr"] if lr is None else lr,
            last_checkpoint=latest_checkpoint(self.checkpointer.root) if self.cfg.checkpoint.enabled else None,
            in_row=in_row,
        )
        self.nonfinite_stop = message
        raise NonFiniteStop(message)

    def _on_nonfinite_step(self, record: dict[str, Any], result: TrainResult) -> None:
        """A step whose update was not applied: stop (``recipe.on_nonfinite=stop``, or the limit in a row
        reached) or count it and go on (``skip``)."""
        r = self.cfg.recipe
        if r.on_nonfinite == "stop":
            self._stop_nonfinite(record["nonfinite"], lr=record["lr"])
        result.nonfinite_steps.append(self.step)
        self.nonfinite_in_row += 1
        record["nonfinite_skipped"] = len(result.nonfinite_steps)
        logger.warning("step %d: skipped, %s (recipe.on_nonfinite=skip; %d in a row, %d in all)",
                       self.step, record["nonfinite"], self.nonfinite_in_row, len(result.nonfinite_steps))  # fmt: skip
        if self.nonfinite_in_row >= r.max_nonfinite_in_row:
            self._stop_nonfinite(record["nonfinite"], in_row=self.nonfinite_in_row, lr=record["lr"])

    def _record_step(self, record: dict[str, Any], result: TrainResult, metrics: Any, trackers: Any, bar: Any) -> None:
        """Step ``self.step``'s record into ``result``, ``metrics.jsonl``, the trackers, the step line and the bar.

        A step whose update was not applied (non-finite) goes to ``metrics.jsonl`` only, and stops the run
        here unless ``recipe.on_nonfinite=skip`` (:meth:`_on_nonfinite_step`).
        """
        from automodel.training.step_log import format_step_line, should_log_step

        sched = self.cfg.step_scheduler
        if "nonfinite" in record:
            try:
                self._on_nonfinite_step(record, result)
            finally:
                metrics.write(record)
        else:
            self.nonfinite_in_row = 0
            result.losses[self.step] = record["loss"]
            result.grad_norms[self.step] = record["grad_norm"]
            metrics.write(record)
            trackers.log(record)
            if self.rank == 0 and should_log_step(
                self.step, self.cfg.logging.log_every_steps, result.start_step, sched.max_steps
            ):
                logger.info("%s", format_step_line(record, sched.max_steps))
        if bar is not None:
            bar.set_postfix(
                loss=f"{record['loss']:.4f}",
                lr=f"{record['lr']:.2e}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                **({"compile_s": f"{self.compile_time_s:.1f}"} if self.compile_time_s else {}),
            )
            bar.update(1)

    # ================================================================== the loop
    def train(self) -> TrainResult:
        """The training loop, the final checkpoint, the export, the plot and ``summary.json``.

        Raises :class:`~automodel.training.user_errors.RunAborted` (exit :data:`EXIT_NONFINITE`, on every
        rank, after rank 0 printed one ``error:`` line) when a non-finite number stopped the run.
        """
        try:
            return self._train()
        except NonFiniteStop as stop:  # out of the loop's SIGTERM handler: the ranks exit once rank 0 printed
            if self.rank == 0:  # the summary says why the run ended
                result = self._result
                result.final_step = self.step
                result.wall_time_s = time.perf_counter() - self._t_start
                self._write_summary(result)
            raise stop_run_agreed(stop.message, EXIT_NONFINITE) from None

    def _train(self) -> TrainResult:
        cfg, sched = self.cfg, self.cfg.step_scheduler
        result = self._result = TrainResult(run_dir=self.run_dir, start_step=self.step, final_step=self.step)
        if self.rank == 0 and (moved := supersede_metrics(self.run_dir / "metrics.jsonl", self.step)):
            logger.info("metrics.jsonl continues at step %d: %d record(s) of later steps moved to %s",
                        self.step + 1, moved, SUPERSEDED_METRICS)  # fmt: skip
        metrics = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=self.rank == 0)
        result.metrics_path = metrics.path
        from automodel.training.step_log import progress_bar
        from automodel.training.trackers import Trackers

        trackers = Trackers(cfg.logging, self.run_dir, cfg.recipe.name, self.loaded.effective, self.rank == 0)
        display = contextlib.ExitStack()  # the trackers and the bar (a terminal only), closed in `finally`
        display.callback(trackers.close)
        bar = display.enter_context(
            progress_bar(self.rank == 0 and cfg.logging.progress_bar, sched.max_steps, self.step)
        )
        batches = self._train_batches()
        t_start = self._t_start = time.perf_counter()
        tok_rates: list[float] = []
        self.nonfinite_in_row = 0  # recipe.on_nonfinite=skip: steps skipped in a row
        last_saved_step = self.step if self.resumed_from is not None else -1
        self._reset_techniques()  # what the first training step does is reported (not the self-check's steps)
        try:
            with SigtermFlag() as sigterm:
                while self.step < sched.max_steps:
                    reset_peak_memory(self.device)
                    reseed_for_step(cfg.recipe.seed, self.step, self.rank)  # exact resume at any layout
                    step_batches = [next(batches) for _ in range(self.grad_acc)]
                    record = self.train_step(step_batches)
                    self.step += 1
                    if self.technique_report is None:
                        self._report_techniques()
                    self._record_step(record, result, metrics, trackers, bar)  # a non-finite step may stop here
                    if self.step > result.start_step + 1 or sched.max_steps - result.start_step == 1:
                        tok_rates.append(record["tokens_per_s"])  # the first step includes warm-up
                    if self.val_loader is not None and (
                        self.step % sched.val_every_steps == 0 or self.step == sched.max_steps
                    ):
                        val = self.validate()
                        result.val_losses[self.step] = val
                        metrics.write({"type": "val", "step": self.step, "val_loss": val})
                        trackers.log({"type": "val", "step": self.step, "val_loss": val})
                        logger.info("step %d: validation loss %.4f", self.step, val)
                    if self.hooks.on_step_end is not None:
                        self.hooks.on_step_end(self.step, record)
                    if (
                        cfg.checkpoint.enabled
                        and sched.ckpt_every_steps
                        and self.step % sched.ckpt_every_steps == 0
                    ):
                        result.last_checkpoint = self.save_checkpoint()
                        last_saved_step = self.step
                    if sigterm.should_stop(self.device):
                        result.stopped_by_sigterm = True
                        if (
                            cfg.checkpoint.enabled
                            and cfg.checkpoint.save_on_sigterm
                            and last_saved_step != self.step
                        ):
                            result.last_checkpoint = self.save_checkpoint()
                            last_saved_step = self.step
                        logger.warning("stopped by SIGTERM after step %d", self.step)
                        break
        finally:
            display.close()
            metrics.close()
        result.final_step = self.step
        result.wall_time_s = time.perf_counter() - t_start
        result.tokens_per_s = float(np.mean(tok_rates)) if tok_rates else 0.0

        finished = not result.stopped_by_sigterm and self.step >= sched.max_steps
        if finished and cfg.checkpoint.enabled and cfg.checkpoint.save_final and last_saved_step != self.step:
            result.last_checkpoint = self.save_checkpoint()
        if finished and cfg.export.enabled:
            result.export_dir = self.export()
            if cfg.recipe.sample_prompts and self.rank == 0:
                result.samples_path = self.sample(result.export_dir)
        if self.rank == 0:
            if cfg.logging.plot and result.losses:
                from automodel.training.plot import plot_loss_curve

                result.plot_path = plot_loss_curve(
                    self.run_dir / "metrics.jsonl", self.run_dir / "loss.png", title=cfg.recipe.name
                )
            self._write_summary(result)
        return result

    def export(self) -> Path | None:
        from automodel.models.loader import torch_dtype
        from automodel.training.export import export_hf_model

        self._check_weights("export")
        ex = self.cfg.export
        out = Path(ex.dir).expanduser().resolve() if ex.dir else self.run_dir / "hf_model"
        if self.cfg.peft is not None:  # adapter/ (PEFT format), base/ or merged/ as needed
            from automodel.models.lora import export_lora

            export_lora(
                self.model,
                self.cfg.peft,
                out,
                base_model_name_or_path=self.cfg.model.pretrained_model_name_or_path,
                merge=ex.merge_lora,
                dtype=torch_dtype(ex.dtype) if ex.dtype else None,
                tokenizer=self.tokenizer,  # its special-token ids go into the exported configs
                save_tokenizer=ex.save_tokenizer,
            )
            return out
        export_hf_model(
            self.model,
            out,
            dtype=torch_dtype(ex.dtype) if ex.dtype else None,
            tokenizer=self.tokenizer,  # its special-token ids go into the exported configs
            save_tokenizer=ex.save_tokenizer,
            processor=getattr(self.train_dataset, "image_processor", None),  # a VLM's, for the export
        )
        return out

    def sample(self, export_dir: Path) -> Path:
        """Rank 0: ``recipe.sample_prompts`` completed by the exported model -> ``<run dir>/samples.jsonl``."""
        from automodel.data.chat_template import renders_chats
        from automodel.models.hf_save import original_model_class
        from automodel.training.samples import generate_samples, load_exported_model, write_samples

        r = self.cfg.recipe
        model = load_exported_model(export_dir, original_model_class(self.model), self.device)
        chat = renders_chats(self.tokenizer)  # the data was rendered with the chat template
        samples = generate_samples(
            model, self.tokenizer, list(r.sample_prompts), r.sample_max_new_tokens, self.device, chat=chat
        )
        return write_samples(samples, self.run_dir / "samples.jsonl")

    def _write_summary(self, result: TrainResult) -> None:
        losses = result.losses
        summary = {
            "run_dir": str(result.run_dir),
            "start_step": result.start_step,
            "final_step": result.final_step,
            "first_loss": losses[min(losses)] if losses else None,
            "last_loss": losses[max(losses)] if losses else None,
            "val_losses": result.val_losses,
            "wall_time_s": result.wall_time_s,
            "mean_tokens_per_s": result.tokens_per_s,
            "world_size": self.world_size,
            "stopped_by_sigterm": result.stopped_by_sigterm,
            "nonfinite_skipped": len(result.nonfinite_steps),
            "nonfinite_steps": result.nonfinite_steps,
            "stopped_by_nonfinite": getattr(self, "nonfinite_stop", None),
            "last_checkpoint": str(result.last_checkpoint) if result.last_checkpoint else None,
            "export_dir": str(result.export_dir) if result.export_dir else None,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "techniques": getattr(self, "technique_report", None),  # what each technique did in the first step
        }
        (result.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if losses and summary["stopped_by_nonfinite"] is None:
            logger.info(
                "done: steps %d..%d, loss %.4f -> %.4f, %.0f tokens/s (%.0f per device), %.1fs",
                result.start_step + 1,
                result.final_step,
                summary["first_loss"],
                summary["last_loss"],
                result.tokens_per_s,
                result.tokens_per_s / self.world_size,
                result.wall_time_s,
            )

    def run(self) -> TrainResult:
        """:meth:`setup` then :meth:`train`."""
        self.setup()
        return self.train()
