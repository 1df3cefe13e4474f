"""Open a Hugging Face ``datasets`` source: local files, a ``save_to_disk`` folder, or a cached hub id.

``path`` decides the kind (``source="auto"``), or ``source`` names it:

- ``json`` / ``parquet`` / ``arrow`` / ``csv``: ``load_dataset(source, data_files=path)``; ``path`` is a
  file, a glob, or a list of them (``.json``/``.jsonl`` optionally ``.gz``, ``.parquet``, ``.arrow``,
  ``.csv``). ``auto`` picks the builder from the suffix of the first file.
- ``disk``: ``load_from_disk(path)``: a folder written by ``Dataset.save_to_disk`` (``state.json``) or
  ``DatasetDict.save_to_disk`` (``dataset_dict.json``; ``hf_split`` picks the split).
- ``hub``: ``load_dataset(path, name)`` for a hub id (``name`` or ``org/name``). With ``offline=True``
  (the default) nothing is downloaded: ``datasets``' offline mode is switched on for the call, so the
  id resolves from the local cache (``HF_DATASETS_CACHE``) or fails at once with a
  :class:`~automodel.errors.UserInputError` that says how to download it. It never waits on the network.

``streaming=True`` returns a ``datasets.IterableDataset`` that reads the files lazily (a folder or a
cached hub dataset is already memory-mapped; it is streamed with ``to_iterable_dataset``).
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from automodel.errors import UserInputError

__all__ = ["SOURCES", "detect_source", "load_hf_source", "no_progress_bars", "offline_mode"]

SOURCES = ("auto", "json", "parquet", "arrow", "csv", "disk", "hub")
_SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}


def _as_list(path: Any) -> list[str]:
    if isinstance(path, (str, os.PathLike)):
        return [os.fspath(path)]
    if isinstance(path, Sequence) and path and all(isinstance(p, (str, os.PathLike)) for p in path):
        return [os.fspath(p) for p in path]
    raise UserInputError(
        f"data.dataset.path={path!r} must be a file, a glob, a list of files, a save_to_disk folder or a hub "
        "id; set data.dataset.path"
    )


def _file_builder(name: str) -> str | None:
    for suffix, builder in _SUFFIXES.items():
        if name.endswith(suffix):
            return builder
    return None


def detect_source(path: Any, source: str = "auto") -> str:
    """The source kind of ``path`` (one of :data:`SOURCES` minus ``auto``); see the module docstring."""
    if source not in SOURCES:
        raise UserInputError(
            f"data.dataset.source={source!r} is not one of {SOURCES}; use 'auto' to decide from the path"
        )
    if source != "auto":
        return source
    paths = _as_list(path)
    first = Path(paths[0]).expanduser()
    if len(paths) == 1 and first.is_dir():
        if (first / "state.json").is_file() or (first / "dataset_dict.json").is_file():
            return "disk"
        raise UserInputError(
            f"data.dataset.path={paths[0]!r} is a folder but not one written by save_to_disk (no state.json "
            "or dataset_dict.json); point it at the data files themselves (e.g. 'dir/*.jsonl') or at a "
            "save_to_disk folder"
        )
    builder = _file_builder(first.name)
    if builder is not None:
        return builder
    if len(paths) == 1 and not first.exists() and not glob.has_magic(paths[0]):
        name = paths[0]
        if name.count("/") <= 1 and not name.startswith((".", "/", "~")):
            return "hub"
    raise UserInputError(
        f"cannot tell the kind of data source {paths[0]!r}: it is not an existing save_to_disk folder, "
        f"its suffix is not one of {sorted(_SUFFIXES)}, and it is not a hub id ('name' or 'org/name'); "
        "set data.dataset.source to json, parquet, arrow, csv, disk or hub, or fix the path"
    )


@contextlib.contextmanager
def offline_mode(offline: bool) -> Iterator[None]:
    """Switch ``datasets`` (and ``huggingface_hub``) to offline mode inside the block when ``offline``.

    ``datasets`` reads ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` once at import; this sets its
    flags for the duration of the call, so a missing hub dataset fails fast instead of trying (and,
    on a firewalled cluster, hanging on) the network. ``offline=False`` leaves the environment's
    setting alone.
    """
    if not offline:
        yield
        return
    import datasets.config as dconfig
    import huggingface_hub.constants as hconst

    flags = [(m, a) for m in (dconfig, hconst) for a in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(m, a)]
    saved = [getattr(m, a) for m, a in flags]
    for m, a in flags:
        setattr(m, a, True)
    try:
        yield
    finally:
        for (m, a), v in zip(flags, saved, strict=True):
            setattr(m, a, v)


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Hide ``datasets``' progress bars inside the block (loading, ``map``), then restore the setting.

    The bars are tqdm lines on stderr that interleave out of order with the recipe's log on stdout; the
    log says what is loaded or tokenized instead.
    """
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _expand_files(paths: list[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        p = os.path.expanduser(p)
        if glob.has_magic(p):
            found = sorted(glob.glob(p))
            if not found:
                raise UserInputError(f"data.dataset.path glob {p!r} matches no file; fix the pattern")
            files += found
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise UserInputError(
                f"data file {p!r} does not exist (relative paths are resolved from {os.getcwd()!r}); fix "
                "data.dataset.path"
            )
    return files


def load_hf_source(
    path: Any,
    *,
    source: str = "auto",
    hf_split: str = "train",
    name: str | None = None,
    streaming: bool = False,
    offline: bool = True,
    cache_dir: str | None = None,
) -> Any:
    """Open ``path`` as a ``datasets.Dataset`` (or ``IterableDataset`` with ``streaming``).

    Args:
        path: file(s)/glob(s), a ``save_to_disk`` folder, or a hub id (see module docstring).
        source: ``auto`` or one of json, parquet, arrow, csv, disk, hub.
        hf_split: the ``datasets`` split to read (``"train"``; a ``DatasetDict`` folder or a hub dataset
            may have others). Not to be confused with the train/validation hash split of
            :class:`~automodel.data.hf_dataset.HFDataset`.
        name: the hub dataset's configuration name (hub only).
        streaming: return a lazily read ``IterableDataset``.
        offline: never touch the network (hub ids come from the local cache only).
        cache_dir: ``datasets``' cache directory (default ``HF_DATASETS_CACHE``).

    Raises:
        UserInputError: a missing file, an unknown kind, a hub id not in the cache, a missing split.
    """
    import datasets

    kind = detect_source(path, source)
    try:
        with offline_mode(offline), no_progress_bars():
            if kind == "disk":
                folder = os.path.expanduser(_as_list(path)[0])
                if not os.path.isdir(folder):
                    raise UserInputError(
                        f"save_to_disk folder {folder!r} does not exist; fix data.dataset.path"
                    )
                ds = datasets.load_from_disk(folder)
                if isinstance(ds, datasets.DatasetDict):
                    if hf_split not in ds:
                        raise UserInputError(
                            f"the DatasetDict at {folder!r} has splits {sorted(ds)}, not {hf_split!r}; set "
                            "data.dataset.hf_split to one of them"
                        )
                    ds = ds[hf_split]
                return ds.to_iterable_dataset() if streaming else ds
            if kind == "hub":
                hub_id = _as_list(path)[0]
                try:
                    ds = datasets.load_dataset(hub_id, name, split=hf_split, cache_dir=cache_dir)
                except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as exc:
                    how = (
                        "offline mode is on (data.dataset.offline=true), so only the local cache "
                        f"({cache_dir or datasets.config.HF_DATASETS_CACHE}) is searched. Download it once on a "
                        "machine with network access and the same HF_DATASETS_CACHE: "
                        f"python -c \"import datasets; datasets.load_dataset('{hub_id}'"
                        + (f", '{name}'" if name else "")
                        + ')", or save it with save_to_disk and point data.dataset.path at that folder'
                        if offline
                        else "check the id and your network, or use a local copy"
                    )
                    raise UserInputError(
                        f"hub dataset {hub_id!r} could not be loaded ({type(exc).__name__}: "
                        f"{str(exc).strip()[:300]}); {how}"
                    ) from exc
                return ds.to_iterable_dataset() if streaming else ds
            files = _expand_files(_as_list(path))
            try:
                return datasets.load_dataset(
                    kind,
                    data_files={hf_split: files},
                    split=hf_split,
                    streaming=streaming,
                    cache_dir=cache_dir,
                )
            except datasets.exceptions.DatasetGenerationError as exc:
                if kind == "json":  # Arrow counts rows from 0: name the file and line (from 1) instead
                    _raise_first_bad_jsonl_line(files, exc)
                cause = exc.__cause__ or exc
                raise UserInputError(
                    f"datasets could not read {files[:3]}{' ...' if len(files) > 3 else ''} as {kind} "
                    f"({type(cause).__name__}: {str(cause).strip()[:300]}); fix the file or set "
                    "data.dataset.source to its real format"
                ) from exc
    except ValueError as exc:  # e.g. an unknown split
        if isinstance(exc, UserInputError):
            raise
        raise UserInputError(f"data source {path!r} ({kind}): {exc}; fix data.dataset.path/hf_split") from exc


def _raise_first_bad_jsonl_line(files: Sequence[str], exc: BaseException) -> None:
    """Raise ``<file>:<line> is not valid JSON ...`` (lines from 1, as TextDataset says it) for the first
    broken line of the JSON-lines ``files``; return if none is found (e.g. a file that is one JSON array)."""
    from automodel.data.file_readers import read_jsonl

    for f in files:
        if not str(f).endswith((".jsonl", ".jsonl.gz", ".ndjson")):
            continue
        for _ in read_jsonl(Path(f)):  # raises UserInputError naming the file and the line
            pass
