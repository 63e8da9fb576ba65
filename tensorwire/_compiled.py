"""The compiled protocol core: which extension modules make it up, and
whether each one loaded (``tensorwire info``).

The core is not optional: there is one implementation of each per-message
path, in Cython (docs/architecture.md, "The compiled core"). A package
installed without building it fails on import with an error that says how
to build it; this module only reports.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ("MODULES", "status")

#: Every compiled module of the package (a ``.pyx`` beside its ``.pyi``).
MODULES: tuple[str, ...] = (
    "tensorwire.transports._ucx_messages",
    "tensorwire.transports._ucx_progress",
    "tensorwire.transports._ucx_receiving",
    "tensorwire.transports._ucx_sending",
)


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
