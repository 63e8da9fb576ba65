"""The public surface: __all__, lazy imports, buffer types."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import tensorwire.serde as serde_pkg


def test_all_attributes() -> None:
    # anyio's test_all_attributes: __all__ is exactly the public, non-module names.
    public = {
        name
        for name, value in vars(serde_pkg).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert isinstance(serde_pkg.__all__, tuple)
    assert set(serde_pkg.__all__) == public
    assert len(serde_pkg.__all__) == len(set(serde_pkg.__all__))
    for name in serde_pkg.__all__:
        assert getattr(serde_pkg, name).__doc__


_PROBE = """
import json, sys
import numpy as np
import tensorwire.serde as serde
value = {"a": np.arange(10_000.0), "s": np.float32(1), "t": (1, 2), "b": b"x" * 5000,
         "bc": np.broadcast_to(np.arange(3), (9, 3)), "f": np.ones((30, 30), order="F")}
header, buffers = serde.encode(value)
serde.decode(header, buffers)
print(json.dumps([m for m in ("torch", "cupy", "ml_dtypes") if m in sys.modules]))
"""


def test_numpy_values_import_no_optional_library() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], check=True, capture_output=True, text=True, timeout=60
    )
    assert json.loads(out.stdout) == []


def test_probe_detects_imports() -> None:
    # The probe above could pass vacuously if it never looked; make sure it can fail.
    probe = _PROBE.replace("import numpy as np", "import numpy as np, ml_dtypes")
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True, timeout=60
    )
    assert json.loads(out.stdout) == ["ml_dtypes"]
