"""docs/architecture.md lists exactly the modules of the package, each once."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
#: A row of the module map: | `tensorwire/...` | what is in it |
ROW = re.compile(r"^\| `(tensorwire/[\w/]+\.(?:py|pyx))` \| (.+) \|$", re.M)
#: A module named in the text of the call and allreduce paths.
MENTION = re.compile(r"`((?:tensorwire|serde|transports|rpc|collective|ps)/[\w/]+\.(?:py|pyx))`")


def _map() -> list[str]:
    return [match.group(1) for match in ROW.finditer(PAGE.read_text())]


def _modules() -> set[str]:
    found = {*(ROOT / "tensorwire").rglob("*.py"), *(ROOT / "tensorwire").rglob("*.pyx")}
    return {str(path.relative_to(ROOT)) for path in found}


def test_the_module_map_lists_every_module_once() -> None:
    listed = _map()
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing = _modules() - set(listed)
    assert not missing, f"modules missing from docs/architecture.md: {sorted(missing)}"
    gone = set(listed) - _modules()
    assert not gone, f"docs/architecture.md lists modules that do not exist: {sorted(gone)}"


def test_every_row_says_what_is_inside() -> None:
    for match in ROW.finditer(PAGE.read_text()):
        assert len(match.group(2).strip()) > 10, match.group(0)


def test_the_paths_name_only_modules_that_exist() -> None:
    modules = _modules()
    text = PAGE.read_text().split("## The path of a call", 1)[1]
    named = set(MENTION.findall(text))
    assert named, "the paths name no module"
    for name in named:
        path = name if name.startswith("tensorwire/") else f"tensorwire/{name}"
        assert path in modules, f"docs/architecture.md names {name}, which does not exist"
