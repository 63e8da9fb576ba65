"""Structured ``details`` on remote errors: the ERROR message's fifth field."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

import tensorwire as tw
from tensorwire import rpc
from tensorwire.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    NotFound,
    PlacementMoved,
    ProtocolError,
    RemoteError,
    Status,
)
from tensorwire.rpc import protocol as p


class Failing(rpc.Service):
    """Handlers that fail on purpose, with details."""

    @rpc.method
    async def refuse(self, details: dict[str, Any]) -> None:
        raise FailedPrecondition("not now", details=details)

    @rpc.method
    async def redirect(self, version: int) -> None:
        raise PlacementMoved(f"serving version {version}", version=version)

    @rpc.method
    async def unsendable(self, size: int) -> None:
        details: dict[str, Any] = {"array": np.zeros(2)} if size < 0 else {"blob": b"x" * size}
        raise FailedPrecondition("with details that cannot travel", details=details)

    @rpc.method
    async def echo(self, value: int) -> int:
        return value


def test_error_details_round_trip_and_stay_off_the_wire_when_empty() -> None:
    with_details = p.Error(7, int(Status.ABORTED), "PlacementMoved", "moved", "",
                           {"version": 3, "nested": {"keys": ["a", 1, None]}})
    assert p.parse(p.encode(with_details)) == with_details
    plain = p.Error(7, int(Status.NOT_FOUND), "NotFound", "no key", "Traceback ...")
    frames = p.encode(plain)
    # Four fields after kind and call id, as before details existed.
    assert len(msgpack.unpackb(frames[0])) == 6
    assert p.parse(frames) == plain


@pytest.mark.parametrize(
    ("details", "match"),
    [([1, 2], "must be a map"), ("version", "must be a map")],
)
def test_malformed_error_details_are_protocol_errors(details: Any, match: str) -> None:
    frame = msgpack.packb([12, 1, int(Status.ABORTED), "PlacementMoved", "m", "", details])
    with pytest.raises(ProtocolError, match=match):
        p.parse([frame])


def test_error_details_with_a_key_that_is_not_text_are_refused() -> None:
    frame = msgpack.packb([12, 1, int(Status.ABORTED), "PlacementMoved", "m", "", {1: 2}],
                          strict_types=False)
    with pytest.raises(ProtocolError):
        p.parse([frame])


def test_an_error_of_this_tree_is_rebuilt_by_name_only_with_its_own_status() -> None:
    assert RemoteError.for_status(Status.ABORTED, "PlacementMoved") is PlacementMoved
    assert RemoteError.for_status(Status.ABORTED, "Conflict") is Aborted
    # A peer cannot make any status into a PlacementMoved by naming it.
    assert RemoteError.for_status(Status.NOT_FOUND, "PlacementMoved") is NotFound
    assert RemoteError.for_status(Status.INTERNAL, "KeyError") is Internal
    moved = PlacementMoved("m", details={"version": "seven"})
    assert moved.version == 0  # a peer's nonsense is not a version
    assert PlacementMoved("m", version=4, details={"shard": 1}).details == {
        "shard": 1, "version": 4}


async def test_details_and_the_error_class_arrive_with_the_call(url: str) -> None:
    server = tw.Server([Failing()])
    await server.start(url)
    try:
        async with tw.connect(server.addresses[0]) as client:
            failing = client.proxy(Failing)
            details = {"step": 12, "workers": [1, 3], "why": "behind", "ok": False}
            with pytest.raises(FailedPrecondition, match="not now") as refused:
                await failing.refuse(details)
            assert refused.value.details == details
            assert "Traceback" in refused.value.remote_traceback
            with pytest.raises(PlacementMoved) as moved:
                await failing.redirect(5)
            assert moved.value.version == 5 and moved.value.details == {"version": 5}
            assert isinstance(moved.value, Aborted)
            # A redirect is an answer, not a fault: no traceback travels.
            assert moved.value.remote_traceback == ""
    finally:
        await server.close(grace=0)


@pytest.mark.parametrize("size", [-1, p.MAX_ERROR_DETAILS + 1])
async def test_details_that_cannot_travel_stay_behind(url: str, size: int) -> None:
    server = tw.Server([Failing()])
    await server.start(url)
    try:
        async with tw.connect(server.addresses[0]) as client:
            failing = client.proxy(Failing)
            with pytest.raises(FailedPrecondition, match="cannot travel") as caught:
                await failing.unsendable(size)
            assert caught.value.details == {}
            assert await failing.echo(3) == 3  # the connection is fine
    finally:
        await server.close(grace=0)
