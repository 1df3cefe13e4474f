"""The typed schema of a fine-tuning recipe config: one dataclass per top-level group.

Every key a recipe YAML may contain is a field here, with its type and default. A composed config
is checked against this schema by :func:`automodel.config.typecheck.to_dataclass` (unknown keys,
wrong types, missing required values) and then by :mod:`automodel.config.rules` (combinations).

Groups that name a class or function to build (``model.config``, ``data.dataset``,
``optimizer``, ``lr_scheduler``) are :data:`TargetNode` s: a mapping with ``_target_`` (an import
path) and that callable's keyword arguments, built with ``hydra.utils.instantiate``. Their keys
are checked against the callable's signature, not against this file.

The documentation of every key is docs/recipe.md; keep the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NewType

__all__ = [
    "TargetNode",
    "RecipeSection",
    "DistributedSection",
    "ModelSection",
    "FSDPSection",
    "DataSection",
    "StepSchedulerSection",
    "ClipGradSection",
    "CheckpointSection",
    "ExportSection",
    "LoggingSection",
    "WandbSection",
    "LossSection",
    "PeftSection",
    "RecipeConfig",
    "DTYPES",
]

# A mapping with a ``_target_`` import path plus keyword arguments for that callable.
TargetNode = NewType("TargetNode", dict)

DTYPES = ("float32", "bfloat16", "float16")
DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class RecipeSection:
    """What this run is called, where it writes, and whether it only plans (dry run)."""

    name: str = "finetune"
    output_root: str = "outputs"  # runs go to <output_root>/<name>/<timestamp> ...
    output_dir: str | None = None  # ... unless this is set (then exactly here)
    seed: int = 1234
    dry_run: bool = False
    dry_run_world_size: int | None = (
        None  # world size a dry run plans for (default: $WORLD_SIZE, else recipe.gpus, else the minimum)
    )
    gpus: int | None = None  # the GPUs (world size) this config is written for: what a dry run plans for by default
    gpu_type: str | None = None  # dry run: estimate step time and communication on this GPU (h100, h200, a100, l40s)
    dry_run_print_config: bool = False  # dry run: also print the resolved config (after the plan)
    deterministic: bool = False  # torch.use_deterministic_algorithms(True)
    plan_nnodes: int | None = None  # dry run: nodes to plan for (ranks per node, cp/tp groups vs nodes)
    plan_nproc_per_node: int | None = None  # dry run: processes per node (with plan_nnodes: the world size)
    plan_layouts: list[str] | None = None  # dry run with gpu_type: rank these layouts by the step estimate ("tp2.cp4")
    cp_self_check: bool = True  # at cp_size > 1: one step with CP and without it compared before training
    cp_self_check_tokens: int = 512  # tokens per row of the self-check's slice of the training data
    memory_budget_gib: float | None = None  # dry run: per-rank memory budget; suggests the cheapest change that fits
    sample_prompts: list[str] | None = None  # at the end: greedy completions of the exported model -> samples.jsonl
    sample_max_new_tokens: int = 32  # new tokens per sample at most (generation stops at the tokenizer's EOS)
    on_nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient: stop (exit 3), or skip the update
    max_nonfinite_in_row: int = 3  # on_nonfinite=skip: this many skipped steps in a row stop the run (exit 3)


@dataclass
class DistributedSection:
    """Parallel sizes (their product is the world size) and the context-parallel method."""

    dp_replicate: int = 1
    dp_shard: int = -1  # -1: world_size // (dp_replicate * cp_size * tp_size)
    cp_size: int = 1
    tp_size: int = 1
    cp_method: str = "ring"  # auto | ring | ulysses | thd | thd_docs | usp: a registered method, or auto (picked per model)
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    enable_loss_parallel: bool = False  # tp_size > 1: vocabulary-sharded logits and loss (loss_parallel())
    sequence_parallel: bool = False  # tp_size > 1: norms and the residual stream hold 1/tp of the tokens
    enable_compiled_autograd: bool = False
    thd_kernel: str = "portable"  # cp_method=thd: portable (exact, any device) | flash_attn | te (CUDA)
    thd_cp_comm_type: str = "p2p"  # cp_method=thd with thd_kernel=te: p2p | all_gather | a2a | a2a+p2p
    ulysses_size: int | None = None  # cp_method=usp: Ulysses sub-group size (divides cp_size; ring = cp_size / it)
    # cp_method=ulysses / usp: run each attention's heads in this many groups, one after another, forward and
    # backward (automodel.distributed.cp.head_chunks; exact): 1 = all at once, auto = picked from the memory plan
    ulysses_head_chunks: int | Literal["auto"] = 1


@dataclass
class ModelSection:
    """Which model to train: pretrained weights, or a config built from scratch (``from_config``)."""

    pretrained_model_name_or_path: str | None = None
    config: TargetNode | None = None  # e.g. {_target_: transformers.LlamaConfig, hidden_size: 64, ...}
    config_overrides: dict | None = (
        None  # fields changed on the (pretrained or inline) config, e.g. rope_scaling
    )
    dtype: DType = "float32"  # dtype of the master weights
    attn_implementation: str | None = None  # None: "sdpa" (required by ring CP; ulysses: the inner kernel)
    # The CUDA attention kernel: auto (torch's pick for the GPU) | flash | cudnn | efficient | flex | math
    # (automodel.distributed.cp.attention_kernels; the memory plan counts the kernel's backward buffers)
    attention_backend: str = "auto"
    # cuDNN's packed-row calls for thd's, thd_docs' and usp's block sets (one call for every diagonal block of a layer,
    # one for every prefix block; torch >= 2.14 with cuDNN >= 9.18 on Hopper / Blackwell): fewer kernel launches, but
    # token-major copies of the row's K/V and their gradients (the memory plan counts them). false: one cuDNN call per
    # block instead, as on older torch (automodel.distributed.cp.block_sets; docs/gpu.md)
    cudnn_packed_blocks: bool = True
    activation_checkpointing: bool = False
    # Sequence-tiled MLP (automodel.models.tiled_mlp): false | true (tile picked from hidden and MLP sizes) | tokens per tile;
    # with it (or tiled_layer) the final norm runs in token tiles too (tile_final_norms; not under TP)
    tiled_mlp: bool | int = False
    # Decoder layer tiled end to end (automodel.models.tiled_layer): norms, q/k/v/o projections, MLP and residuals over
    # token tiles, the attention core on whole rows: false | true (tiles of at most hidden tokens) | tokens per tile
    tiled_layer: bool | int = False
    # Attention heads in G groups of whole KV heads, one at a time, without CP (cp_size 1; under ulysses / usp use
    # distributed.ulysses_head_chunks): null (off) | auto (picked from the memory plan) | G
    # (automodel.models.attention_head_chunks; exact; the backward recomputes each group's attention forward)
    attention_head_chunks: int | Literal["auto"] | None = None
    # The layer inputs that activation checkpointing keeps live in host memory (needs activation_checkpointing)
    activation_offload: bool = False
    # Checkpoint groups (automodel.models.checkpoint_groups): only every k-th layer's input is kept (and offloaded), the
    # ones between rebuilt from it in the backward (one more forward of k - 1 of every k layers): 1 (every layer keeps
    # its input) | k >= 2 | auto (the fewest layers per group whose planned host memory fits the node); needs
    # activation_checkpointing
    checkpoint_group_layers: int | Literal["auto"] = 1
    compile: bool = False  # torch.compile each decoder block (static shapes; CP attention outside the graph)
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # model.compile and compiled autograd
    trust_remote_code: bool = False
    revision: str | None = None
    allow_download: bool = False  # false: hub ids (model and data.tokenizer) from the local cache only
    # true: train a RoPE model on a data.seq_len past its max_position_embeddings without a RoPE scaling
    # (positions it never saw, extrapolated); false refuses such a run (automodel.models.loader.position_problem)
    allow_position_extrapolation: bool = False


@dataclass
class FSDPSection:
    """FSDP2 (``fully_shard``) over the ``dp_shard_cp`` mesh, with a mixed-precision policy."""

    enabled: bool = True  # false: replicated parameters, gradients all-reduced (sum) over dp x cp after backward
    param_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    reduce_dtype: DType = "float32"
    reshard_after_forward: bool = True
    offload: Literal[False, "optimizer", "all"] = False  # optimizer: optimizer state and step on the host; all: parameters too


@dataclass
class DataSection:
    """Datasets and batching. ``seq_len``/``tokenizer`` are passed to the dataset targets."""

    dataset: TargetNode = field(
        default_factory=lambda: TargetNode({"_target_": "automodel.data.text_dataset.TextDataset"})
    )
    validation_dataset: TargetNode | None = None  # None: data.dataset with split=validation_split
    train_split: str = "train"
    validation_split: str | None = "validation"  # None: no validation
    tokenizer: str | None = None  # None: the model's own (model.pretrained_model_name_or_path), else the shipped one
    seq_len: int = 512
    pad_to_multiple_of: int | None = None  # None: 2*cp_size (ring, thd) or cp_size (ulysses), *tp_size with sequence_parallel
    shuffle: bool = True
    drop_last: bool = True


@dataclass
class StepSchedulerSection:
    """Batch sizes, step counts and how often to validate / checkpoint."""

    global_batch_size: int = 8  # rows per optimizer step, over all data-parallel ranks
    local_batch_size: int = 1  # rows per forward on one data-parallel rank
    max_steps: int = 100
    val_every_steps: int | None = None
    val_max_batches: int | None = None  # global batches (of global_batch_size rows) per validation; None: all
    ckpt_every_steps: int | None = None


@dataclass
class ClipGradSection:
    max_norm: float | None = 1.0  # None: no clipping (the norm is still reported)
    norm_type: float = 2.0


@dataclass
class CheckpointSection:
    """Sharded checkpoints (torch.distributed.checkpoint) and resuming."""

    enabled: bool = True
    dir: str | None = None  # None: <run dir>/checkpoints
    resume: bool | Literal["auto"] = False  # true: latest checkpoint must exist; auto: if any (same config hash)
    resume_from: str | None = None  # a step_<N> directory; overrides the search
    save_final: bool = True
    save_on_sigterm: bool = True
    keep_last: int | None = 2  # None: keep all
    allow_schedule_change: bool = False  # resume with another max_steps / optimizer.lr / lr_scheduler (else refused)


@dataclass
class ExportSection:
    """A Hugging Face directory (``save_pretrained``, safetensors) written at the end."""

    enabled: bool = True
    dir: str | None = None  # None: <run dir>/hf_model
    dtype: DType | None = None  # None: the training dtype (model.dtype)
    save_tokenizer: bool = True
    merge_lora: bool = False  # with peft: also write <dir>/merged, the model with the adapters merged in


@dataclass
class WandbSection:
    """Weights & Biases tracking (the ``wandb`` extra); absent/null: off."""

    project: str = "automodel"
    mode: Literal["offline", "online"] = "offline"  # offline: files under <run dir>/wandb, `wandb sync` later
    name: str | None = None  # None: recipe.name
    entity: str | None = None


@dataclass
class LoggingSection:
    progress_bar: bool = True  # a tqdm bar, only when stderr is a terminal
    plot: bool = True
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_every_steps: int | None = 10  # a plain step line (loss, lr, tokens/s, grad norm, memory); null: off
    tensorboard: bool = False  # event files in <run dir>/tensorboard (the tensorboard extra)
    wandb: WandbSection | None = None  # e.g. {project: my-proj, mode: offline}


@dataclass
class LossSection:
    """How the loss is computed (always: CE sum over label tokens / global label-token count)."""

    # chunked linear CE: LM head + CE this many tokens at a time; null: off (the plain loss); auto: on (1024 tokens)
    # when the plain logits and loss would be more than 25% of the step's memory peak, else off, and off under
    # tensor parallelism (loss parallel instead); resolved at the start of the run and in the dry run
    chunk_tokens: int | Literal["auto"] | None = "auto"


@dataclass
class PeftSection:
    """Parameter-efficient fine-tuning with the ``peft`` library (automodel.models.lora); absent/null: off."""

    method: Literal["lora"] = "lora"
    r: int = 8  # LoRA rank
    alpha: int = 16  # lora_alpha: the update is scaled by alpha / r
    dropout: float = 0.0  # lora_dropout on the adapter input
    target_modules: list[str] | str = "all-linear"  # module names (suffix match), a regex, or all-linear


@dataclass
class RecipeConfig:
    """A whole fine-tuning config, after validation."""

    recipe: RecipeSection = field(default_factory=RecipeSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    model: ModelSection = field(default_factory=ModelSection)
    fsdp: FSDPSection = field(default_factory=FSDPSection)
    data: DataSection = field(default_factory=DataSection)
    step_scheduler: StepSchedulerSection = field(default_factory=StepSchedulerSection)
    optimizer: TargetNode = field(
        default_factory=lambda: TargetNode(
            {"_target_": "torch.optim.AdamW", "lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.0}
        )
    )
    lr_scheduler: TargetNode = field(
        default_factory=lambda: TargetNode(
            {
                "_target_": "automodel.training.lr_schedule.warmup_cosine",
                "warmup_steps": 0,
                "min_lr_ratio": 0.1,
            }
        )
    )
    clip_grad: ClipGradSection = field(default_factory=ClipGradSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    export: ExportSection = field(default_factory=ExportSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    loss: LossSection = field(default_factory=LossSection)
    peft: PeftSection | None = None


# key path of a TargetNode -> keyword arguments the recipe passes when it instantiates it
RECIPE_SUPPLIED_KWARGS: dict[str, tuple[str, ...]] = {
    "model.config": (),
    "data.dataset": ("tokenizer", "seq_len", "split"),
    "data.validation_dataset": ("tokenizer", "seq_len", "split"),
    "optimizer": ("params",),
    "lr_scheduler": ("optimizer", "total_steps"),
}
# where the user sets what the recipe supplies (for the error message)
RECIPE_SUPPLIED_SOURCE: dict[str, str] = {
    "tokenizer": "data.tokenizer",
    "seq_len": "data.seq_len",
    "split": "data.train_split / data.validation_split",
    "params": "(the model's parameters)",
    "optimizer": "(the optimizer)",
    "total_steps": "step_scheduler.max_steps",
}
