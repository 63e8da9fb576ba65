"""Builds tensorwire's compiled protocol core (docs/architecture.md, "The
compiled core"): every ``.pyx`` module under ``tensorwire/`` becomes an
extension of the same dotted name. Everything else is in pyproject.toml."""

import os
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup

_ROOT = Path(__file__).parent

#: Modules translated and compiled at a time: one per CPU this build may
#: use (gcc is most of an install's time, one module after another).
_JOBS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _extensions() -> list[Extension]:
    sources = sorted(p.relative_to(_ROOT) for p in (_ROOT / "tensorwire").rglob("*.pyx"))
    return [Extension(".".join(source.with_suffix("").parts), [str(source)],
                      extra_compile_args=["-O2"])
            for source in sources]


setup(
    ext_modules=cythonize(
        _extensions(),
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "embedsignature": True,
        },
        nthreads=_JOBS,
    ),
    options={"build_ext": {"parallel": _JOBS}},
)
