"""When a long turn's output goes out in batches and when whole
(``rpc._flush_gate.FlushGate``): its rules driven with a counter of our
own, the kernel's counter it reads, and a client and a server that share
one CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorwire.rpc._flush_gate import SKIP_FIRST, SKIP_MAX, FlushGate, involuntary_switches

ROOT = Path(__file__).resolve().parents[2]


class Switches:
    """A thread's involuntary context switches, as the test says they went."""

    def __init__(self, count: int = 0) -> None:
        self.count = count

    def __call__(self) -> int:
        return self.count


def long_turn(gate: FlushGate, switches: Switches, *, switched: bool = False,
              posted: int = 64) -> bool:
    """One turn that fills batches of 32 and posts ``posted`` messages in
    all; whether they went early. ``switched``: the thread was switched out
    after the first one."""
    early = gate.early(32)
    assert gate.early(64) == early  # asked again in the turn: the same answer
    if switched:
        switches.count += 1
    gate.turn_ended(posted)
    return early


def split_answers(gate: FlushGate, switches: Switches, turns: int) -> list[bool]:
    """Long turns of 64 messages, each followed by a turn of the 32 answers
    to its early batch (a peer that started on it at once); whether each
    long turn went early."""
    early = []
    for _ in range(turns):
        early.append(long_turn(gate, switches))
        gate.turn_ended(32)  # the answers to the early batch, on their own
    return early


def test_batches_go_early_while_the_peer_answers_them_on_their_own() -> None:
    switches = Switches()
    gate = FlushGate(switches)
    assert all(split_answers(gate, switches, 100))
    assert (gate.switched, gate.unsplit, gate.held) == (0, 0, 0)


def test_a_switched_turn_holds_the_next_ones_twice_as_long_each_time_up_to_the_max() -> None:
    switches = Switches()
    gate = FlushGate(switches)
    assert long_turn(gate, switches, switched=True)  # early, then switched out
    skips = []
    for _ in range(8):
        held = 0
        # Each skip ends with a turn that goes early and is switched out too.
        while not long_turn(gate, switches, switched=True):
            held += 1
        skips.append(held)
    assert skips == [min(SKIP_FIRST << i, SKIP_MAX) for i in range(8)]
    assert skips[-1] == SKIP_MAX
    assert (gate.switched, gate.unsplit, gate.held) == (9, 0, sum(skips))


def test_a_peer_that_answers_the_whole_turn_at_once_shuts_the_early_batches() -> None:
    # One CPU for both, and the kernel lets our turn finish: the peer runs
    # only after it, and answers every message of the turn in one turn of
    # its own, so our next turn is as long as the last. No switch is
    # counted, and yet the early batch bought nothing.
    switches = Switches()
    gate = FlushGate(switches)
    early = [long_turn(gate, switches) for _ in range(300)]
    # The first two go early (the second before the first is judged), and
    # so does each probe after a skip, twice as long each time up to the
    # max: at most three such pairs in the last 150 turns.
    assert early[:4] == [True, True, False, False]
    assert sum(early[150:]) <= 6
    assert gate.switched == 0 and gate.unsplit == sum(early)
    assert gate.held == 300 - sum(early)


def test_an_early_batch_answered_on_its_own_opens_the_gate_again() -> None:
    switches = Switches()
    gate = FlushGate(switches)
    for _ in range(3):  # switched out three times: 2, 4 and 8 turns held
        assert long_turn(gate, switches, switched=True)
        while not long_turn(gate, switches):
            pass
        gate.turn_ended(32)  # its early batch answered on its own
    # The turn that ended the skip went early, and the peer split its
    # answers: open again.
    assert all(split_answers(gate, switches, 20))
    assert long_turn(gate, switches, switched=True)
    held = 0
    while not long_turn(gate, switches):
        held += 1
    assert held == SKIP_FIRST  # the skip starts over


def test_only_long_turns_count_against_a_skip() -> None:
    switches = Switches()
    gate = FlushGate(switches)
    assert long_turn(gate, switches, switched=True)
    for _ in range(50):
        gate.turn_ended(5)  # turns that never filled a batch
    assert not long_turn(gate, switches)
    assert gate.held == 1


def test_a_turn_whose_early_batch_was_all_it_posted_is_not_judged() -> None:
    # 32 messages a turn: the batch goes at the turn's last message, with
    # nothing after it, so the next turn's length says nothing about it.
    switches = Switches()
    gate = FlushGate(switches)
    assert all(long_turn(gate, switches, posted=32) for _ in range(50))
    assert (gate.unsplit, gate.held) == (0, 0)


def test_where_switches_are_not_counted_the_peers_answers_still_judge() -> None:
    switches = Switches(-1)
    gate = FlushGate(switches)
    assert all(split_answers(gate, switches, 20))
    assert gate.switched == 0
    assert not all(long_turn(gate, switches) for _ in range(10))
    assert gate.unsplit >= 1 and gate.switched == 0


PREEMPTED = """
import os, sys, time
from tensorwire.rpc._flush_gate import involuntary_switches
cpu = int(sys.argv[1])
os.sched_setaffinity(0, {cpu})
busy = os.fork()
if busy == 0:  # a neighbour that wants the same CPU for a second
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
    os._exit(0)
before = involuntary_switches()
end = time.monotonic() + 0.5
while time.monotonic() < end:
    pass
print(involuntary_switches() - before)
os.waitpid(busy, 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD is Linux's")
def test_the_kernel_counts_a_thread_taken_off_its_cpu() -> None:
    assert involuntary_switches() >= 0
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", PREEMPTED, str(cpu)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=60)
    # Half a second beside a busy neighbour on one CPU: the scheduler takes
    # the CPU away many times.
    assert int(out.stdout) > 0


SERVER = """
import asyncio, os, sys
os.sched_setaffinity(0, {int(sys.argv[2])})
from tests.rpc.services import serve
asyncio.run(serve(sys.argv[1], lambda address: print(address, flush=True)))
"""

CLIENT = """
import asyncio, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
import tensorwire as tw

async def main():
    client = await tw.connect(sys.argv[1])
    for _ in range(200):
        await client.call("Store.echo", 7)
    gate = client._session.driver.flush_gate
    calls = 0
    end = time.monotonic() + 1.0

    async def caller():
        nonlocal calls
        while time.monotonic() < end:
            assert await client.call("Store.echo", 7) == 7
            calls += 1

    await asyncio.gather(*(caller() for _ in range(64)))
    print(gate.switched, gate.held, calls, flush=True)
    if sys.argv[3:] == ["wait"]:  # connected until the test says (a line on stdin)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await client.close()

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RUSAGE_THREAD is Linux's")
def test_a_client_sharing_the_servers_cpu_sends_long_turns_whole() -> None:
    # 64 calls in flight: each turn of the client's loop posts 64 requests.
    # On the server's CPU, the first early batch wakes the server, which
    # takes the CPU from the client in the middle of its turn; the gate
    # then holds the batches of the next long turns to their end.
    cpu = str(min(os.sched_getaffinity(0)))
    with subprocess.Popen([sys.executable, "-c", SERVER, "tcp://127.0.0.1:0", cpu],
                          cwd=ROOT, stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            address = server.stdout.readline().strip()
            out = subprocess.run([sys.executable, "-c", CLIENT, address, cpu], cwd=ROOT,
                                 check=True, capture_output=True, text=True, timeout=120)
        finally:
            server.kill()
    switched, held, calls = map(int, out.stdout.split())
    assert calls > 0
    assert switched >= 1
    assert held > switched  # each switch held the batches of the next long turns


SERVER_REPORTING = """
import asyncio, os, sys
os.sched_setaffinity(0, {int(sys.argv[2])})
from tensorwire import rpc
from tests.rpc.services import Store

async def main():
    server = rpc.Server([Store()])
    (address,) = await server.start(sys.argv[1])
    print(address, flush=True)
    # Until the test asks (a line on stdin): what its connection's gate saw.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    (gate,) = [session.driver.flush_gate for session in server._sessions]
    print(gate.switched, gate.unsplit, gate.held, flush=True)
    await server.close()

asyncio.run(main())
"""

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sched_setaffinity is Linux's")
def test_a_server_sharing_the_clients_cpu_sends_long_turns_whole() -> None:
    # 64 calls in flight, both ends on one CPU. The server's early batch
    # wakes the client, but the kernel lets the server finish its turn: no
    # switch is counted, and the client answers the whole turn at once (its
    # next 64 requests), so the server's next turn is as long. The gate
    # then holds the server's batches to the end of its turns.
    cpu = str(min(os.sched_getaffinity(0)))
    pipes = {"cwd": ROOT, "stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with subprocess.Popen([sys.executable, "-c", SERVER_REPORTING, "tcp://127.0.0.1:0", cpu],
                          **pipes) as server:  # type: ignore[call-overload]
        try:
            address = server.stdout.readline().strip()
            with subprocess.Popen([sys.executable, "-c", CLIENT, address, cpu, "wait"],
                                  **pipes) as client:  # type: ignore[call-overload]
                try:
                    calls = int(client.stdout.readline().split()[2])
                    server.stdin.write("report\n")
                    server.stdin.flush()
                    switched, unsplit, held = map(int, server.stdout.readline().split())
                finally:
                    client.stdin.close()
                    client.wait(60)
        finally:
            server.kill()
    assert calls > 0
    assert unsplit >= 1
    assert held > 10 * (unsplit + switched)  # most long turns went whole
