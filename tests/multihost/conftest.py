"""The emulated-host test bed as a fixture, and processes started inside its hosts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tensorwire.testing.netbed import NamespaceUnavailable, Testbed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bed(request: pytest.FixtureRequest) -> Iterator[Testbed]:
    hosts = getattr(request, "param", 3)
    testbed = Testbed(hosts)
    try:
        testbed.up()
    except NamespaceUnavailable as exc:
        testbed.down()
        pytest.skip(f"cannot make network namespaces: {exc}")
    try:
        yield testbed
    finally:
        testbed.down()


async def spawn(bed: Testbed, host: int, *argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        *bed.command(host, [sys.executable, *argv]), cwd=ROOT,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
