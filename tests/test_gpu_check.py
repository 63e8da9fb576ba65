"""scripts/gpu-check on a machine without a GPU: it installs and imports
tensorwire, says in one line that there is no GPU, and exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _has_gpu() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    try:
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present: gpu-check would run the GPU suite")
def test_without_a_gpu_it_installs_imports_and_says_so(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "TMPDIR": str(tmp_path)}
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert any(line.startswith("gpu-check: imported tensorwire ") for line in lines), lines
    (no_gpu,) = [line for line in lines if "no CUDA device" in line]
    assert no_gpu.endswith("ran the install and import steps only")
    # The package was installed from the tree into the scratch folder, not run from it.
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    imported = re.compile(rf"^\S+ {re.escape(str(tmp_path))}/tensorwire-site\.\w+/tensorwire/"
                          r"__init__\.py$", re.MULTILINE)
    assert imported.search(log), log


def test_an_unknown_option_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--fast"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "unknown option --fast" in done.stderr
