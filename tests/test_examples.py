"""The examples a user copies from must run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path: Path) -> None:
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


def test_readme_quick_start_is_the_store_example() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    store = (Path(__file__).parents[1] / "examples" / "store.py").read_text()
    body = store.split('"""', 2)[2].strip()
    assert body in readme
