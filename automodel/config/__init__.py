"""Recipe configuration: the ``--config`` shim, the typed schema and its validation.

    loaded = load_config(["--config", "configs/cp.yaml", "distributed.cp_size=4"])
    loaded.cfg.distributed.cp_size   # 4, typed (RecipeConfig)
    loaded.raw                       # the resolved plain mapping (what gets saved with the run)

Every problem (unknown key, wrong type, impossible combination) is reported at once as a
:class:`ConfigError` before any process group or model exists.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from automodel.config.compose import USAGE, compose_config, parse_argv, resolve_config_path
from automodel.config.gpu_specs import gpu_problems
from automodel.config.plan_layouts import plan_layout_problems
from automodel.config.positions import inline_position_problems
from automodel.config.rules import check_rules, parallel_sizes
from automodel.config.schedule_rules import schedule_problems
from automodel.config.schema import RecipeConfig
from automodel.config.typecheck import ConfigError, to_dataclass

__all__ = [
    "USAGE",
    "ConfigError",
    "LoadedConfig",
    "RecipeConfig",
    "load_config",
    "effective_config",
    "validate_config",
    "planned_world_size",
    "parallel_sizes",
]


@dataclass
class LoadedConfig:
    """A validated config. ``raw`` is the resolved mapping, ``path`` the YAML it came from."""

    cfg: RecipeConfig
    raw: dict[str, Any]
    path: Path | None
    world_size: int

    @property
    def effective(self) -> dict[str, Any]:
        """Every key with its value in effect (the YAML plus the schema defaults it leaves out)."""
        return effective_config(self.cfg)


def effective_config(cfg: RecipeConfig) -> dict[str, Any]:
    """``cfg`` as a plain nested mapping, defaults included (what a run saves as config.yaml)."""
    return dataclasses.asdict(cfg)


def planned_world_size(cfg: RecipeConfig, env_world_size: int | None = None) -> int:
    """The world size a run (or a dry run) of ``cfg`` is checked against.

    A real run: ``$WORLD_SIZE`` (1 without torchrun). A dry run: ``recipe.dry_run_world_size``,
    else ``recipe.plan_nnodes * recipe.plan_nproc_per_node`` when both are set, else ``$WORLD_SIZE``
    if launched by torchrun, else ``recipe.gpus`` (the GPUs the config is written for), else the
    smallest world the fixed sizes need.
    """
    if env_world_size is None and "WORLD_SIZE" in os.environ:
        env_world_size = int(os.environ["WORLD_SIZE"])
    if not cfg.recipe.dry_run:
        return env_world_size or 1
    if cfg.recipe.dry_run_world_size is not None:
        return cfg.recipe.dry_run_world_size
    if cfg.recipe.plan_nnodes is not None and cfg.recipe.plan_nproc_per_node is not None:
        return cfg.recipe.plan_nnodes * cfg.recipe.plan_nproc_per_node
    if env_world_size is not None:
        return env_world_size
    if cfg.recipe.gpus is not None:
        return cfg.recipe.gpus
    d = cfg.distributed
    return max(1, d.dp_replicate) * max(1, d.dp_shard) * max(1, d.cp_size) * max(1, d.tp_size)


def validate_config(
    raw: dict[str, Any], world_size: int | None = None, cuda_available: bool | None = None
) -> tuple[RecipeConfig, int]:
    """Type-check ``raw`` against the schema, then the cross-key rules; return ``(cfg, world_size)``.

    ``world_size=None`` takes it from :func:`planned_world_size`. Raises :class:`ConfigError`
    listing every problem.
    """
    problems: list[str] = []
    cfg = to_dataclass(RecipeConfig, raw, problems)
    if problems:  # rules would run on defaults standing in for the bad values: report types first
        raise ConfigError(problems)
    world = world_size if world_size is not None else planned_world_size(cfg)
    problems += check_rules(cfg, world, cuda_available=cuda_available)
    problems += schedule_problems(cfg) + gpu_problems(cfg) + plan_layout_problems(cfg, world)
    if not problems:  # an inline model.config's positions against data.seq_len (a pretrained one: the model checks)
        problems += inline_position_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg, world


def load_config(
    argv: Sequence[str], world_size: int | None = None, cuda_available: bool | None = None
) -> LoadedConfig:
    """Parse ``--config PATH [overrides]``, compose with Hydra, validate. Raises :class:`ConfigError`."""
    config, overrides, _ = parse_argv(argv)
    path = resolve_config_path(config)
    raw = compose_config(path, overrides)
    cfg, world = validate_config(raw, world_size=world_size, cuda_available=cuda_available)
    return LoadedConfig(cfg=cfg, raw=raw, path=path, world_size=world)
