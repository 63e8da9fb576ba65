"""The server's two ways of running a unary call, over real connections:
at once (a handler with no ``await`` runs to its end with no task) and in a
task (every other one). Both must look the same to a client, to metrics and
to the timeline."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import pytest

import tensorwire as tw
from tensorwire import rpc
from tensorwire.errors import DeadlineExceeded, Internal, InvalidArgument, NotFound
from tensorwire.rpc import ServerConfig
from tensorwire.timeline import Timeline

from .test_rpc import serving

_TAG: contextvars.ContextVar[str] = contextvars.ContextVar("dispatch_tag", default="unset")


async def _no_suspension(x: int) -> int:
    return x + 1


def _fail(kind: str) -> None:
    if kind == "expected":
        raise NotFound(f"no {kind} thing")
    raise KeyError(kind)


class Steps(rpc.Service):
    """Unary handlers that finish in their first step and ones that suspend."""

    def __init__(self) -> None:
        self.running = 0
        self.cancelled: list[str] = []

    @rpc.method
    async def at_once(self, x: int) -> int:
        return x + 1

    @rpc.method
    async def awaits_without_suspending(self, x: int) -> int:
        return await _no_suspension(x)

    @rpc.method
    async def suspends(self, x: int, tag: str) -> list[Any]:
        _TAG.set(tag)
        await asyncio.sleep(0)  # a bare yield
        await asyncio.sleep(0.01)  # a future
        return [x + 1, _TAG.get()]

    @rpc.method
    async def tag(self) -> str:
        return _TAG.get()

    @rpc.method
    async def needs_a_task(self) -> bool:
        # Before its first suspension too (asyncio.timeout, TaskGroup).
        async with asyncio.timeout(5), asyncio.TaskGroup() as group:
            group.create_task(asyncio.sleep(0))
        return asyncio.current_task() is not None

    @rpc.method
    async def fails_at_once(self, kind: str) -> None:
        _fail(kind)

    @rpc.method
    async def fails_after_suspending(self, kind: str) -> None:
        await asyncio.sleep(0)
        _fail(kind)

    @rpc.method
    async def waits(self, tag: str) -> None:
        self.running += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.append(tag)
            raise
        finally:
            self.running -= 1


async def test_handlers_that_suspend_or_not_answer_alike(url: str) -> None:
    async with serving(url, Steps()) as server, tw.connect(server.addresses[0]) as client:
        assert await client.call("Steps.at_once", 1) == 2
        assert await client.call("Steps.awaits_without_suspending", 2) == 3
        assert await client.call("Steps.at_once", x=4) == 5
        assert await client.call("Steps.suspends", 5, "t") == [6, "t"]
        assert await client.call("Steps.needs_a_task") is True
        with pytest.raises(InvalidArgument, match=r"Steps.at_once\(x: int\)"):
            await client.call("Steps.at_once", 1, 2)


async def test_context_variables_stay_with_their_call(url: str) -> None:
    # Each call has a context of its own, kept across its suspension and
    # gone after it, answered at once or not.
    async with serving(url, Steps()) as server, tw.connect(server.addresses[0]) as client:
        tags = [f"call {i}" for i in range(50)]
        results = await asyncio.gather(*(client.call("Steps.suspends", i, tag)
                                         for i, tag in enumerate(tags)))
        assert results == [[i + 1, tag] for i, tag in enumerate(tags)]
        assert await client.call("Steps.tag") == "unset"
    assert _TAG.get() == "unset"


@pytest.mark.parametrize("method", ["fails_at_once", "fails_after_suspending"])
async def test_handler_errors_reach_the_client_alike(url: str, method: str) -> None:
    async with serving(url, Steps()) as server, tw.connect(server.addresses[0]) as client:
        with pytest.raises(NotFound, match="no expected thing") as expected:
            await client.call(f"Steps.{method}", "expected")
        assert expected.value.type_name == "NotFound"
        with pytest.raises(Internal) as internal:
            await client.call(f"Steps.{method}", "surprise")
        assert internal.value.type_name == "KeyError"
        assert "surprise" in internal.value.message
        assert "in _fail" in internal.value.remote_traceback
        assert await client.call("Steps.at_once", 1) == 2  # the connection goes on
        assert server.metrics()[f"Steps.{method}"]["errors"] == 2


async def test_calls_answered_at_once_are_in_metrics_and_timeline() -> None:
    timeline = Timeline()
    config = ServerConfig(timeline=timeline)
    async with serving("tcp://127.0.0.1:0", Steps(), config=config) as server, \
            tw.connect(server.addresses[0]) as client:
        for i in range(3):
            await client.call("Steps.at_once", i)
        with pytest.raises(NotFound):
            await client.call("Steps.fails_at_once", "expected")
        await client.call("Steps.suspends", 1, "x")
        theirs, ours = server.metrics(), client.metrics()
    at_once = theirs["Steps.at_once"]
    assert at_once["calls"] == 3 and at_once["errors"] == 0
    assert at_once["p50"] is not None and at_once["seconds"] > 0
    for method in ("Steps.at_once", "Steps.fails_at_once", "Steps.suspends"):
        assert theirs[method]["bytes_in"] == ours[method]["bytes_out"] > 0
        assert theirs[method]["bytes_out"] == ours[method]["bytes_in"] > 0
    assert theirs["Steps.fails_at_once"]["errors"] == 1
    assert [(e["name"], e["cat"], e["args"]["error"]) for e in timeline.events] == [
        ("Steps.at_once", "rpc.server", False)] * 3 + [
        ("Steps.fails_at_once", "rpc.server", True), ("Steps.suspends", "rpc.server", False)]
    assert all(e["dur"] >= 0 for e in timeline.events)


async def test_deadline_and_cancel_reach_a_handler_that_suspends(url: str) -> None:
    steps = Steps()
    async with serving(url, steps) as server, tw.connect(server.addresses[0]) as client:
        with pytest.raises(DeadlineExceeded, match="within its deadline"):
            await client.call("Steps.waits", "deadline", timeout=0.2)
        # A cancel at any point: before the request is sent, right behind it,
        # or once the handler waits.
        for turns in (0, 1, 2, 3, 5, 10):
            task = asyncio.create_task(client.call("Steps.waits", f"cancel {turns}"))
            for _ in range(turns):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        task = asyncio.create_task(client.call("Steps.waits", "late cancel"))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not steps.running and "late cancel" in steps.cancelled:
                break
            await asyncio.sleep(0.01)
        # No handler is left waiting, and every call left the server.
        assert steps.running == 0
        assert {"deadline", "late cancel"} <= set(steps.cancelled)
        assert all(not session.calls for session in server._sessions)
        assert await client.call("Steps.at_once", 1) == 2


async def test_a_call_that_waits_for_a_server_slot_runs_in_a_task() -> None:
    steps = Steps()
    config = ServerConfig(max_concurrent=1)
    async with serving("tcp://127.0.0.1:0", steps, config=config) as server, \
            tw.connect(server.addresses[0]) as client:
        holder = asyncio.create_task(client.call("Steps.suspends", 1, "holder"))
        for _ in range(100):
            if server._slots is not None and server._slots.free == 0:
                break
            await asyncio.sleep(0.001)
        # The only slot is taken: this one waits for it, then answers.
        assert await client.call("Steps.at_once", 1) == 2
        assert await holder == [2, "holder"]
        assert server._slots is not None and server._slots.free == 1
