"""Read users' local data files: ``jsonl`` records and plain ``text`` documents (optionally gzipped).

``path`` may be one file, a directory (every ``*.jsonl``, ``*.txt``, ``*.md`` file in it, optionally
``.gz``, sorted by name, not recursive), or a list of those. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import IO, Any

from automodel.errors import UserInputError

__all__ = ["resolve_files", "detect_format", "read_jsonl", "read_text_documents", "data_path_key", "FILE_FORMATS"]

FILE_FORMATS = ("auto", "jsonl", "text")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
_TEXT_SUFFIXES = (".txt", ".txt.gz", ".md", ".md.gz")

PathLike = str | os.PathLike


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


#: the config key the paths being read come from (:func:`data_path_key`); ``None``: not known
_PATH_KEY: ContextVar[str | None] = ContextVar("automodel_data_path_key", default=None)
_EITHER_KEY = "data.dataset.path (or data.validation_dataset.path)"


@contextlib.contextmanager
def data_path_key(key: str) -> Iterator[None]:
    """Inside this context, errors about a data path name ``key`` as the one to fix (the recipe builds
    ``data.dataset`` under ``"data.dataset.path"`` and ``data.validation_dataset`` under its own key);
    outside it they name both keys."""
    token = _PATH_KEY.set(key)
    try:
        yield
    finally:
        _PATH_KEY.reset(token)


def resolve_files(path: PathLike | Sequence[PathLike]) -> list[Path]:
    """Expand ``path`` (file, directory, or list of them) into an ordered list of files.

    Raises ``UserInputError`` (a ``ValueError``) when a path does not exist or a directory holds no data file;
    the message names the config key to set (:func:`data_path_key`).
    """
    key = _PATH_KEY.get() or _EITHER_KEY
    if isinstance(path, (str, os.PathLike)):
        items: list[PathLike] = [path]
    elif isinstance(path, Sequence) and len(path) > 0:
        items = list(path)
    else:
        raise UserInputError(
            f"data path {path!r} must be a file, a directory or a non-empty list of them; "
            f"set {key} to your .jsonl/.txt file(s), or leave it null for the shipped default corpus"
        )
    files: list[Path] = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or os.fspath(item) == "":
            raise UserInputError(
                f"data path entry {item!r} must be a non-empty path string; set {key} to your "
                ".jsonl/.txt file(s) or directory, or leave it null for the shipped default data"
            )
        p = Path(os.fspath(item)).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                f for f in p.iterdir() if f.is_file() and f.name.endswith(_JSONL_SUFFIXES + _TEXT_SUFFIXES)
            )
            if not found:
                raise UserInputError(
                    f"data directory {str(p)!r} holds no *.jsonl, *.txt or *.md file (optionally .gz); "
                    f"put your data files there or point {key} at the files themselves"
                )
            files.extend(found)
        else:
            raise UserInputError(
                f"data path {str(p)!r} does not exist; set {key} to an existing .jsonl/.txt file or "
                "directory (relative paths are resolved from the current working directory "
                f"{os.getcwd()!r}), or leave it null for the shipped default corpus"
            )
    return files


def detect_format(path: Path, file_format: str = "auto") -> str:
    """Return ``"jsonl"`` or ``"text"`` for ``path``: ``file_format`` unless it is ``"auto"``, in
    which case the suffix decides (``.jsonl[.gz]`` or ``.txt/.md[.gz]``)."""
    if file_format not in FILE_FORMATS:
        raise UserInputError(f"file_format={file_format!r} is not one of {FILE_FORMATS}; use 'jsonl' or 'text'")
    if file_format != "auto":
        return file_format
    if path.name.endswith(_JSONL_SUFFIXES):
        return "jsonl"
    if path.name.endswith(_TEXT_SUFFIXES):
        return "text"
    raise UserInputError(
        f"cannot tell the format of {str(path)!r} from its suffix (known: {_JSONL_SUFFIXES + _TEXT_SUFFIXES}); "
        "rename it or set data.file_format to 'jsonl' or 'text'"
    )


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_number, record)`` for every non-blank line of a JSON-lines file (1-based lines).

    Raises ``ValueError`` naming the file and line when a line is not a JSON object.
    """
    with _open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserInputError(
                    f"{path}:{lineno} is not valid JSON ({exc.msg}); every line of a .jsonl file must be "
                    'one JSON object such as {"text": "..."}'
                ) from exc
            if not isinstance(record, dict):
                raise UserInputError(
                    f"{path}:{lineno} is a JSON {type(record).__name__}, not an object; every line must be "
                    'one JSON object such as {"text": "..."}'
                )
            yield lineno, record


def read_text_documents(path: Path, doc_separator: str | None = None) -> list[str]:
    """Read a text file as documents: the whole file is one document when ``doc_separator`` is None,
    otherwise the file is split on ``doc_separator`` (e.g. ``"\\n\\n"``). Empty documents (only
    whitespace) are dropped."""
    with _open_text(path) as f:
        text = f.read()
    if doc_separator is None:
        parts = [text]
    else:
        if not isinstance(doc_separator, str) or doc_separator == "":
            raise UserInputError(
                f"doc_separator={doc_separator!r} must be a non-empty string (e.g. '\\n\\n') or null for "
                "one document per file"
            )
        parts = text.split(doc_separator)
    return [p for p in parts if p.strip()]
