"""The compiled protocol core: which extension modules make it up, and
whether each one loaded (``tensorwire info``).

The core is not optional: there is one implementation of each per-message
path, in Cython (docs/architecture.md, "The compiled core"). A package
installed without building it fails on import with an error that says how
to build it; this module only reports.
"""

from __future__ import annotations

import importlib
import importlib.machinery
from pathlib import Path
from typing import Any

__all__ = ("MODULES", "require", "status")

#: Every compiled module of the package (a ``.pyx`` beside its ``.pyi``).
MODULES: tuple[str, ...] = (
    "tensorwire._counters",
    "tensorwire._eager",
    "tensorwire.rpc._call_table",
    "tensorwire.rpc._calls",
    "tensorwire.rpc._calls_in_flight",
    "tensorwire.rpc._client_core",
    "tensorwire.rpc._dispatch",
    "tensorwire.rpc._driver_core",
    "tensorwire.rpc._flush_gate",
    "tensorwire.rpc._slots",
    "tensorwire.rpc._streams",
    "tensorwire.rpc._wire",
    "tensorwire.serde._decoder",
    "tensorwire.serde._encoder",
    "tensorwire.transports._frame_table",
    "tensorwire.transports._receiver",
    "tensorwire.transports._spin_gate",
    "tensorwire.transports._stream_core",
    "tensorwire.transports._stream_framing",
    "tensorwire.transports._stream_writes",
    "tensorwire.transports._ucx_messages",
    "tensorwire.transports._ucx_progress",
    "tensorwire.transports._ucx_receiving",
    "tensorwire.transports._ucx_sending",
)


def require() -> None:
    """Check that every compiled module was built, before anything imports one.

    Raises:
        ImportError: one is missing (a source tree used without
            ``pip install -e .``, or a build without a C compiler), naming it
            and how to build it, instead of the bare ModuleNotFoundError deep
            inside the package that the first import would give.
    """
    # By file, without importing: finding a submodule's spec would import its
    # package, which imports the compiled module itself.
    root = Path(__file__).parent
    missing = [name for name in MODULES
               if not any(root.joinpath(*name.split(".")[1:]).with_suffix(suffix).exists()
                          for suffix in importlib.machinery.EXTENSION_SUFFIXES)]
    if missing:
        raise ImportError(
            f"tensorwire's compiled core is not built here (missing: {', '.join(missing)}): "
            "build it with `pip install -e .` (or `python setup.py build_ext --inplace`) "
            "from the source tree; it needs a C compiler and the Python headers")


def status() -> dict[str, Any]:
    """``{"loaded": bool, "modules": {name: file or the import error}}``."""
    modules: dict[str, str] = {}
    loaded = True
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            loaded = False
            modules[name] = f"not loaded: {exc}"
            continue
        modules[name] = str(getattr(module, "__file__", "?"))
        loaded = loaded and modules[name].endswith(".so")
    return {"loaded": loaded and bool(MODULES), "modules": modules}
