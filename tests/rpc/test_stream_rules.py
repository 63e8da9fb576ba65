"""The rules of a call's streams (tensorwire.rpc._streams.CallStreams over
CallState), without sockets: both roles' streams joined back to back by an
in-memory wire, tables of what a receiver must refuse, and
hypothesis-generated schedules (every run either completes with the items in
order or fails with ProtocolError on the side that received the breach;
never a hang, never a lost item)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.errors import LocalProtocolError, ProtocolError, Unimplemented
from tensorwire.rpc import protocol
from tensorwire.rpc._calls import CLIENT, SERVER, CallState
from tensorwire.rpc._streams import CallStreams

K = protocol.Kind


class Wire:
    """One direction of a connection, in memory: what a side's streams
    send waits here, in order, until the test delivers it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: deque[protocol.Message] = deque()

    def send_soon(self, message: protocol.Message) -> None:
        self.queue.append(message)

    async def send(self, message: protocol.Message) -> int:
        self.queue.append(message)
        return 1


def _pair(direction: str, window: int) -> tuple[CallStreams, CallStreams, Wire, Wire]:
    """(sender, receiver, sender's wire, receiver's wire) of one call whose
    ``direction`` ("result": server to client, "argument": client to
    server) streams; the receiver has opened its window (its CREDIT is on
    its wire)."""
    loop = asyncio.get_running_loop()
    arg, result = direction == "argument", direction == "result"
    client = CallState(CLIENT, arg, result, window if result else 0)
    server = CallState(SERVER, arg, result, window if arg else 0)
    client.send(K.REQUEST)
    server.receive(K.REQUEST)
    to_server, to_client = Wire(loop), Wire(loop)
    c = CallStreams(client, to_server, "S.m", call_id=1)
    s = CallStreams(server, to_client, "S.m", call_id=1)
    sender, receiver = (s, c) if result else (c, s)
    wire_out, wire_back = (to_client, to_server) if result else (to_server, to_client)
    receiver.open()
    return sender, receiver, wire_out, wire_back


def _item(value: int) -> protocol.Item:
    return protocol.Item(1, [value])


# -- what a receiver refuses ------------------------------------------------------


async def _receiver(direction: str, window: int = 4, opened: bool = True) -> CallStreams:
    loop = asyncio.get_running_loop()
    arg, result = direction == "argument", direction == "result"
    role = CLIENT if result else SERVER
    state = CallState(role, arg, result, window)
    if role == CLIENT:
        state.send(K.REQUEST)
    else:
        state.receive(K.REQUEST)
    streams = CallStreams(state, Wire(loop), "S.m", call_id=1)
    if opened:
        streams.open()
    return streams


@pytest.mark.parametrize("direction", ["result", "argument"])
async def test_items_beyond_the_granted_credit_are_refused(direction: str) -> None:
    # Credit counts what was granted, not what is buffered: items taken
    # return credit, and the item beyond the grant is refused even when
    # the buffer is nearly empty (the bug of counting buffered items).
    streams = await _receiver(direction, window=4)
    for value in range(4):
        assert streams.receive(_item(value), 1)
    assert [streams.take().value for _ in range(4)] == [[0], [1], [2], [3]]  # type: ignore[union-attr]
    for value in range(4, 8):  # the returned credit: 2 + 2
        assert streams.receive(_item(value), 1)
    with pytest.raises(ProtocolError) as info:
        streams.receive(_item(8), 1)
    assert not isinstance(info.value, LocalProtocolError)


@pytest.mark.parametrize("direction", ["result", "argument"])
@pytest.mark.parametrize("steps", [
    [protocol.Item(1, [0])],                                       # before any CREDIT
    [protocol.End(1), protocol.Item(1, [0])],                      # after END
    [protocol.End(1), protocol.End(1)],
])
async def test_what_a_receiver_refuses(direction: str, steps: list[protocol.Message]) -> None:
    streams = await _receiver(direction, opened=steps[0].kind != K.ITEM)
    for message in steps[:-1]:
        assert streams.receive(message, 1)
    with pytest.raises(ProtocolError):
        streams.receive(steps[-1], 1)


async def test_an_item_on_a_call_without_that_stream_is_refused() -> None:
    loop = asyncio.get_running_loop()
    for role, arg in ((SERVER, False), (CLIENT, True)):
        state = CallState(role, arg, False, 0)
        state.receive(K.REQUEST) if role == SERVER else state.send(K.REQUEST)
        streams = CallStreams(state, Wire(loop), "S.m", call_id=1)
        with pytest.raises(ProtocolError):
            streams.receive(_item(0), 1)
        with pytest.raises(ProtocolError):
            streams.receive(protocol.End(1), 1)


@pytest.mark.parametrize("count", [0, -1])
async def test_a_credit_below_one_is_refused(count: int) -> None:
    loop = asyncio.get_running_loop()
    for role, arg, result in ((SERVER, False, True), (CLIENT, True, False), (SERVER, False, False)):
        state = CallState(role, arg, result, 0)
        state.receive(K.REQUEST) if role == SERVER else state.send(K.REQUEST)
        with pytest.raises(ProtocolError):
            CallStreams(state, Wire(loop), "S.m", call_id=1).receive(
                protocol.Credit(1, count), 1)


async def test_the_server_drops_credit_for_a_result_that_does_not_stream() -> None:
    loop = asyncio.get_running_loop()
    state = CallState(SERVER, False, False, 0)
    state.receive(K.REQUEST)
    streams = CallStreams(state, Wire(loop), "S.m", call_id=1)
    assert streams.receive(protocol.Credit(1, 16), 1) is False
    state.send(K.RESPONSE)  # the call goes on to its answer


async def test_a_stream_asked_of_a_unary_method_says_so() -> None:
    streams = await _receiver("result")
    assert streams.receive(protocol.Response(1, [b"x"]), 1)
    with pytest.raises(Unimplemented, match="call it with call"):
        await streams.next_item()
    assert streams.finished and streams.cancel() is False  # nothing to cancel


async def test_an_error_comes_after_the_items_before_it() -> None:
    streams = await _receiver("result")
    streams.receive(_item(0), 1)
    streams.receive(protocol.Error(1, 13, "Internal", "boom", ""), 1)
    assert (await streams.next_item()).value == [0]  # type: ignore[union-attr]
    with pytest.raises(Exception, match="boom"):
        await streams.next_item()


async def test_end_with_reaches_a_waiting_receiver_and_sender() -> None:
    sender, receiver, _, _ = _pair("result", 1)
    waiting = asyncio.ensure_future(receiver.next_item())
    sending = asyncio.ensure_future(sender.send_item([0]))  # no credit delivered yet
    await asyncio.sleep(0)
    lost = ProtocolError("lost")
    receiver.end_with(lost)
    sender.end_with(lost)
    for task in (waiting, sending):
        with pytest.raises(ProtocolError, match="lost"):
            await task


async def test_the_sender_stops_once_the_call_is_over() -> None:
    sender, _, _, _ = _pair("argument", 2)
    sender.receive(protocol.Credit(1, 2), 1)
    sender.receive(protocol.Response(1, [b"x"]), 1)  # answered before the END
    assert await sender.send_item([0]) is False
    assert await sender.send_end() is False


# -- both sides back to back -------------------------------------------------------

schedules = st.lists(st.sampled_from(["deliver", "back", "take", "run"]), max_size=80)


async def _back_to_back(direction: str, window: int, count: int, schedule: list[str],
                        breach: str | None, breach_at: int) -> None:
    sender, receiver, wire_out, wire_back = _pair(direction, window)

    async def produce() -> None:
        for value in range(count):
            assert await sender.send_item([value])
        assert await sender.send_end()

    producer = asyncio.ensure_future(produce())
    got: list[int] = []
    refused: ProtocolError | None = None
    breached = False

    def deliver() -> None:
        nonlocal refused, breached
        if breach is not None and not breached and len(got) >= breach_at and (
                (breach == "after_end" and receiver.state.in_ended)
                or (breach == "beyond" and receiver.state.recv_credit == sum(
                    m.kind == K.ITEM for m in wire_out.queue))):
            # The sender breaks the rules: an ITEM past END, or one beyond
            # every grant it had (not through its CallState).
            wire_out.queue.append(_item(-1))
            breached = True
        if wire_out.queue and refused is None:
            try:
                receiver.receive(wire_out.queue.popleft(), 1)
            except ProtocolError as exc:
                refused = exc

    def take() -> None:
        if any(m.kind == K.ITEM and m.value == [-1] for m in wire_out.queue):
            return  # the consumer holds its grants until the breach arrives
        item = receiver.take()
        if item is not None:
            got.append(item.value[0])

    def back() -> None:
        if wire_back.queue:
            sender.receive(wire_back.queue.popleft(), 1)

    steps = {"deliver": deliver, "take": take, "back": back}
    for step in schedule:
        if step == "run":
            await asyncio.sleep(0)
        else:
            steps[step]()
    # Then everything, until it ends: it must end.
    for _ in range(20 * (count + window) + 200):
        if refused is not None or (receiver.finished and producer.done() and not wire_out.queue):
            break
        back()
        deliver()
        take()
        await asyncio.sleep(0)
    else:
        pytest.fail(f"no progress: {sender!r} {receiver!r}")
    if refused is None:
        assert not breached
        assert got == list(range(count)), "items lost or out of order"
        await producer
    else:
        assert breached, f"refused without a breach: {refused}"
        assert not isinstance(refused, LocalProtocolError)  # the peer's breach
        assert got == list(range(len(got))), "items out of order"
        producer.cancel()


@settings(max_examples=150, deadline=None)
@given(direction=st.sampled_from(["result", "argument"]), window=st.integers(1, 5),
       count=st.integers(0, 12), schedule=schedules,
       breach=st.sampled_from([None, None, "beyond", "after_end"]), breach_at=st.integers(0, 12))
def test_back_to_back(direction: str, window: int, count: int, schedule: list[str],
                      breach: str | None, breach_at: int) -> None:
    asyncio.run(_back_to_back(direction, window, count, schedule, breach, breach_at))


def test_kinds_agree() -> None:
    got: list[Any] = [K.ITEM, K.END, K.CREDIT]
    assert [int(k) for k in got] == [14, 15, 16]
