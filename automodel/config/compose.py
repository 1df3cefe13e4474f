"""The ``--config`` shim: command line -> one composed, resolved config mapping.

``recipes/finetune.py --config configs/cp.yaml distributed.cp_size=4 +new.key=1 ~key`` — a YAML
file and Hydra overrides after it. Hydra's own command line (``@hydra.main``) would read
``--config`` as one of its flags and create one output directory per process, so this module uses
the Compose API instead: the config file becomes an absolute config directory plus a config name,
``hydra.initialize_config_dir`` + ``hydra.compose`` apply the overrides with Hydra's grammar (a
config may use a ``defaults:`` list with other YAMLs of its directory), and OmegaConf resolves
interpolations. Nothing here depends on the working directory except the ``--config`` path itself.

Inheritance from anywhere: a ``defaults:`` entry is looked up in the config's own directory first,
then in the shipped ``configs/`` (``hydra.searchpath``), so ``/somewhere/my_sft.yaml`` may start with
``defaults: [cp, _self_]``.

A model of another class replaces the inherited ``model.config`` whole instead of merging with it, as a
Hydra config group would (``model_inherit.py``); a model of the same class merges as Hydra does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from automodel.config.model_inherit import model_replacement_overrides
from automodel.config.typecheck import ConfigError

__all__ = ["USAGE", "REPO_ROOT", "DEFAULT_CONFIG", "parse_argv", "resolve_config_path", "compose_config"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "cp.yaml"

USAGE = """\
usage: [torchrun --nproc-per-node N] recipes/finetune.py [--config PATH] [OVERRIDE ...]

  --config PATH   a recipe YAML (default: configs/cp.yaml). A relative path is looked up from the
                  working directory, then from the repository root and its configs/ directory.
  OVERRIDE        Hydra override grammar: key=value (change), +key=value (add), ~key (delete),
                  e.g. distributed.cp_size=4 step_scheduler.max_steps=20 recipe.dry_run=true
Every key is described in docs/recipe.md.
"""


def parse_argv(argv: Sequence[str]) -> tuple[str | None, list[str], bool]:
    """Split a command line into ``(config path or None, overrides, wants_help)``.

    Raises:
        ConfigError: ``--config`` given twice or without a value, or an unknown ``--flag``.
    """
    config: str | None = None
    overrides: list[str] = []
    wants_help = False
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-h", "--help"):
            wants_help = True
        elif arg in ("--config", "-c", "--config-file"):
            if i + 1 >= len(args):
                raise ConfigError([f"{arg} needs a path, e.g. {arg} configs/cp.yaml"])
            if config is not None:
                raise ConfigError([f"--config given twice ({config!r} and {args[i + 1]!r}); give one"])
            config = args[i + 1]
            i += 1
        elif arg.startswith("--config="):
            if config is not None:
                raise ConfigError([f"--config given twice ({config!r} and {arg[9:]!r}); give one"])
            config = arg.split("=", 1)[1]
        elif arg.startswith("--"):
            raise ConfigError(
                [
                    f"unknown flag {arg!r}; this recipe takes --config PATH and key=value overrides (see --help)"
                ]
            )
        else:
            overrides.append(arg)
        i += 1
    return config, overrides, wants_help


def resolve_config_path(config: str | None) -> Path:
    """The absolute path of the YAML ``config`` names (``None``: configs/cp.yaml).

    Raises:
        ConfigError: no such file (the message lists where it looked).
    """
    if config is None:
        return DEFAULT_CONFIG
    p = Path(os.path.expanduser(config))
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, REPO_ROOT / p, REPO_ROOT / "configs" / p]
    if not p.suffix:
        candidates += [c.with_suffix(".yaml") for c in candidates]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    looked = ", ".join(str(c) for c in candidates)
    raise ConfigError([f"--config {config}: no such file (looked at {looked})"])


def compose_config(config_path: Path, overrides: Sequence[str]) -> dict[str, Any]:
    """Compose ``config_path`` with Hydra ``overrides``; return the resolved plain mapping.

    Raises:
        ConfigError: a config file that is not valid YAML, a malformed override, an override of a key
            that does not exist (without ``+``), a deletion of a missing key, a failed interpolation,
            or a ``???`` value left unset.
    """
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    search = _search_path(config_path, overrides)
    base = None
    name = config_path.stem
    try:
        with initialize_config_dir(config_dir=str(config_path.parent), version_base="1.3", job_name="finetune"):
            # a parent's model.config never merges into a model of another class (model_inherit.py)
            deleted = model_replacement_overrides(name, search, overrides, config_path)
            search = [*search, *deleted]
            replaced = [d[1:] for d in deleted]
            # one composition where it suffices: every schema key set with ++ (the same update as key=value where
            # the YAML has it); only an override Hydra refuses needs the YAML composed alone, to tell a key it lacks
            # that a _target_ takes (then ++ too) from a mistake, and to name the nearest key in the message
            fast = _schema_overrides(None, overrides, replaced)
            try:
                cfg = compose(config_name=name, overrides=[*search, *fast])
            except (HydraException, OmegaConfBaseException):
                base = compose(config_name=name, overrides=search)
                overrides = _schema_overrides(base, overrides, replaced)
                cfg = compose(config_name=name, overrides=[*search, *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError([_hydra_message(e, overrides, base, config_path)]) from None
    except yaml.YAMLError as e:  # a config file (or a parent in its defaults) that does not parse
        raise ConfigError([_yaml_message(e, config_path)]) from None
    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(
            [f"{key or 'config'}: {str(e).splitlines()[0]} (set it with {key or 'key'}=...)"]
        ) from None
    assert isinstance(container, dict)
    return container


SHIPPED_CONFIGS = REPO_ROOT / "configs"


def _yaml_message(e: Exception, config_path: Path) -> str:
    """One line for a YAML file that does not parse: the file, the line and column, what is wrong."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = str(config_path)
    if mark is not None:
        name = mark.name if mark.name and not mark.name.startswith("<") else config_path  # "<file>": a stream
        where = f"{name}, line {mark.line + 1}, column {mark.column + 1}"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return (
        f"{where}: not valid YAML ({problem}); fix the file there (each key once per mapping, "
        "nested keys indented alike, `key: value` with a space after the colon)"
    )


def _search_path(config_path: Path, overrides: Sequence[str]) -> list[str]:
    """The override that lets a config's ``defaults`` name the shipped configs from any directory.

    Hydra looks in the config's own directory first, then in ``hydra.searchpath``: the shipped
    ``configs/``. Nothing is added for a config inside ``configs/`` or when the user sets
    ``hydra.searchpath`` themselves.
    """
    if config_path.parent.resolve() == SHIPPED_CONFIGS.resolve() or any(
        o.lstrip("+~").startswith("hydra.searchpath") for o in overrides
    ):
        return []
    return [f"hydra.searchpath=[file://{SHIPPED_CONFIGS.resolve()}]"]


def _schema_overrides(base: Any, overrides: Sequence[str], replaced: Sequence[str] = ()) -> list[str]:
    """Let ``key=value`` set a schema key that the YAML leaves at its default.

    Hydra only changes keys present in the composed YAML (others need ``+``). A key of the schema
    (``recipe.dry_run``, ``export.enabled``, ...) is always legitimate, so such an override becomes
    ``++key=value``. Unknown keys are left alone: Hydra (or the schema check, for ``+key``) rejects them.
    ``replaced``: dotted keys of nodes taken out for a model of another class (``model_inherit.py``): a key
    set inside one is the user's own for the new class (``++``); a deletion inside one has nothing to delete.
    ``base``: the YAML composed without the command line's overrides; ``None``: not composed, so every schema key
    set with ``key=value`` becomes ``++`` (for a key the YAML has, the same update) and the keys a ``_target_``
    takes are left alone.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    out = []
    for raw, o in zip(overrides, parsed):
        key = o.key_or_group
        inside = any(key == r or key.startswith(r + ".") for r in replaced)
        if inside and o.is_delete():
            continue
        if inside and not o.is_add() and not o.is_force_add() and o.package is None:
            raw = "++" + raw
        elif (
            not o.is_delete()
            and not o.is_add()
            and not o.is_force_add()
            and o.package is None
            and (base is None or OmegaConf.select(base, key, default=_MISSING) is _MISSING)
            and (schema_key_exists(key) or (base is not None and _target_takes(base, key)))
        ):
            raw = "++" + raw
        out.append(raw)
    return out


_MISSING = object()


def _target_keys(base: Any, parent: str) -> set[str] | None:
    """The keyword arguments of the ``_target_`` of node ``parent`` in ``base`` (None: no such node,
    the target cannot be imported, or it takes any keyword)."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.select(base, parent, default=None) if parent else None
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    from automodel.config.typecheck import _accepted_keys, _locate

    try:
        accepted, _, _ = _accepted_keys(_locate(node["_target_"]))
    except Exception:  # noqa: BLE001 - the target check reports an unimportable target
        return None
    return accepted


def _target_takes(base: Any, key: str) -> bool:
    """Whether ``key`` (dotted) is an argument of the ``_target_`` of its parent node in ``base``."""
    parent, _, leaf = key.rpartition(".")
    accepted = _target_keys(base, parent)
    return accepted is not None and leaf in accepted


def schema_key_exists(path: str) -> bool:
    """Whether dotted ``path`` names a field of the schema (inside ``_target_`` nodes: no)."""
    import dataclasses
    import typing

    from automodel.config.schema import RecipeConfig

    tp: Any = RecipeConfig
    for part in path.split("."):
        if typing.get_origin(tp) is not None and not dataclasses.is_dataclass(tp):
            args = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
            tp = args[0] if args else None
        if tp is None or not dataclasses.is_dataclass(tp):
            return False
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return False
        tp = hints[part]
    return True


def suggest_schema_key(path: str) -> str | None:
    """The schema key closest to a misspelt dotted ``path`` (same group), or None."""
    import dataclasses
    import difflib
    import typing

    from automodel.config.schema import RecipeConfig

    parts = path.split(".")
    tp: Any = RecipeConfig
    for part in parts[:-1]:
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            return None
        tp = hints[part]
    if not dataclasses.is_dataclass(tp):
        return None
    names = [f.name for f in dataclasses.fields(tp)]
    close = difflib.get_close_matches(parts[-1], names, n=1, cutoff=0.6)
    return ".".join([*parts[:-1], close[0]]) if close else None


def suggest_key(path: str, base: Any = None) -> str | None:
    """The key closest to a misspelt dotted ``path``: among the schema's fields, the keys of the
    composed config ``base`` at the same level, and the arguments of that node's ``_target_``."""
    import difflib

    from omegaconf import DictConfig, OmegaConf

    hint = suggest_schema_key(path)
    if hint is not None or base is None:
        return hint
    parent, _, leaf = path.rpartition(".")
    node = OmegaConf.select(base, parent, default=None) if parent else base
    names = {str(k) for k in node.keys()} if isinstance(node, DictConfig) else set()
    names |= _target_keys(base, parent) or set()
    names.discard("_target_")
    close = difflib.get_close_matches(leaf, sorted(names), n=1, cutoff=0.6)
    return f"{parent}.{close[0]}" if close and parent else (close[0] if close else None)


def _hydra_message(e: Exception, overrides: Sequence[str], base: Any = None, config_path: Path | None = None) -> str:
    import re

    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    cause = e.__cause__
    if cause is not None and str(cause) and str(cause) not in text:
        text += " (" + " ".join(str(cause).split()) + ")"
    m = re.search(r"Could not (?:override|delete from config)\.? '([^']+)'", text)
    if m:  # Hydra's own advice ("To append to your config use +key=...") is left out: the schema
        key = m.group(1)  # would reject the key (a key the schema or a _target_ takes is added already)
        hint = suggest_key(key, base)
        extra = f"did you mean '{hint}'? " if hint else ""
        return f"{key}: unknown key; {extra}check the spelling (every key: docs/recipe.md)"
    m = re.search(r"Could not load '([^']+)'", text)
    if m and config_path is not None:
        where = [str(config_path.parent)]
        if config_path.parent.resolve() != SHIPPED_CONFIGS.resolve():
            where.append(str(SHIPPED_CONFIGS))
        return (
            f"{config_path.name}: defaults entry '{m.group(1)}' not found; a config's defaults are looked up "
            f"in {' and then '.join(where)} (e.g. defaults: [cp, _self_])"
        )
    return f"could not apply the overrides {list(overrides)}: {text}"
