"""Every code block in the user documentation runs, as a user would run it.

- Each ```python block of README.md and docs/*.md is a complete program: it
  is written to a file and run with this Python, the repository root as the
  working directory, and must exit with status 0 within the timeout.
- Each ```console block is a shell session: its ``$ `` lines (with the
  ``> `` lines that continue them, as bash's PS2 shows) run in order in one
  bash (``set -e``), with this venv's ``bin`` first on PATH, and the
  session must succeed. Output lines in the block are not compared.
- Fragments that cannot run alone use other fences (```sh, ```text, ...);
  a ```python fence is a promise that the block runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
TIMEOUT = 60


def _blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(1) == language:
                line = text.count("\n", 0, match.start()) + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return found


PYTHON = _blocks("python")
CONSOLE = _blocks("console")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.pop("TENSORWIRE_LOG", None)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                 "OMPI_COMM_WORLD_RANK", "TENSORWIRE_MASTER", "TENSORWIRE_LISTEN"):
        env.pop(name, None)
    return env


def test_the_docs_have_runnable_blocks() -> None:
    # Guards the extraction itself: a broken pattern would make every
    # parametrized test below vanish instead of fail.
    pages_with_python = {where.split(":")[0] for where, _ in PYTHON}
    assert {"docs/quickstart.md", "docs/rpc.md", "docs/observability.md"} <= pages_with_python
    assert CONSOLE, "no ```console block found"


def test_no_python_block_hides_under_another_name() -> None:
    # ```py or ```python3 would silently escape the test below.
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            assert match.group(1) not in ("py", "python3", "pycon", "ipython"), (
                f"{page.name}: use ```python (runs) or ```text (does not)")


@pytest.mark.parametrize(("where", "code"), PYTHON, ids=[w for w, _ in PYTHON])
def test_python_block_runs(where: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    result = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(),
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, (
        f"{where} exited with {result.returncode}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-3000:]}")


@pytest.mark.parametrize(("where", "session"), CONSOLE, ids=[w for w, _ in CONSOLE])
def test_console_block_runs(where: str, session: str) -> None:
    commands: list[str] = []
    for line in session.splitlines():
        if line.startswith("$ "):
            commands.append(line[2:])
        elif (line.startswith("> ") or line == ">") and commands:
            commands[-1] += "\n" + line[2:]
    assert commands, f"{where}: a ```console block needs '$ ' command lines"
    script = "set -euo pipefail\n" + "\n".join(commands) + "\n"
    # Its own session, so that a server the block left in the background
    # (the block failed before stopping it) is stopped with it.
    process = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.communicate()
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, (
        f"{where} exited with {result.returncode}\n--- script\n{script}"
        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")


def test_comparison_quotes_only_the_results_files() -> None:
    # docs/comparison.md may quote a figure only from the bench/results file
    # its section cites; a rerun of a benchmark that changes the figures
    # fails this test until the page is brought up to date.
    text = (ROOT / "docs" / "comparison.md").read_text()
    checked = 0
    for section in re.split(r"^### ", text, flags=re.M):
        cited = re.search(r"From `(bench/results/[\w.]+\.md)`", section)
        if cited is None:
            continue
        source = (ROOT / cited.group(1)).read_text()
        for number in re.findall(r"(?<![\w.,])(?:\d+\.\d+|\d{1,3}(?:,\d{3})+)", section):
            assert number in source, f"comparison.md quotes {number}, not in {cited.group(1)}"
            checked += 1
    assert checked >= 30, f"only {checked} figures found: did the sections change shape?"


def _config_classes() -> dict[str, type]:
    """The public dataclasses a user configures tensorwire with, by name."""
    import tensorwire
    from tensorwire import collective, ps, rpc, transports

    found: dict[str, type] = {}
    for module in (tensorwire, rpc, transports, collective, ps):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and dataclasses.is_dataclass(value):
                found[name] = value
    return found


def test_options_the_docs_name_exist() -> None:
    # `ClientConfig(timeline=...)` in a page is a promise that the field exists.
    classes = _config_classes()
    assert {"ClientConfig", "ServerConfig", "TransportConfig", "GroupConfig"} <= set(classes)
    checked = 0
    for page in PAGES:
        # A qualified name (serde.Limits) is another class than the bare one.
        for match in re.finditer(r"(?<![\w.])([A-Z]\w*)\((\w+)=", page.read_text()):
            cls = classes.get(match.group(1))
            if cls is None:
                continue
            names = {f.name for f in dataclasses.fields(cls)}
            assert match.group(2) in names, (
                f"{page.relative_to(ROOT)}: {match.group(0)}...) names no field of "
                f"{cls.__name__}")
            checked += 1
    assert checked >= 20, f"only {checked} options found: did the pattern break?"


def test_the_docs_deny_no_option_that_exists() -> None:
    # A sentence such as "RPC calls do not take a timeline yet", left behind
    # when ClientConfig gained `timeline`, contradicts the API.
    fields = {f.name for cls in _config_classes().values() for f in dataclasses.fields(cls)}
    denial = re.compile(r"\b(?:do|does|can|could)(?: not|n't) (?:yet )?(?:take|have|support|"
                        r"accept|record on) (?:a |an |the |any )?`?(\w+)`?")
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for match in denial.finditer(text):
            assert match.group(1) not in fields, (
                f"{page.relative_to(ROOT)} says {match.group(0)!r}, but a config has "
                f"`{match.group(1)}`")
