"""The package as a whole: public names, no side effects on import, packaging."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tomllib
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

PACKAGES = [
    "tensorwire",
    "tensorwire.errors",
    "tensorwire.serde",
    "tensorwire.transports",
    "tensorwire.rpc",
    "tensorwire.ps",
    "tensorwire.collective",
    "tensorwire.metrics",
    "tensorwire.timeline",
    "tensorwire.testing",
    "tensorwire.testing.netbed",
    pytest.param("tensorwire.torch", marks=pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch is not installed")),
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_lists_exactly_the_public_names(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert isinstance(module.__all__, tuple)
    # Public: defined in this package (re-exports from the package's own
    # submodules count, helpers imported from elsewhere do not).
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and not isinstance(value, types.ModuleType)
        and str(getattr(value, "__module__", "")).startswith(name)
    }
    assert public - exported == set(), f"public but not in __all__: {public - exported}"
    missing = {attr for attr in exported if not hasattr(module, attr)}
    assert missing == set(), f"in __all__ but missing: {missing}"


_PROBE = """
import json, os, sys, threading
before = dict(os.environ)
import tensorwire
import numpy as np
header, buffers = tensorwire.serde.encode({"w": np.ones(3)})
tensorwire.serde.decode(header, buffers)
print(json.dumps({
    "optional": sorted(m for m in ("ucxx", "cupy", "torch", "ml_dtypes", "rmm", "grpc")
                       if m in sys.modules),
    "threads": threading.active_count(),
    "env_changed": dict(os.environ) != before,
}))
"""


def test_import_has_no_side_effects() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=60)
    facts = json.loads(out.stdout)
    assert facts == {"optional": [], "threads": 1, "env_changed": False}


# -- packaging: extras, the wheel, pip check -----------------------------------

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def test_ucx_is_an_extra_per_cuda_major() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    assert not any("ucxx" in r or "prometheus" in r or "scikit" in r
                   for r in project["dependencies"])
    assert [r.split(">=")[0] for r in extras["ucx-cu12"]] == ["ucxx-cu12"]
    assert [r.split(">=")[0] for r in extras["ucx-cu13"]] == ["ucxx-cu13"]
    assert extras["ucx"] == extras["ucx-cu12"]
    # CuPy likewise, for the same CUDA major as the UCX extra beside it.
    assert [r.split(">=")[0] for r in extras["gpu-cu12"]] == ["cupy-cuda12x"]
    assert [r.split(">=")[0] for r in extras["gpu-cu13"]] == ["cupy-cuda13x"]
    assert extras["gpu"] == extras["gpu-cu12"]
    # The tests cover ucx://, the endpoint, the demo and --plot.
    (own,) = [r for r in extras["dev"] if r.startswith("tensorwire[")]
    assert set(own.removeprefix("tensorwire[").removesuffix("]").split(",")) >= {
        "ucx", "metrics", "demo", "plot"}


def _torch_cuda_major() -> str | None:
    """The CUDA major torch was built for, from torch/version.py (no import)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    found = re.search(r"^cuda\b.*?=\s*['\"]?([\w.]+)", text, re.M)
    return None if found is None or found.group(1) == "None" else found.group(1).split(".")[0]


def test_pip_check_is_clean_with_torch_and_the_matching_ucx_extra() -> None:
    try:
        importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch is not installed")
    installed = []
    for major in ("12", "13"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(f"ucxx-cu{major}")
            installed.append(major)
    if not installed:
        pytest.skip("no UCX extra installed")
    cuda = _torch_cuda_major()
    if cuda is not None:  # a CPU build goes with either
        assert installed == [cuda], f"torch is built for CUDA {cuda}: take ucx-cu{cuda}"
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_wheel_holds_the_compiled_core_the_demo_license_and_extras(tmp_path: Path) -> None:
    # `python -m build` as a packager runs it: the sdist first, then the
    # wheel from the sdist, so the sdist must carry the Cython sources. From
    # a copy without what a build left in the tree (build/, *.egg-info, the
    # extensions an editable install built in place).
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
        ".hypothesis", "*.so", "*.c", ".whl"))
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"),
         str(source)],
        capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("tensorwire-*.whl")
    assert "-linux_" in wheel.name or "manylinux" in wheel.name  # not py3-none-any
    from tensorwire import _compiled

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
    compiled = {n for n in names if n.endswith(".so")}
    assert _compiled.MODULES
    for module in _compiled.MODULES:
        stem = module.replace(".", "/")
        assert any(n.startswith(stem + ".cpython-") for n in compiled), (module, compiled)
        assert f"{stem}.pyi" in names  # mypy checks the callers
    assert "tensorwire/demo.py" in names and "tensorwire/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in text
    assert "Classifier: Development Status :: 4 - Beta" in text
    assert "Classifier: Programming Language :: Python :: 3.11" in text
    for extra in ("ucx", "ucx-cu12", "ucx-cu13", "metrics", "demo", "plot", "dev"):
        assert f"Provides-Extra: {extra}\n" in text
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist: ucxx")]
    assert requires and all("extra ==" in line for line in requires)


def test_the_compiled_core_list_names_every_cython_module() -> None:
    """``_compiled.MODULES`` (what ``require()`` checks and ``tensorwire
    info`` reports) is exactly the tree's .pyx modules, each with its stub."""
    from tensorwire import _compiled

    sources = sorted(ROOT.joinpath("tensorwire").rglob("*.pyx"))
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in sources}
    assert names == set(_compiled.MODULES)
    assert all(p.with_suffix(".pyi").exists() for p in sources)


def test_torch_integration_without_torch_says_what_is_missing() -> None:
    # A None entry in sys.modules makes `import torch` fail as if it were absent.
    probe = ("import sys; sys.modules['torch'] = None\n"
             "try:\n    import tensorwire.torch\n"
             "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60)
    assert "tensorwire.torch needs PyTorch" in out.stdout


def test_a_tree_without_its_compiled_core_says_how_to_build_it(tmp_path: Path) -> None:
    # A source tree used as it is, before `pip install -e .` built the core.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "tensorwire", source / "tensorwire",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    done = subprocess.run([sys.executable, "-c", "import tensorwire"], cwd=source,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tensorwire's compiled core is not built here"), last
    assert "pip install -e ." in last and "tensorwire.transports._frame_table" in last
