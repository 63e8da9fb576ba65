"""The RPC server process the reliability tests aim at (tests/reliability/_server.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, child: subprocess.Popen[str], address: str) -> None:
        self.child = child
        self.address = address
        host, port = address.split("://", 1)[1].rsplit(":", 1)
        self.host_port = (host, int(port))

    def rss(self) -> int:
        """Resident memory of the server process, in bytes."""
        status = Path(f"/proc/{self.child.pid}/status").read_text()
        (line,) = [x for x in status.splitlines() if x.startswith("VmRSS:")]
        return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with spawn_server() as running:
        yield running


@pytest.fixture(scope="module")
def gc_off_server() -> Iterator[Server]:
    """The same server with the cycle collector off (``--gc-off``)."""
    with spawn_server("--gc-off") as running:
        yield running


@contextlib.contextmanager
def spawn_server(*args: str) -> Iterator[Server]:
    """The server process of tests/reliability/_server.py, with ``args``."""
    child = subprocess.Popen([sys.executable, "-m", "tests.reliability._server", *args],
                             cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        yield Server(child, child.stdout.readline().strip())
    finally:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()
