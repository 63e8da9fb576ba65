"""Checkpoint files: atomic replace, retention, a damaged newest file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensorwire.errors import DataLoss
from tensorwire.ps import _checkpoint


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    arrays = {"v0": np.arange(10, dtype=np.float32), "seen0": np.zeros(3, np.int64)}
    path = _checkpoint.save(tmp_path, {"step": 4, "job": {"a": [1, 2]}}, arrays)
    meta, loaded = _checkpoint.load(path)
    assert meta == {"step": 4, "job": {"a": [1, 2]}}
    assert loaded.keys() == arrays.keys()
    for name, array in arrays.items():
        np.testing.assert_array_equal(loaded[name], array)
        assert loaded[name].dtype == array.dtype


def test_keeps_the_newest_files_only_and_no_temporaries(tmp_path: Path) -> None:
    for step in range(5):
        _checkpoint.save(tmp_path, {"step": step}, {"v": np.full(2, step)}, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["ckpt-000000000003.npz", "ckpt-000000000004.npz"]
    found = _checkpoint.latest(tmp_path)
    assert found is not None and found[1] == {"step": 4}


def test_a_damaged_newest_file_falls_back_to_the_previous(tmp_path: Path) -> None:
    _checkpoint.save(tmp_path, {"step": 1}, {"v": np.ones(2)})
    newest = _checkpoint.save(tmp_path, {"step": 2}, {"v": np.ones(2)})
    newest.write_bytes(newest.read_bytes()[:40])
    with pytest.raises(DataLoss):
        _checkpoint.load(newest)
    found = _checkpoint.latest(tmp_path)
    assert found is not None and found[1] == {"step": 1}


def test_a_leftover_temporary_file_is_ignored(tmp_path: Path) -> None:
    _checkpoint.save(tmp_path, {"step": 1}, {"v": np.ones(2)})
    (tmp_path / ".ckpt-000000000001.npz.999.tmp").write_bytes(b"half a write")
    found = _checkpoint.latest(tmp_path)
    assert found is not None and found[1] == {"step": 1}
    assert _checkpoint.latest(tmp_path / "missing") is None
