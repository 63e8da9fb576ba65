"""Atomic shard checkpoints: write a temporary file, fsync, rename, fsync the directory.

A checkpoint is one ``.npz`` file (NumPy's zip of ``.npy`` arrays, loaded
with ``allow_pickle=False``) holding the shard's arrays and a JSON entry
``__meta__`` with everything else. A reader sees either the previous
complete file or the new complete file, never a torn one: the rename is
atomic on POSIX file systems, and the fsyncs make the file's data and its
name durable before the old file is deleted.

Files are named ``ckpt-<sequence>.npz`` with a zero-padded sequence number,
so the newest sorts last.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataLoss

__all__ = ("checkpoints", "latest", "load", "save")

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
_NAME = re.compile(r"^ckpt-(\d{12})\.npz$")
_META = "__meta__"


def _sequence(path: Path) -> int:
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def checkpoints(directory: Path) -> list[Path]:
    """The checkpoint files in ``directory``, oldest first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), key=_sequence)


def save(directory: Path, meta: Mapping[str, Any], arrays: Mapping[str, Array], *,
         keep: int = 2) -> Path:
    """Write a new checkpoint atomically and delete all but the newest ``keep``.

    Blocking file I/O: run it in a thread from async code.

    Raises:
        OSError: the file could not be written (the previous one is intact).
    """
    directory.mkdir(parents=True, exist_ok=True)
    existing = checkpoints(directory)
    sequence = _sequence(existing[-1]) + 1 if existing else 0
    final = directory / f"ckpt-{sequence:012d}.npz"
    temporary = directory / f".{final.name}.{os.getpid()}.tmp"
    meta_bytes = np.frombuffer(json.dumps(dict(meta)).encode(), np.uint8)
    try:
        with open(temporary, "wb") as file:
            entries: dict[str, Any] = {**arrays, _META: meta_bytes}
            np.savez(file, allow_pickle=False, **entries)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    for old in checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def load(path: Path) -> tuple[dict[str, Any], dict[str, Array]]:
    """The metadata and arrays of one checkpoint file.

    Raises:
        DataLoss: the file is not a readable checkpoint.
    """
    try:
        # Our own file object: np.load leaks the one it opens when the zip is bad.
        with open(path, "rb") as file, np.load(file, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
        meta = json.loads(arrays.pop(_META).tobytes())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise DataLoss(f"checkpoint {path} is unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise DataLoss(f"checkpoint {path} has no metadata")
    return meta, arrays


def latest(directory: Path) -> tuple[Path, dict[str, Any], dict[str, Array]] | None:
    """The newest readable checkpoint in ``directory`` (None when there is none).

    An unreadable newest file (a disk fault; an interrupted write never
    leaves one) is skipped with a warning in favour of the one before.
    """
    for path in reversed(checkpoints(directory)):
        try:
            meta, arrays = load(path)
        except DataLoss as exc:
            logger.warning("%s; trying an older one", exc)
            continue
        return path, meta, arrays
    return None
