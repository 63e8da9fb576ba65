"""The RPC suite runs over every transport."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

URLS: dict[str, Any] = {
    "tcp": "tcp://127.0.0.1:0",
    "inproc": "inproc://rpc*",
    "ucx": pytest.param(
        "ucx://127.0.0.1:0",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed"
        ),
        id="ucx",
    ),
}


@pytest.fixture(params=list(URLS.values()), ids=list(URLS))
def url(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value
