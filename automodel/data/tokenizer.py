"""Load a tokenizer: the shipped offline default, a local directory, or a Hugging Face hub id."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from automodel.data.hub_offline import (
    local_files_only,
    looks_like_path,
    missing_path_message,
    not_cached_hint,
)
from automodel.errors import UserInputError

__all__ = ["load_tokenizer", "load_run_tokenizer", "own_tokenizer_note", "tokenizer_source", "default_tokenizer_dir", "assets_dir", "ensure_pad_token"]

DEFAULT_NAMES = (None, "default")


def assets_dir() -> Path:
    """Directory of the package data shipped with ``automodel.data`` (tokenizer, corpora)."""
    return Path(str(resources.files("automodel.data") / "assets"))


def default_tokenizer_dir() -> Path:
    """Directory of the shipped byte-level BPE tokenizer (vocab 1024, ChatML chat template)."""
    return assets_dir() / "tokenizer"


def ensure_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Give ``tokenizer`` a pad token if it has none, by reusing its EOS token (mutates ``tokenizer``).

    This never changes a loss: padding always goes at the end of a row with label -100 (see
    ``automodel.data.collator``), so the pad id only fills positions that nothing reads.
    Raises ``ValueError`` if the tokenizer has neither a pad nor an EOS token.
    """
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise UserInputError(
                f"tokenizer {tokenizer.name_or_path!r} has no pad token and no EOS token; the data pipeline "
                "needs an EOS token to separate documents. Use a tokenizer that defines eos_token, or set "
                "tokenizer.eos_token before building datasets"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(
    name_or_path: str | os.PathLike | None = None, allow_download: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer without surprises.

    Args:
        name_or_path: ``None`` or ``"default"``: the tokenizer shipped in
            ``automodel/data/assets/tokenizer`` (no download). A local directory: loaded with
            ``AutoTokenizer.from_pretrained``. Anything else: a hub id, from the local hub cache only
            unless ``allow_download`` (and ``HF_HUB_OFFLINE`` is not set):
            :mod:`automodel.data.hub_offline`.
        allow_download: let ``huggingface_hub`` download a hub id that is not cached (the recipe
            passes ``model.allow_download``).

    Returns:
        The tokenizer, with a pad token (the EOS token is reused when it has none, see
        :func:`ensure_pad_token`).

    Raises:
        ValueError: a path that does not exist, or a hub id that cannot be loaded (offline and not
            cached, or unknown); the message says how to fix it.
    """
    if name_or_path in DEFAULT_NAMES:
        return ensure_pad_token(AutoTokenizer.from_pretrained(str(default_tokenizer_dir())))
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(
            f"tokenizer name_or_path must be a str, a path or None, got {type(name_or_path).__name__} "
            f"({name_or_path!r}); pass a local directory, a hub id, or 'default'"
        )
    name = os.fspath(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
            raise UserInputError(
                f"tokenizer directory {str(path)!r} has no tokenizer.json / tokenizer_config.json; point "
                "data.tokenizer at a directory written by tokenizer.save_pretrained(), or use 'default'"
            )
        return ensure_pad_token(AutoTokenizer.from_pretrained(str(path)))
    if looks_like_path(name):
        raise UserInputError(
            f"tokenizer path {name!r} is not a directory: "
            + missing_path_message(name, "tokenizer.json")
            + ", a hub id such as 'gpt2', or 'default' for the shipped tokenizer"
        )
    offline = local_files_only(allow_download)
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=offline)
    except (OSError, ValueError) as exc:
        # offline, transformers' "couldn't connect to huggingface.co" is not what happened: leave it out
        why = "not in the local hub cache" if offline else f"{exc.__class__.__name__}: {str(exc).strip().rstrip('.')}"
        raise UserInputError(
            f"could not load tokenizer {name!r}: {why}; {not_cached_hint(name, allow_download)}"
        ) from exc
    return ensure_pad_token(tok)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


def tokenizer_source(tokenizer: str | None, pretrained_model: str | None) -> str | None:
    """Where a run's tokenizer comes from: ``data.tokenizer`` when it names one (``"default"``: the shipped
    tokenizer, on purpose); else the model's own (``model.pretrained_model_name_or_path``: a directory or a hub
    id), since a model trained with one tokenizer and fed another's ids trains without an error, on wrong
    tokens; else ``None``, the shipped tokenizer (a model built from a config)."""
    if tokenizer is not None:
        return tokenizer
    return pretrained_model


def own_tokenizer_note(tokenizer: str | None, pretrained_model: str | None) -> str:
    """``" (the model's own)"`` when :func:`tokenizer_source` takes the model's tokenizer, else ``""`` (for logs)."""
    return " (the model's own)" if tokenizer is None and pretrained_model is not None else ""


def load_run_tokenizer(
    tokenizer: str | None, pretrained_model: str | None, allow_download: bool = False
) -> PreTrainedTokenizerBase:
    """:func:`load_tokenizer` of :func:`tokenizer_source`, with the config keys named when the model's own is
    missing.

    Raises:
        UserInputError: ``data.tokenizer`` is null and the model directory holds no tokenizer files (the
            message names both keys and the fix), or what :func:`load_tokenizer` raises.
    """
    source = tokenizer_source(tokenizer, pretrained_model)
    if tokenizer is None and source is not None:
        path = Path(source).expanduser()
        if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise UserInputError(
                f"data.tokenizer is null, so the run uses the model's own tokenizer, but "
                f"model.pretrained_model_name_or_path={source!r} has no tokenizer files "
                f"({' / '.join(_TOKENIZER_FILES)}); set data.tokenizer to the tokenizer the model was trained "
                "with (a directory written by tokenizer.save_pretrained() or a hub id), or data.tokenizer=default "
                "to train it with the shipped tokenizer on purpose"
            )
    return load_tokenizer(source, allow_download=allow_download)
