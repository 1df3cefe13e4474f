"""A model of another class replaces an inherited ``model.config`` whole; one of the same class merges.

Hydra merges every node of a ``defaults:`` list key by key. For most sections that is what a child
config wants (``step_scheduler.max_steps: 70`` over cp.yaml's schedule), but not for a model of
another class: with ``defaults: [cp, _self_]`` and ``model.config._target_: transformers.Qwen3NextConfig``
the Llama keys of cp.yaml (``rope_theta``, ``tie_word_embeddings``, ``max_position_embeddings``, ...)
would reach the user's model silently, or fail on keys the user never wrote. So ``model.config`` is
composed as a Hydra config group is: the contributions of the defaults list are taken in merge order,
and one whose class differs from what is composed so far replaces it whole; one of the same class (or
one without a class: a few keys changed) merges as before.

The class of a ``model.config`` node is the object its ``_target_`` imports (two paths to one class
are one class) together with its ``model_type`` (for targets such as ``transformers.AutoConfig.for_model``).
The command line is not a parent: ``model.config._target_=...`` there edits the composed config's class
and keeps its other keys (the way the tests swap a tiny model's class and keep its sizes); the
command line's other ``model.config.*`` overrides apply on top as usual. A nested config of the new class
(``vision_config``, ``text_config``: the class's ``sub_configs``) that holds a key the new class's nested
config does not have was written for the old class (Qwen2-VL's ``embed_dim`` and ``mlp_ratio`` under
Qwen2.5-VL, whose ``hidden_size`` means another size): it is replaced with the new class's defaults, keeping
only what the command line sets in it (:func:`swapped_nested_configs`). :func:`model_replacement_overrides`
returns the deletions (``~model.config.key``) that take the inherited keys out, applied before the user's
own overrides (which may set them again).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from automodel.config.typecheck import ConfigError

__all__ = ["model_class", "compose_model_config", "model_replacement_overrides", "swapped_nested_configs"]

logger = logging.getLogger(__name__)

NODE = "model.config"
_ABSENT = object()


def _canonical(target: str) -> str:
    """The import path of the object ``target`` names (``transformers.LlamaConfig`` and
    ``transformers.models.llama.LlamaConfig`` are one class); ``target`` itself when it does not import."""
    from hydra.utils import get_object

    try:
        obj = get_object(target)
    except Exception:  # noqa: BLE001 - an unimportable target is reported by the target check
        return target
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{name}" if module and name else target


def model_class(node: Any) -> tuple[str, str | None] | None:
    """``(class, model_type)`` of a ``model.config`` node (a mapping): the import path of its ``_target_``
    and its ``model_type`` key (None when absent). None: not a mapping, or no ``_target_``."""
    if not isinstance(node, dict):
        return None
    target = node.get("_target_")
    if not isinstance(target, str):
        return None
    model_type = node.get("model_type")
    return _canonical(target), model_type if isinstance(model_type, str) else None


def _name(node: dict) -> str:
    """``_target_`` of a node, with its ``model_type`` in brackets when it has one (for messages)."""
    model_type = node.get("model_type")
    return node["_target_"] if model_type is None else f"{node['_target_']}({model_type})"


def _contribution(body: Any, package: str) -> Any:
    """What one config of the defaults list (its own keys ``body``, placed at ``package``) writes to
    ``model.config``, as plain data with interpolations unresolved: a mapping, None (an explicit null),
    or ``_ABSENT``. A config placed inside ``model.config`` writes a few keys of no class: ``{}``."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(body, DictConfig):
        return _ABSENT
    if package.startswith(NODE + "."):
        return {}
    data = OmegaConf.to_container(body, resolve=False)
    if package:  # the body sits at `package`: walk down to model.config from there
        if not (NODE + ".").startswith(package + "."):
            return _ABSENT
        path = NODE[len(package) + 1 :].split(".") if package != NODE else []
    else:
        path = NODE.split(".")
    for part in path:
        if not isinstance(data, dict) or part not in data:
            return _ABSENT
        data = data[part]
    return data


def _merge(old: Any, new: Any) -> Any:
    """OmegaConf's merge of plain data: mappings merge key by key, anything else replaces."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    out = dict(old)
    for key, value in new.items():
        out[key] = _merge(out[key], value) if key in out else value
    return out


def compose_model_config(contributions: Sequence[tuple[str, Any]]) -> tuple[Any, list[str]]:
    """Fold ``(source name, node)`` contributions to ``model.config`` (plain data) in merge order.

    Returns ``(the composed node, one line per replacement)``: a node whose class differs from the one
    composed so far replaces it; any other merges into it (as OmegaConf merges).
    """
    acc: Any = _ABSENT
    replaced: list[str] = []
    for name, node in contributions:
        new_cls, old_cls = model_class(node), model_class(acc)
        if new_cls is not None and old_cls is not None and new_cls != old_cls:
            replaced.append(f"{name}: {_name(node)} replaces {_name(acc)}")
            acc = node
        else:
            acc = _merge(acc, node)
    return acc, replaced


def _leaked(merged: Any, composed: Any, prefix: str) -> list[str]:
    """Dotted keys of ``merged`` that ``composed`` lacks (a mapping missing whole: its own key only)."""
    out: list[str] = []
    composed = composed if isinstance(composed, dict) else {}
    for key, value in merged.items():
        path = f"{prefix}.{key}"
        if key not in composed:
            out.append(path)
        elif isinstance(value, dict) and isinstance(composed[key], dict):
            out += _leaked(value, composed[key], path)
    return out


def _command_line(overrides: Sequence[str]) -> set[str]:
    """The ``model.config.*`` keys the command line sets or deletes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return {o.key_or_group for o in parsed if o.key_or_group.startswith(NODE + ".")}


def _command_line_target(overrides: Sequence[str]) -> str | None:
    """The class the command line sets with ``model.config._target_=...`` (None: it does not)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    for o in reversed(parsed):
        if o.key_or_group == f"{NODE}._target_" and not o.is_delete():
            value = o.value()
            return value if isinstance(value, str) else None
    return None


def swapped_nested_configs(composed: Any, user_overrides: Sequence[str]) -> list[str]:
    """The nested configs of ``composed`` (the ``model.config`` the config files give, plain data) that a
    class set on the command line replaces: each ``sub_configs`` entry of the new class whose mapping holds a
    key the new class's nested config does not define (it was written for the old class). Returns their
    dotted keys (``model.config.vision_config``); [] when the command line keeps the class."""
    target = _command_line_target(user_overrides)
    old = model_class(composed)
    if target is None or old is None or _canonical(target) == old[0]:
        return []
    from hydra.utils import get_object

    try:
        sub_configs = dict(getattr(get_object(target), "sub_configs", None) or {})
    except Exception:  # noqa: BLE001 - an unimportable target is reported by the target check
        return []
    out = []
    for key, sub_cls in sub_configs.items():
        node = composed.get(key)
        if not isinstance(node, dict) or not isinstance(sub_cls, type):
            continue
        known = set(sub_cls().to_dict())
        foreign = sorted(k for k in node if k not in known and k != "_target_")
        if foreign:
            logger.info(
                "%s=%s: %s.%s holds keys of %s (%s): replaced by %s's defaults and the command line's %s.%s.* keys",
                f"{NODE}._target_", target, NODE, key, _name(composed), ", ".join(foreign), target, NODE, key,
            )  # fmt: skip
            out.append(f"{NODE}.{key}")
    return out


def _without_parents(config_file: Path | None) -> bool:
    """Whether ``config_file`` is a YAML mapping whose ``defaults`` (if any) names no config but ``_self_`` (False when
    unknown or unreadable: the caller then reads the defaults list through Hydra, which reports what is wrong)."""
    if config_file is None:
        return False
    import yaml

    try:
        doc = yaml.safe_load(config_file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    if not isinstance(doc, dict):
        return False
    defaults = doc.get("defaults", [])
    return isinstance(defaults, list) and all(d == "_self_" for d in defaults)


def model_replacement_overrides(
    config_name: str, search: Sequence[str], user_overrides: Sequence[str], config_file: Path | None = None
) -> list[str]:
    """Deletions (``~model.config.key``) of the keys a parent config's ``model.config`` would merge into
    a model of another class. Call inside Hydra's ``initialize_config_dir`` of the primary config.

    Args:
        config_name: the primary config's name (its file's stem).
        search: the overrides that set the search path (``hydra.searchpath=[...]``), as composed.
        user_overrides: the command line's overrides (keys it sets or deletes are not deleted here).
        config_file: the primary config's file, when known: a config without parents whose command line keeps
            the class has nothing to replace, and is answered without reading the defaults list (a Hydra
            composition's worth of time).

    Returns [] when no class changes (same-class inheritance merges as Hydra does).
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    if _command_line_target(user_overrides) is None and _without_parents(config_file):
        return []  # one contribution (the file itself) replaces nothing; no nested config is swapped

    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, list(search), RunMode.RUN).defaults
    # the repository of the composition (search path included): Hydra keeps it behind this method
    make_repo = getattr(loader, "_parse_overrides_and_create_caching_repo", None)
    if make_repo is None:
        raise ConfigError(
            [
                "this Hydra version has no ConfigLoaderImpl._parse_overrides_and_create_caching_repo, which "
                "automodel.config.model_inherit reads the configs of a defaults list with; use hydra-core 1.3"
            ]
        )
    _, repo = make_repo(config_name, list(search))
    contributions: list[tuple[str, Any]] = []
    for d in defaults:
        if d.config_path is None or d.package is None or d.package.split(".")[0] == "hydra":
            continue
        loaded = repo.load_config(d.config_path)
        node = _contribution(loaded.config if loaded is not None else None, d.package)
        if node is not _ABSENT:
            contributions.append((f"{d.config_path}.yaml", node))
    touched = _command_line(user_overrides)
    composed, replaced = compose_model_config(contributions)
    nested = [f"~{k}" for k in swapped_nested_configs(composed, user_overrides)] if isinstance(composed, dict) else []
    merged: Any = _ABSENT
    for _, node in contributions:  # what Hydra composes: every contribution merged
        merged = _merge(merged, node)
    if not replaced or not isinstance(merged, dict):
        return nested
    leaked = [
        k
        for k in _leaked(merged, composed, NODE)
        if k != f"{NODE}._target_"
        and not any(t == k or t.startswith(k + ".") or k.startswith(t + ".") for t in touched)
    ]
    if leaked:
        logger.info(
            "%s: not inherited: %s", "; ".join(replaced), ", ".join(k[len(NODE) + 1 :] for k in leaked)
        )
    return [f"~{k}" for k in leaked] + [k for k in nested if k[1:] not in leaked]
