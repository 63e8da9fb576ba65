"""The package as a whole: public names, and no side effects on import."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import types

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


def test_torch_integration_without_torch_says_what_is_missing() -> None:
    # A None entry in sys.modules makes `import torch` fail as if it were absent.
    probe = ("import sys; sys.modules['torch'] = None\n"
             "try:\n    import tensorwire.torch\n"
             "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60)
    assert "tensorwire.torch needs PyTorch" in out.stdout
