"""Offline by default: hub ids for models and tokenizers come from the local cache unless allowed.

A cluster node without network access would otherwise spend about a minute in ``huggingface_hub``'s
retries before failing. So the model's config and weights and the tokenizer are looked up with
``local_files_only=True`` unless the config allows downloads (``model.allow_download=true``, which
covers the tokenizer too) and ``HF_HUB_OFFLINE`` is not set. Datasets follow the same rule with
their own key (``data.dataset.offline``, :mod:`automodel.data.hf_source`).

The helpers here word the errors: a name that looks like a path and is no directory says so and
suggests no download; a hub id that is not cached gives the download command and the switch.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["env_offline", "looks_like_path", "local_files_only", "missing_path_message", "not_cached_hint"]

ALLOW_KEY = "model.allow_download"


def env_offline() -> bool:
    """Whether the user set ``HF_HUB_OFFLINE`` (to a true value) in the environment."""
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def looks_like_path(name: str) -> bool:
    """A name meant as a local path: it exists, starts with ``.``/``/``/``~``, or has more than one ``/``.

    Hub ids are ``name`` or ``org/name``.
    """
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def local_files_only(allow_download: bool) -> bool:
    """True (look in local files and the hub cache only) unless downloads are allowed and not switched
    off by ``HF_HUB_OFFLINE``."""
    return not allow_download or env_offline()


def missing_path_message(name: str, what: str) -> str:
    """Why local path ``name`` (not a directory) cannot be used, and what to give instead; no download."""
    p = Path(name).expanduser()
    state = "is a file, not a directory" if p.is_file() else "does not exist"
    return f"the local path {state}; give a directory holding {what} (as written by save_pretrained)"


def not_cached_hint(name: str, allow_download: bool) -> str:
    """How to get hub id ``name`` that is not in the local cache (the download command, the switch)."""
    if env_offline():
        return (
            f"HF_HUB_OFFLINE is set in the environment, so only the local cache is searched: download it on a "
            f"machine with network access (`hf download {name}`), or pass a local directory"
        )
    if not allow_download:
        return (
            f"downloads are off by default, so only the local cache is searched: download it first "
            f"(`hf download {name}`), pass a local directory, or set {ALLOW_KEY}=true to let the run download it"
        )
    return "check the hub id and the network, or pass a local directory"
