"""Load a tokenizer: the shipped offline default, a local directory, or a Hugging Face hub id."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from automodel.errors import UserInputError

__all__ = ["load_tokenizer", "default_tokenizer_dir", "assets_dir", "ensure_pad_token"]

DEFAULT_NAMES = (None, "default")


def assets_dir() -> Path:
    """Directory of the package data shipped with ``automodel.data`` (tokenizer, corpora)."""
    return Path(str(resources.files("automodel.data") / "assets"))


def default_tokenizer_dir() -> Path:
    """Directory of the shipped byte-level BPE tokenizer (vocab 1024, ChatML chat template)."""
    return assets_dir() / "tokenizer"


def _looks_like_path(name: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else with separators is meant as a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


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


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer without surprises.

    Args:
        name_or_path: ``None`` or ``"default"``: the tokenizer shipped in
            ``automodel/data/assets/tokenizer`` (no download). A local directory: loaded with
            ``AutoTokenizer.from_pretrained``. Anything else: a hub id, resolved by
            ``huggingface_hub`` (which honours ``HF_HUB_OFFLINE=1`` and the local cache).

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
    if path.exists() or _looks_like_path(name):
        raise UserInputError(
            f"tokenizer path {name!r} is not a directory; it must be a directory holding tokenizer.json "
            "(as written by save_pretrained), a hub id such as 'gpt2', or 'default' for the shipped tokenizer"
        )
    try:
        tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = (
            "HF_HUB_OFFLINE is set, so only the local cache is searched: download it first on a machine "
            "with network access (`hf download " + name + "`) or pass a local directory"
            if offline
            else "check the hub id, or pass a local directory, or 'default' for the shipped tokenizer"
        )
        raise UserInputError(
            f"could not load tokenizer {name!r}: {exc.__class__.__name__}: {str(exc).strip().rstrip('.')}. {hint}"
        ) from exc
    return ensure_pad_token(tok)
