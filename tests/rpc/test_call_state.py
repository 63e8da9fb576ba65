"""The rules of one call (tensorwire.rpc._calls), without sockets: tables of
legal and illegal sequences for both roles, credit accounting, and a
client-role and a server-role CallState driven back to back by hypothesis."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tensorwire import errors
from tensorwire.errors import ConfigError, LocalProtocolError, ProtocolError
from tensorwire.rpc import protocol
from tensorwire.rpc._calls import (
    CANCELLED,
    CLIENT,
    ENDED,
    EXPIRED,
    FAILED,
    MAX_CREDIT,
    OPEN,
    RESPONDED,
    SERVER,
    CallState,
)

K = protocol.Kind
REQUEST, RESPONSE, ERROR, CANCEL = K.REQUEST, K.RESPONSE, K.ERROR, K.CANCEL
ITEM, END, CREDIT = K.ITEM, K.END, K.CREDIT

#: A step: (who acts, "send" or "receive", kind, count); the same CallState
#: sees the whole sequence from one side.
Step = tuple[str, int, int]


def _client(arg: bool = False, result: bool = False, window: int = 4) -> CallState:
    return CallState(CLIENT, arg, result, window if result else 0)


def _server(arg: bool = False, result: bool = False, window: int = 4) -> CallState:
    return CallState(SERVER, arg, result, window if arg else 0)


def _run(state: CallState, steps: list[Step]) -> None:
    for action, kind, count in steps:
        if action == "send":
            state.send(kind, count)
        else:
            assert state.receive(kind, count) is True, (action, kind)


def test_the_kinds_are_the_protocols() -> None:
    # _calls.pyx numbers the kinds itself (a C enum); they must agree.
    assert [int(k) for k in (REQUEST, RESPONSE, ERROR, CANCEL, ITEM, END, CREDIT)] == [
        10, 11, 12, 13, 14, 15, 16]


# -- legal sequences ------------------------------------------------------------

S, R = "send", "receive"

LEGAL_CLIENT: list[tuple[dict[str, bool], list[Step], int]] = [
    ({}, [(S, REQUEST, 0), (R, RESPONSE, 0)], RESPONDED),
    ({}, [(S, REQUEST, 0), (R, ERROR, 0)], FAILED),
    ({}, [(S, REQUEST, 0), (S, CANCEL, 0)], CANCELLED),
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, 4), (R, ITEM, 0), (R, ITEM, 0),
                        (R, END, 0)], ENDED),
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, 4), (R, ITEM, 0), (R, ERROR, 0)], FAILED),
    ({"result": True}, [(S, REQUEST, 0), (R, END, 0)], ENDED),
    ({"arg": True}, [(S, REQUEST, 0), (R, CREDIT, 2), (S, ITEM, 0), (S, ITEM, 0),
                     (S, END, 0), (R, RESPONSE, 0)], RESPONDED),
    # The server may answer before the argument stream has ended.
    ({"arg": True}, [(S, REQUEST, 0), (R, CREDIT, 2), (S, ITEM, 0), (R, RESPONSE, 0)],
     RESPONDED),
    # A grant that crossed the client's END.
    ({"arg": True}, [(S, REQUEST, 0), (S, END, 0), (R, CREDIT, 2), (R, ERROR, 0)], FAILED),
    ({"arg": True, "result": True},
     [(S, REQUEST, 0), (S, CREDIT, 4), (R, CREDIT, 1), (S, ITEM, 0), (R, ITEM, 0),
      (S, END, 0), (R, ITEM, 0), (R, END, 0)], ENDED),
    # A stream asked of a unary method: its RESPONSE ends the call.
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, 4), (R, RESPONSE, 0)], RESPONDED),
]

LEGAL_SERVER: list[tuple[dict[str, bool], list[Step], int]] = [
    ({}, [(R, REQUEST, 0), (S, RESPONSE, 0)], RESPONDED),
    ({}, [(R, REQUEST, 0), (S, ERROR, 0)], FAILED),
    ({}, [(R, REQUEST, 0), (R, CANCEL, 0)], CANCELLED),
    ({"result": True}, [(R, REQUEST, 0), (R, CREDIT, 2), (S, ITEM, 0), (S, ITEM, 0),
                        (R, CREDIT, 1), (S, ITEM, 0), (S, END, 0)], ENDED),
    ({"result": True}, [(R, REQUEST, 0), (S, ERROR, 0)], FAILED),
    ({"arg": True}, [(R, REQUEST, 0), (S, CREDIT, 2), (R, ITEM, 0), (R, ITEM, 0),
                     (R, END, 0), (S, RESPONSE, 0)], RESPONDED),
    ({"arg": True}, [(R, REQUEST, 0), (S, CREDIT, 2), (R, ITEM, 0), (S, ERROR, 0)], FAILED),
    ({"arg": True}, [(R, REQUEST, 0), (S, CREDIT, 2), (R, ITEM, 0), (R, CANCEL, 0)],
     CANCELLED),
]


@pytest.mark.parametrize(("flags", "steps", "outcome"), LEGAL_CLIENT)
def test_legal_client_sequences(flags: dict[str, bool], steps: list[Step],
                                outcome: int) -> None:
    state = _client(**flags)
    _run(state, steps)
    assert state.outcome == outcome and state.done


@pytest.mark.parametrize(("flags", "steps", "outcome"), LEGAL_SERVER)
def test_legal_server_sequences(flags: dict[str, bool], steps: list[Step],
                                outcome: int) -> None:
    state = _server(**flags)
    _run(state, steps)
    assert state.outcome == outcome and state.done


# -- illegal sequences: the last step is refused ------------------------------------

ILLEGAL_CLIENT: list[tuple[dict[str, bool], list[Step]]] = [
    ({}, [(S, ITEM, 0)]),                                     # before REQUEST
    ({}, [(R, RESPONSE, 0)]),                                 # an answer to nothing
    ({}, [(S, REQUEST, 0), (S, REQUEST, 0)]),
    ({}, [(S, REQUEST, 0), (S, RESPONSE, 0)]),                # the server's message
    ({}, [(S, REQUEST, 0), (R, REQUEST, 0)]),
    ({}, [(S, REQUEST, 0), (R, CANCEL, 0)]),
    ({}, [(S, REQUEST, 0), (R, ITEM, 0)]),                    # a unary call
    ({}, [(S, REQUEST, 0), (R, END, 0)]),
    ({}, [(S, REQUEST, 0), (R, CREDIT, 1)]),                  # no argument stream
    ({}, [(S, REQUEST, 0), (S, ITEM, 0)]),
    ({}, [(S, REQUEST, 0), (R, RESPONSE, 0), (R, RESPONSE, 0)]),
    ({}, [(S, REQUEST, 0), (R, ERROR, 0), (R, ERROR, 0)]),
    ({}, [(S, REQUEST, 0), (R, RESPONSE, 0), (S, CANCEL, 0)]),
    ({}, [(S, REQUEST, 0), (S, CANCEL, 0), (S, CANCEL, 0)]),
    ({"result": True}, [(S, REQUEST, 0), (R, ITEM, 0)]),      # no credit granted
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, 1), (R, ITEM, 0), (R, ITEM, 0)]),
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, 2), (R, END, 0), (R, ITEM, 0)]),
    ({"result": True}, [(S, REQUEST, 0), (R, END, 0), (R, ERROR, 0)]),
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, 0)]),
    ({"result": True}, [(S, REQUEST, 0), (S, CREDIT, MAX_CREDIT + 1)]),
    ({"arg": True}, [(S, REQUEST, 0), (S, ITEM, 0)]),         # no credit yet
    ({"arg": True}, [(S, REQUEST, 0), (R, CREDIT, 1), (S, ITEM, 0), (S, ITEM, 0)]),
    ({"arg": True}, [(S, REQUEST, 0), (S, END, 0), (S, END, 0)]),
    ({"arg": True}, [(S, REQUEST, 0), (R, CREDIT, 1), (S, END, 0), (S, ITEM, 0)]),
    ({"arg": True}, [(S, REQUEST, 0), (R, CREDIT, -3)]),
    ({"arg": True}, [(S, REQUEST, 0), (R, RESPONSE, 0), (S, ITEM, 0)]),
    ({"arg": True}, [(S, REQUEST, 0), (S, CREDIT, 1)]),       # receives no stream
]

ILLEGAL_SERVER: list[tuple[dict[str, bool], list[Step]]] = [
    ({}, [(S, RESPONSE, 0)]),                                 # before REQUEST
    ({}, [(R, CANCEL, 0)]),
    ({}, [(R, REQUEST, 0), (R, REQUEST, 0)]),
    ({}, [(R, REQUEST, 0), (S, REQUEST, 0)]),
    ({}, [(R, REQUEST, 0), (S, CANCEL, 0)]),
    ({}, [(R, REQUEST, 0), (R, RESPONSE, 0)]),
    ({}, [(R, REQUEST, 0), (R, ITEM, 0)]),
    ({}, [(R, REQUEST, 0), (S, ITEM, 0)]),                    # a unary result
    ({}, [(R, REQUEST, 0), (S, END, 0)]),
    ({}, [(R, REQUEST, 0), (S, RESPONSE, 0), (S, RESPONSE, 0)]),
    ({}, [(R, REQUEST, 0), (S, RESPONSE, 0), (S, ERROR, 0)]),
    ({}, [(R, REQUEST, 0), (R, CANCEL, 0), (S, RESPONSE, 0)]),
    ({}, [(R, REQUEST, 0), (R, CANCEL, 0), (R, CANCEL, 0)]),
    ({"result": True}, [(R, REQUEST, 0), (S, ITEM, 0)]),      # no credit yet
    ({"result": True}, [(R, REQUEST, 0), (R, CREDIT, 1), (S, ITEM, 0), (S, ITEM, 0)]),
    ({"result": True}, [(R, REQUEST, 0), (S, RESPONSE, 0)]),
    ({"result": True}, [(R, REQUEST, 0), (S, END, 0), (S, ITEM, 0)]),
    ({"result": True}, [(R, REQUEST, 0), (R, CREDIT, 0)]),
    ({"arg": True}, [(R, REQUEST, 0), (R, ITEM, 0)]),         # before any grant
    ({"arg": True}, [(R, REQUEST, 0), (S, CREDIT, 1), (R, ITEM, 0), (R, ITEM, 0)]),
    ({"arg": True}, [(R, REQUEST, 0), (R, END, 0), (R, ITEM, 0)]),
    ({"arg": True}, [(R, REQUEST, 0), (R, END, 0), (R, END, 0)]),
    ({"arg": True}, [(R, REQUEST, 0), (R, END, 0), (S, CREDIT, 1)]),
    ({"arg": True}, [(R, REQUEST, 0), (R, CREDIT, 0)]),       # a count below 1
    ({}, [(R, REQUEST, 0), (R, CREDIT, -1)]),
]


def _refused(state: CallState, steps: list[Step]) -> None:
    _run(state, steps[:-1])
    before = repr(state)
    action, kind, count = steps[-1]
    if action == "send":
        with pytest.raises(LocalProtocolError):
            state.send(kind, count)
    else:
        with pytest.raises(ProtocolError) as info:
            state.receive(kind, count)
        assert not isinstance(info.value, LocalProtocolError)
    assert repr(state) == before, "a refused message changed the state"


@pytest.mark.parametrize(("flags", "steps"), ILLEGAL_CLIENT)
def test_illegal_client_sequences(flags: dict[str, bool], steps: list[Step]) -> None:
    _refused(_client(**flags), steps)


@pytest.mark.parametrize(("flags", "steps"), ILLEGAL_SERVER)
def test_illegal_server_sequences(flags: dict[str, bool], steps: list[Step]) -> None:
    _refused(_server(**flags), steps)


# -- ends decided here, and what may follow them -------------------------------------


def test_what_arrives_after_this_sides_own_end_is_dropped() -> None:
    client = _client(result=True)
    client.send(REQUEST)
    client.send(CANCEL)
    # The server's messages may have crossed the CANCEL.
    assert client.receive(ITEM) is False
    assert client.receive(ERROR) is False
    server = _server(arg=True)
    server.receive(REQUEST)
    server.open_window()
    server.send(RESPONSE)
    assert server.receive(ITEM) is False
    assert server.receive(END) is False
    assert server.receive(CANCEL) is False
    assert server.outcome == RESPONDED


def test_the_server_drops_credit_for_a_result_that_does_not_stream() -> None:
    # The client cannot know whether a method streams: stream() grants credit.
    for server in (_server(), _server(arg=True)):
        server.receive(REQUEST)
        assert server.receive(CREDIT, 4) is False
        assert server.send_credit == 0
    client = _client()
    client.send(REQUEST)
    with pytest.raises(ProtocolError):
        client.receive(CREDIT, 4)  # the server knows whether the argument streams


def test_after_its_deadline_the_client_may_send_one_cancel() -> None:
    client = _client()
    client.send(REQUEST)
    assert client.expire() is True
    assert client.expire() is False
    assert client.outcome == EXPIRED
    assert client.receive(ERROR) is False  # the server's DEADLINE_EXCEEDED
    client.send(CANCEL)
    with pytest.raises(LocalProtocolError):
        client.send(CANCEL)


def test_after_its_deadline_the_server_may_send_one_error() -> None:
    server = _server(result=True)
    server.receive(REQUEST)
    server.receive(CREDIT, 3)
    server.expire()
    with pytest.raises(LocalProtocolError):
        server.send(ITEM)
    server.send(ERROR)
    with pytest.raises(LocalProtocolError):
        server.send(ERROR)
    assert server.outcome == EXPIRED


def test_a_deadline_after_the_outcome_changes_nothing() -> None:
    client = _client()
    client.send(REQUEST)
    client.receive(RESPONSE)
    assert client.expire() is False
    assert client.outcome == RESPONDED


def test_a_call_that_expired_before_its_request_sends_nothing() -> None:
    client = _client()
    client.expire()
    with pytest.raises(LocalProtocolError):
        client.send(CANCEL)


# -- credit -------------------------------------------------------------------------


def test_credit_is_returned_after_half_the_window() -> None:
    client = _client(result=True, window=8)
    client.send(REQUEST)
    assert client.open_window() == 8
    assert client.recv_credit == 8
    for _ in range(8):
        client.receive(ITEM)
    assert client.recv_credit == 0
    returned = [client.consume() for _ in range(8)]
    assert returned == [0, 0, 0, 4, 0, 0, 0, 4]
    assert client.recv_credit == 8 and client.unconsumed == 0


def test_a_window_of_one_returns_each_item() -> None:
    server = _server(arg=True, window=1)
    server.receive(REQUEST)
    assert server.open_window() == 1
    server.receive(ITEM)
    assert server.consume() == 1
    server.receive(ITEM)
    server.receive(END)
    assert server.consume() == 0  # the stream ended: no more credit


def test_consume_needs_a_received_item() -> None:
    client = _client(result=True)
    client.send(REQUEST)
    client.open_window()
    with pytest.raises(LocalProtocolError):
        client.consume()


def test_the_window_opens_once_and_only_on_a_received_stream() -> None:
    client = _client(result=True)
    with pytest.raises(LocalProtocolError):
        client.open_window()  # before REQUEST
    client.send(REQUEST)
    client.open_window()
    with pytest.raises(LocalProtocolError):
        client.open_window()
    unary = _client()
    unary.send(REQUEST)
    with pytest.raises(LocalProtocolError):
        unary.open_window()


def test_items_consumed_after_the_end_return_no_credit() -> None:
    client = _client(result=True, window=2)
    client.send(REQUEST)
    client.open_window()
    client.receive(ITEM)
    client.receive(ITEM)
    client.receive(END)
    assert [client.consume(), client.consume()] == [0, 0]


def test_bad_construction() -> None:
    with pytest.raises(ConfigError):
        CallState(2)
    with pytest.raises(ConfigError):
        CallState(CLIENT, False, True, 0)  # receives a stream: needs a window
    with pytest.raises(ConfigError):
        CallState(SERVER, True, False, MAX_CREDIT + 1)


# -- both sides back to back ----------------------------------------------------------

#: The kinds a side may try to send, with a CREDIT count where it needs one.
_KINDS = [REQUEST, RESPONSE, ERROR, CANCEL, ITEM, END, CREDIT]
_ROLES = {"client": CLIENT, "server": SERVER}


class BackToBack(RuleBasedStateMachine):
    """A client-role and a server-role CallState, each side's sends queued
    to the other in order, delivered in random interleavings."""

    def __init__(self) -> None:
        super().__init__()
        self.sides: dict[str, CallState] = {}
        # What each side sent and the other has not received yet.
        self.wires: dict[str, deque[tuple[int, int]]] = {}
        self.delivered_after_end = {"client": 0, "server": 0}
        self.outcomes: dict[str, int] = {}
        self.result_streams = False

    @rule(arg=st.booleans(), result=st.booleans(), window=st.integers(1, 5))
    @precondition(lambda self: not self.sides)
    def start(self, arg: bool, result: bool, window: int) -> None:
        self.sides = {"client": CallState(CLIENT, arg, result, window if result else 0),
                      "server": CallState(SERVER, arg, result, window if arg else 0)}
        self.wires = {"client": deque(), "server": deque()}
        self.outcomes = {}
        self.result_streams = result
        self.sides["client"].send(REQUEST)
        self.wires["client"].append((REQUEST, 0))

    def _send(self, who: str, kind: int, count: int = 0) -> bool:
        """Send if the rules allow; a refusal changes nothing."""
        try:
            self.sides[who].send(kind, count)
        except LocalProtocolError:
            return False
        self.wires[who].append((kind, count))
        return True

    @rule(who=st.sampled_from(["client", "server"]),
          kind=st.sampled_from([ITEM, END, RESPONSE, ERROR, CANCEL]))
    @precondition(lambda self: bool(self.sides))
    def send(self, who: str, kind: int) -> None:
        self._send(who, kind)

    @rule(who=st.sampled_from(["client", "server"]))
    @precondition(lambda self: bool(self.sides))
    def open_window(self, who: str) -> None:
        state = self.sides[who]
        try:
            count = state.open_window()
        except LocalProtocolError:
            return
        self.wires[who].append((CREDIT, count))

    @rule(who=st.sampled_from(["client", "server"]))
    @precondition(lambda self: bool(self.sides))
    def consume(self, who: str) -> None:
        state = self.sides[who]
        if state.unconsumed == 0:
            return
        count = state.consume()
        if count:
            self.wires[who].append((CREDIT, count))

    @rule(who=st.sampled_from(["client", "server"]))
    @precondition(lambda self: bool(self.sides))
    def expire(self, who: str) -> None:
        state = self.sides[who]
        if not state.requested:
            return  # the server's timer starts with the REQUEST
        if state.expire():
            # What each role does once its deadline passes.
            self._send(who, CANCEL if who == "client" else ERROR)

    @rule(who=st.sampled_from(["client", "server"]))
    @precondition(lambda self: bool(self.sides))
    def deliver(self, who: str) -> None:
        """The oldest message in flight from ``who`` arrives."""
        if not self.wires[who]:
            return
        kind, count = self.wires[who].popleft()
        other = "server" if who == "client" else "client"
        state = self.sides[other]
        done_before = state.done
        # What the rules let one side send, the other always accepts.
        if state.receive(kind, count) and done_before:
            self.delivered_after_end[other] += 1

    @rule(who=st.sampled_from(["client", "server"]), kind=st.sampled_from(_KINDS),
          count=st.integers(-1, 3))
    @precondition(lambda self: bool(self.sides))
    def forged(self, who: str, kind: int, count: int) -> None:
        """``who`` sends, behind its CallState's back, what the rules
        forbid it: with nothing in flight, the receiver refuses it with a
        ProtocolError, unless the receiver's own end makes it drop
        everything, or the sender's deadline (which the peer cannot know)
        is why it is forbidden."""
        if self.wires["client"] or self.wires["server"]:
            return
        sender = self.sides[who]
        receiver = self.sides["server" if who == "client" else "client"]
        # A refused send changes nothing (the tables check that).
        if self._send(who, kind, count):
            return  # allowed: not a forgery
        if sender.outcome == EXPIRED or (receiver.done and not receiver.ended_by_peer):
            return
        if kind == CREDIT and receiver.out_ended:
            return  # a late grant may cross the receiver's END: it is taken
        before = repr(receiver)
        if (kind == CREDIT and who == "client" and not self.result_streams
                and 0 < count <= MAX_CREDIT and not receiver.done):
            # What stream() of a unary method grants: the server cannot
            # tell it from a forgery, and drops it.
            assert receiver.receive(kind, count) is False
            assert repr(receiver) == before
            return
        if kind == RESPONSE and who == "server" and self.result_streams and not receiver.done:
            # A client that asked for a stream of what turned out to be a
            # unary method takes the RESPONSE as the end (the caller
            # reports the mismatch).
            assert receiver.receive(kind, count) is True
            assert receiver.outcome == RESPONDED
            self.sides = {}
            return
        try:
            receiver.receive(kind, count)
        except LocalProtocolError:  # pragma: no cover - the wrong side's error
            raise AssertionError("a received message raised LocalProtocolError") from None
        except ProtocolError:
            assert repr(receiver) == before
        else:
            raise AssertionError(f"{receiver!r} accepted a forged {kind!r} ({count})")
        # The connection would end here: start a fresh call.
        self.sides = {}

    @invariant()
    def credit_never_negative(self) -> None:
        for state in self.sides.values():
            assert state.send_credit >= 0 and state.recv_credit >= 0
            assert state.unconsumed >= 0 and state.unreturned >= 0

    @invariant()
    def nothing_delivered_after_the_end(self) -> None:
        assert self.delivered_after_end == {"client": 0, "server": 0}

    @invariant()
    def both_sides_agree_once_the_wires_are_empty(self) -> None:
        if not self.sides or self.wires["client"] or self.wires["server"]:
            return
        client, server = self.sides["client"], self.sides["server"]
        # Each side sends its end (the server's answer, the client's CANCEL,
        # each one's message after its deadline): once it has arrived,
        # both sides are done.
        assert client.done == server.done, (client, server)
        if client.ended_by_peer:
            # What the client received is what the server sent.
            assert server.outcome in (client.outcome, EXPIRED), (client, server)
        if server.ended_by_peer:
            assert client.outcome in (CANCELLED, EXPIRED), (client, server)
        if server.outcome in (RESPONDED, ENDED, FAILED):
            # The client heard it, unless it had ended first.
            assert client.outcome == server.outcome or not client.ended_by_peer
        if not client.done and not server.done:
            # Every credit granted and not yet used is the sender's to use.
            assert client.send_credit == server.recv_credit
            assert server.send_credit == client.recv_credit

    @invariant()
    def one_outcome_per_side(self) -> None:
        for who, state in self.sides.items():
            first = self.outcomes.setdefault(who, state.outcome)
            if first == OPEN:
                self.outcomes[who] = state.outcome
            else:
                assert state.outcome == first, "a second terminal outcome"


TestBackToBack = BackToBack.TestCase
TestBackToBack.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])


def test_a_local_error_is_a_protocol_error_of_this_side() -> None:
    # Callers that end a connection on ProtocolError catch both; the name
    # says whose fault it was (h11's LocalProtocolError/RemoteProtocolError).
    assert issubclass(LocalProtocolError, ProtocolError)
    assert "LocalProtocolError" in errors.__all__
