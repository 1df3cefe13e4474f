"""Check a plain config mapping against the dataclass schema and build the typed config.

:func:`to_dataclass` walks a dataclass type and a mapping together and collects every problem
(unknown key, wrong type, bad ``_target_``) instead of stopping at the first, so one run of the
recipe reports everything that is wrong. Each problem names the full key (``step_scheduler.max_steps``)
and what to do about it. Nothing here imports torch or builds a model.

Type rules: ``int`` accepts ints (not bools); ``float`` accepts ints and floats; ``bool`` only
``true``/``false``; ``Literal[...]`` one of the listed values; ``X | None`` also ``null``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

from automodel.config.schema import RECIPE_SUPPLIED_KWARGS, RECIPE_SUPPLIED_SOURCE, TargetNode

__all__ = ["ConfigError", "to_dataclass", "check_target_node", "describe_type"]

# keys Hydra's instantiate understands in any _target_ node
HYDRA_NODE_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")


class ConfigError(ValueError):
    """The config is invalid. ``problems`` lists every problem, each naming the key and the fix."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        if len(self.problems) == 1:  # one problem: one line (the recipe prints it as ``error: ...``)
            super().__init__(self.problems[0])
            return
        super().__init__(f"invalid config ({len(self.problems)} problems):\n{lines}")


class _Invalid:
    pass


_INVALID = _Invalid()


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def describe_type(tp: Any) -> str:
    """Human wording of a schema type: ``int``, ``float or null``, ``one of 'a', 'b'``."""
    if tp is TargetNode:
        return "a mapping with _target_"
    if _is_union(tp):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(_yaml(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = typing.get_origin(tp)
    if origin in (list, Sequence):
        return "a list"
    if origin in (dict, Mapping) or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def _check(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Return ``value`` converted to ``tp`` (float for ints where float is asked), or ``_INVALID``."""
    if tp is Any:
        return value
    if tp is TargetNode:
        if not isinstance(value, Mapping):
            problems.append(f"{path}: expected a mapping with _target_, got {_yaml(value)}")
            return _INVALID
        return TargetNode(check_target_node(dict(value), path, problems))
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            problems.append(f"{path}: must be set (expected {describe_type(tp)}), got null")
            return _INVALID
        # A mapping goes to the one mapping-like member (to report its inner problems in detail).
        for arg in args:
            if arg is type(None):
                continue
            if isinstance(value, Mapping) and (dataclasses.is_dataclass(arg) or arg is TargetNode):
                return _check(arg, value, path, problems)
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            out = _check(arg, value, path, trial)
            if not trial:
                return out
        problems.append(f"{path}: expected {describe_type(tp)}, got {_yaml(value)} ({type(value).__name__})")
        return _INVALID
    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if type(choice) is type(value) and choice == value:
                return value
        problems.append(f"{path}: {_yaml(value)} is not allowed; expected {describe_type(tp)}")
        return _INVALID
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            problems.append(f"{path}: expected a mapping (group of keys), got {_yaml(value)}")
            return _INVALID
        return _build(tp, value, path, problems)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif typing.get_origin(tp) in (list, Sequence) or tp is list:
        if isinstance(value, (list, tuple)):
            (item_tp,) = typing.get_args(tp) or (Any,)
            out = [_check(item_tp, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]
            return _INVALID if any(o is _INVALID for o in out) else out
    elif typing.get_origin(tp) in (dict, Mapping) or tp is dict:
        if isinstance(value, Mapping):
            return dict(value)
    else:  # pragma: no cover - schema uses only the types above
        raise TypeError(f"schema type {tp!r} at {path} is not supported by the config checker")
    example = {bool: "true", int: "8", float: "0.001", str: "some_text"}.get(tp, "...")
    problems.append(
        f"{path}: expected {describe_type(tp)}, got {_yaml(value)} ({type(value).__name__}); e.g. {path}={example}"
    )
    return _INVALID


def _unknown_key_message(path: str, key: str, known: Sequence[str], what: str) -> str:
    full = f"{path}.{key}" if path else key
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean '{(path + '.') if path else ''}{close[0]}'? " if close else ""
    return f"{full}: unknown key ({what}); {hint}remove it or fix the spelling. Known keys: {', '.join(sorted(known))}"


def _build(cls: type, data: Mapping, path: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            problems.append(
                _unknown_key_message(path, str(key), list(fields), f"not a key of '{path or 'the config'}'")
            )
    kwargs = {}
    for name in fields:
        if name not in data:
            continue  # default
        sub = f"{path}.{name}" if path else name
        value = _check(hints[name], data[name], sub, problems)
        if value is not _INVALID:
            kwargs[name] = value
    return cls(**kwargs)


def to_dataclass(cls: type, data: Mapping, problems: list[str] | None = None) -> Any:
    """Build ``cls`` (a schema dataclass) from a plain mapping; raise :class:`ConfigError` on problems.

    If ``problems`` is given, problems are appended to it and nothing is raised (the caller adds
    its own checks and raises once).
    """
    own = [] if problems is None else problems
    out = _build(cls, data, "", own)
    if problems is None and own:
        raise ConfigError(own)
    return out


# ---------------------------------------------------------------------------------------------
# _target_ nodes
# ---------------------------------------------------------------------------------------------


def _locate(target: str) -> Any:
    from hydra.utils import get_object

    return get_object(target)


def _accepted_keys(obj: Any) -> tuple[set[str] | None, set[str], dict[str, Any]]:
    """(accepted keyword names or None if any is accepted, required names, type hints)."""
    fn = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None, set(), {}
    params = {
        n: p
        for n, p in sig.parameters.items()
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) and n != "self"
    }
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - hints are a best-effort extra check
        hints = {}
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    if inspect.isclass(obj) and _is_hf_config_class(obj):
        # transformers configs take **kwargs and would silently keep a misspelt key as an attribute
        keys = set(params) | set(obj().to_dict())
        if "rope_parameters" in keys:
            keys |= {"rope_theta", "rope_scaling"}  # legacy names transformers converts
        return keys, set(), hints
    return (None if open_kwargs else set(params)), required, hints


def _is_hf_config_class(cls: type) -> bool:
    return any(
        base.__name__ == "PreTrainedConfig" or base.__name__ == "PretrainedConfig"
        for base in inspect.getmro(cls)
        if base.__module__.startswith("transformers")
    )


_SCALARS = (int, float, bool, str, type(None))


def _scalar_kinds(hint: Any) -> tuple[type, ...] | None:
    """The scalar types a hint allows, or None if it allows something we do not check."""
    args = typing.get_args(hint) if _is_union(hint) else (hint,)
    kinds = []
    for a in args:
        if a in _SCALARS:
            kinds.append(a)
        elif getattr(a, "__name__", "") == "Tensor":
            continue  # e.g. AdamW's lr: float | Tensor
        else:
            return None
    return tuple(kinds) or None


def _matches(value: Any, kinds: tuple[type, ...]) -> bool:
    for k in kinds:
        if k is type(None) and value is None:
            return True
        if k is bool and isinstance(value, bool):
            return True
        if k is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if k is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if k is str and isinstance(value, str):
            return True
    return False


def check_target_node(node: dict, path: str, problems: list[str]) -> dict:
    """Check a ``_target_`` node: importable target, keys it accepts, simple value types.

    Keys the recipe supplies itself (``RECIPE_SUPPLIED_KWARGS[path]``, e.g. ``seq_len`` for a
    dataset) must not be set in the node. Returns ``node`` (unchanged).
    """
    target = node.get("_target_")
    if not isinstance(target, str) or not target:
        problems.append(f"{path}._target_: missing; set it to the import path of a class or function")
        return node
    try:
        obj = _locate(target)
    except Exception as e:  # noqa: BLE001 - any import failure is a config problem
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        problems.append(
            f"{path}._target_: cannot import '{target}' ({msg}); check the spelling of the import path"
        )
        return node
    if not callable(obj):
        problems.append(f"{path}._target_: '{target}' is not callable")
        return node
    accepted, required, hints = _accepted_keys(obj)
    supplied = RECIPE_SUPPLIED_KWARGS.get(path, ())
    for key, value in node.items():
        if key in HYDRA_NODE_KEYS:
            continue
        if key in supplied:
            problems.append(
                f"{path}.{key}: set by the recipe (from {RECIPE_SUPPLIED_SOURCE.get(key, 'the recipe')}); "
                f"remove it from {path}"
            )
            continue
        if accepted is not None and key not in accepted:
            problems.append(
                _unknown_key_message(
                    path, key, sorted(accepted - set(supplied)), f"'{target}' takes no '{key}'"
                )
            )
            continue
        kinds = _scalar_kinds(hints.get(key)) if key in hints else None
        if kinds is not None and not _matches(value, kinds):
            want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            problems.append(f"{path}.{key}: expected {want} (argument of '{target}'), got {_yaml(value)}")
    if not node.get("_partial_", False):
        missing = sorted(r for r in required if r not in node and r not in supplied)
        for key in missing:
            problems.append(f"{path}.{key}: required by '{target}' but not set; add {path}.{key}=...")
    return node
