"""The test bed itself: shaped links really run at their rate, and the byte
counters see what crossed them.

Skipped with the reason where namespaces cannot be made (not root).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tensorwire.testing.netbed import Testbed, parse_rate

from .conftest import ROOT

RECEIVER = """
import socket, sys
s = socket.socket()
s.bind(("0.0.0.0", 9000))
s.listen()
print("ready", flush=True)
c, _ = s.accept()
n = 0
while data := c.recv(1 << 20):
    n += len(data)
print(n, flush=True)
"""

SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], 9000))
s.sendall(b"x" * int(sys.argv[2]))
s.close()
"""


def test_rates_parse_as_tc_writes_them() -> None:
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("250mbit") == 250 * 10**6
    assert parse_rate("1.5Gbit") == 1_500_000_000
    assert parse_rate("800kbit") == 800_000
    for bad in ("1gb", "fast", "-3mbit", "10bit"):
        with pytest.raises(ValueError, match="rate"):
            parse_rate(bad)


def transfer(bed: Testbed, sender: int, receiver: int, size: int) -> float:
    """Seconds to push ``size`` bytes over TCP from one host to another."""
    with subprocess.Popen(bed.command(receiver, [sys.executable, "-c", RECEIVER]),
                          stdout=subprocess.PIPE, text=True, cwd=ROOT) as child:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        start = time.perf_counter()
        subprocess.run(bed.command(sender, [sys.executable, "-c", SENDER,
                                            bed.address(receiver), str(size)]),
                       check=True, timeout=60)
        received = int(child.stdout.readline())
        elapsed = time.perf_counter() - start
        child.wait(timeout=10)
    assert received == size
    return elapsed


def qdiscs(bed: Testbed, k: int) -> str:
    return subprocess.run(["ip", "netns", "exec", bed.host(k), "tc", "qdisc", "show", "dev",
                           "eth0"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("bed", [2], indirect=True)
def test_a_shaped_link_runs_no_faster_than_its_rate(bed: Testbed) -> None:
    size = 6_000_000
    bed.shape(1, rate="100mbit")  # the receiver's side: its switch port holds it back
    assert "tbf" in qdiscs(bed, 1)
    before = bed.link_bytes(1)
    # 6 MB at 100 Mbit/s is 0.48 s; the bucket lets at most 200 KiB through early.
    assert transfer(bed, 0, 1, size) >= 0.4
    after = bed.link_bytes(1)
    assert after[1] - before[1] >= size  # received, with headers on top
    assert after[0] - before[0] < size // 10  # only acknowledgements went back

    bed.shape(1, rate=None)
    assert "tbf" not in qdiscs(bed, 1)
    bed.shape(0, rate="100mbit")  # now the sender's own eth0 holds it back
    assert transfer(bed, 0, 1, size) >= 0.4
