"""A test bed of emulated hosts on one Linux machine, one network namespace each.

Every host gets its own network stack: a namespace with loopback and an
``eth0`` (a veth pair) whose other end sits on a bridge in a *switch*
namespace, with the address ``10.213.0.<k + 1>/24``. Nothing is added to the
machine's own namespace, the addresses exist only inside namespaces this
test bed made, and :meth:`Testbed.down` removes them all (deleting a
namespace deletes its interfaces). A host's link can be cut at its switch
port, which is what a pulled cable or a dead switch port looks like to it,
and given its own rate with a token bucket (``tc qdisc ... tbf``), so a test
can build a cluster whose links differ::

    with testbed(3) as bed:            # needs root and iproute2
        bed.shape(0, rate="1gbit")     # host 0: 1 Gbit/s each way
        bed.shape(2, rate="200mbit")   # host 2: one slow link
        argv = bed.command(1, ["python", "worker.py", bed.address(0)])

Processes that share a host (one namespace) talk over its loopback and
shared memory, which no shaping touches: the fast links inside a host.
This is a tool for tests and benchmarks, not for production.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence

__all__ = ("SUBNET", "NamespaceUnavailable", "Testbed", "parse_rate", "sweep_stale", "testbed")

SUBNET = "10.213.0"

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


class NamespaceUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2)."""


def _run(argv: Sequence[str]) -> str:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")
    return result.stdout


def _ip(*args: str) -> None:
    _run(["ip", *args])


def parse_rate(rate: str) -> int:
    """Bits per second of a tc-style rate such as ``"1gbit"`` or ``"250mbit"``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?bit)", rate.strip().lower())
    if match is None:
        raise ValueError(f"rate {rate!r} is not a number followed by bit, kbit, mbit or gbit")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits < 8 * 1500:
        raise ValueError(f"rate {rate!r} is below one packet per second")
    return int(bits)


class Testbed:
    """``hosts`` emulated hosts on one switch."""

    __test__ = False  # not a test class, whatever its name says

    def __init__(self, hosts: int) -> None:
        self.hosts = hosts
        # Short and unique (interface names are at most 15 characters), and
        # naming the process that made it, so a later run can sweep up what
        # a killed run left behind.
        self.tag = f"tw{os.getpid():x}x{uuid.uuid4().hex[:2]}"
        self.switch = f"{self.tag}sw"
        self.namespaces: list[str] = []

    def host(self, k: int) -> str:
        return f"{self.tag}h{k}"

    def address(self, k: int) -> str:
        """Host ``k``'s address on the switch."""
        return f"{SUBNET}.{k + 1}"

    def up(self) -> None:
        """Make the switch and the hosts.

        Raises:
            NamespaceUnavailable: this machine does not let us make namespaces.
        """
        for tool in ("ip", "unshare", "hostname"):
            if shutil.which(tool) is None:
                raise NamespaceUnavailable(f"the {tool} command is not installed")
        if os.geteuid() != 0:
            raise NamespaceUnavailable("network namespaces need root")
        sweep_stale()
        try:
            _ip("netns", "add", self.switch)
        except RuntimeError as exc:
            raise NamespaceUnavailable(str(exc)) from exc
        self.namespaces.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for k in range(self.hosts):
            ns = self.host(k)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            inside, port = f"{self.tag}i{k}", f"{self.tag}p{k}"
            _ip("link", "add", inside, "type", "veth", "peer", "name", port)
            _ip("link", "set", inside, "netns", ns)
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", ns, "link", "set", inside, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")

    def link(self, k: int, *, up: bool) -> None:
        """Connect or cut host ``k`` at its switch port."""
        _ip("-n", self.switch, "link", "set", f"{self.tag}p{k}", "up" if up else "down")

    def shape(self, k: int, *, rate: str | None) -> None:
        """Give host ``k``'s link a rate each way, or lift it (``rate=None``).

        A token bucket (``tbf``) on both ends of the host's veth pair: on
        ``eth0`` inside the host for what it sends, on its switch port for
        what it receives.
        """
        inside = ["ip", "netns", "exec", self.host(k), "tc", "qdisc"]
        port = ["ip", "netns", "exec", self.switch, "tc", "qdisc"]
        devices = ((inside, "eth0"), (port, f"{self.tag}p{k}"))
        for tc, dev in devices:
            with contextlib.suppress(RuntimeError):
                _run([*tc, "del", "dev", dev, "root"])
        if rate is None:
            return
        bits = parse_rate(rate)
        # The bucket holds 4 ms of traffic (at least 64 KiB, so one
        # GSO-sized packet fits); the queue holds 50 ms.
        burst = max(bits // 8 // 250, 64 * 1024)
        tbf = ["tbf", "rate", str(bits), "burst", str(burst), "latency", "50ms"]
        for tc, dev in devices:
            _run([*tc, "add", "dev", dev, "root", *tbf])

    def link_bytes(self, k: int) -> tuple[int, int]:
        """Bytes host ``k`` has sent and received on its link since it was made."""
        stats = "/sys/class/net/eth0/statistics"
        out = _run(["ip", "netns", "exec", self.host(k), "cat",
                    f"{stats}/tx_bytes", f"{stats}/rx_bytes"]).split()
        return int(out[0]), int(out[1])

    def hostname(self, k: int) -> str:
        return f"host{k}"

    def command(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``k``.

        Besides its network stack a host gets its own host name and IPC
        namespace, as a separate machine would: UCX then sees another host
        (no shared memory between hosts, whose wake-up signals could not
        cross network namespaces anyway), and ``group.topology`` tells the
        hosts apart.
        """
        return ["ip", "netns", "exec", self.host(k), "unshare", "--uts", "--ipc",
                "sh", "-c", f'hostname {self.hostname(k)} && exec "$@"', "--", *argv]

    def down(self) -> None:
        """Remove every namespace this test bed made (and so its interfaces)."""
        for ns in reversed(self.namespaces):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", ns)
        self.namespaces.clear()


def sweep_stale() -> None:
    """Delete the namespaces of test beds whose process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = re.fullmatch(r"tw([0-9a-f]+)x[0-9a-f]{2}(sw|h\d+)", name)
        if match and not os.path.exists(f"/proc/{int(match.group(1), 16)}"):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", name)


@contextlib.contextmanager
def testbed(hosts: int) -> Iterator[Testbed]:
    bed = Testbed(hosts)
    try:
        bed.up()
        yield bed
    finally:
        bed.down()
