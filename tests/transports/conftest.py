"""Fixtures for the transport tests: every test runs on asyncio and uvloop,
and conformance tests run over every transport."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a core dependency on Linux
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop
    }
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def _has_ucxx() -> bool:
    return importlib.util.find_spec("ucxx") is not None


TRANSPORTS: dict[str, Any] = {
    "tcp": "tcp://127.0.0.1:0",
    "tcp6": "tcp://[::1]:0",
    "inproc": "inproc://conformance*",
    "ucx": pytest.param(
        "ucx://127.0.0.1:0",
        marks=pytest.mark.skipif(not _has_ucxx(), reason="ucxx is not installed"),
        id="ucx",
    ),
}


@pytest.fixture(params=list(TRANSPORTS.values()), ids=list(TRANSPORTS))
def listen_url(request: pytest.FixtureRequest) -> str:
    url: str = request.param
    return url
