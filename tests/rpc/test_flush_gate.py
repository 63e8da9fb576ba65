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


def long_turn(gate: FlushGate, switches: Switches, *, switched: bool = False) -> bool:
    """One turn that fills batches; whether they went early. ``switched``:
    the thread was switched out after the first one."""
    early = gate.early()
    assert gate.early() == early  # asked again in the turn: the same answer
    if switched:
        switches.count += 1
    gate.turn_ended()
    return early


def test_batches_go_early_while_no_switch_follows_them() -> None:
    switches = Switches()
    gate = FlushGate(switches)
    assert all(long_turn(gate, switches) for _ in range(100))
    assert (gate.switched, gate.held) == (0, 0)


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
    assert (gate.switched, gate.held) == (9, sum(skips))


def test_an_early_turn_without_a_switch_opens_the_gate_again() -> None:
    switches = Switches()
    gate = FlushGate(switches)
    for _ in range(3):  # switched out three times: 2, 4 and 8 turns held
        assert long_turn(gate, switches, switched=True)
        while not long_turn(gate, switches):
            pass
    # The turn that ended the skip went early with no switch: open again.
    assert all(long_turn(gate, switches) for _ in range(20))
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
        gate.turn_ended()  # turns that never filled a batch
    assert not long_turn(gate, switches)
    assert gate.held == 1


def test_where_switches_are_not_counted_every_long_turn_goes_early() -> None:
    switches = Switches(-1)
    gate = FlushGate(switches)
    assert all(long_turn(gate, switches) for _ in range(20))
    assert gate.switched == 0


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
    print(gate.switched, gate.held, calls)
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
