"""Hierarchical collectives across emulated hosts (tensorwire/testing/netbed.py):
two hosts with two ranks each, the ranks of a host sharing its loopback.

The group must learn the topology by itself (host names and listen
addresses), the hierarchical operations must match NumPy, and a hierarchical
allreduce must move fewer bytes over the hosts' links than the flat ring, by
the amount the schedules predict. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tensorwire.testing.netbed import Testbed

from .conftest import spawn

HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST
PAYLOAD = 16 << 20  # the worker's allreduce: 4 Mi float32


async def read_reports(stream: asyncio.StreamReader, into: list[dict[str, Any]]) -> None:
    async for raw in stream:
        text = raw.decode().strip()
        if text.startswith("{"):
            into.append(json.loads(text))


async def wait_for(reports: list[dict[str, Any]], key: str, value: str, timeout: float) -> None:
    """Until every rank has reported ``key: value`` (bounded by ``timeout``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len([r for r in reports if r.get(key) == value]) < WORLD:
        assert loop.time() < deadline, f"ranks did not report {key}={value}: {reports}"
        await asyncio.sleep(0.05)


def host_bytes(bed: Testbed) -> int:
    """Bytes sent over all hosts' links so far."""
    return sum(bed.link_bytes(k)[0] for k in range(bed.hosts))


@pytest.mark.parametrize("bed", [HOSTS], indirect=True)
async def test_hierarchical_allreduce_across_hosts(bed: Testbed) -> None:
    rendezvous = await spawn(bed, 0, "-m", "tests.multihost._proc", "rendezvous",
                             bed.address(0), str(WORLD))
    children: list[asyncio.subprocess.Process] = []
    try:
        assert rendezvous.stdout is not None
        master = (await asyncio.wait_for(rendezvous.stdout.readline(), 30)).decode().strip()
        assert master, "the rendezvous did not start"
        reports: list[dict[str, Any]] = []
        readers = []
        for rank in range(WORLD):
            host = rank // PER_HOST  # contiguous, as torchrun and srun place ranks
            child = await spawn(bed, host, "-m", "tests.collective._worker", "hierarchy",
                                str(rank), str(WORLD), master, f"tcp://{bed.address(host)}:0")
            assert child.stdout is not None
            children.append(child)
            readers.append(asyncio.ensure_future(read_reports(child.stdout, reports)))
        sent: dict[str, int] = {}
        for algorithm in ("ring", "hierarchical"):
            await wait_for(reports, "ready", algorithm, 45)
            before = host_bytes(bed)
            for child in children:
                assert child.stdin is not None
                child.stdin.write(b"go\n")
                await child.stdin.drain()
            await wait_for(reports, "done", algorithm, 30)
            sent[algorithm] = host_bytes(bed) - before
        errors = await asyncio.wait_for(
            asyncio.gather(*(c.stderr.read() for c in children)), 20)  # type: ignore[union-attr]
        await asyncio.wait_for(asyncio.gather(*(c.wait() for c in children)), 10)
        await asyncio.gather(*readers)
    finally:
        for child in (*children, rendezvous):
            if child.returncode is None:
                child.kill()
                await child.wait()
    assert [c.returncode for c in children] == [0] * WORLD, "\n".join(
        e.decode()[-2000:] for e in errors)
    assert sorted(r["rank"] for r in reports if r.get("ok")) == list(range(WORLD))
    (topology,) = {json.dumps(r["topology"], sort_keys=True) for r in reports if "topology" in r}
    assert json.loads(topology) == {bed.hostname(0): [0, 1], bed.hostname(1): [2, 3]}
    # The flat ring 0-1-2-3 crosses between the hosts twice per step: each
    # crossing carries 2 (n - 1) / n = 1.5 payloads. The leaders' ring of two
    # carries 2 (h - 1) / h = 1 payload each way: 2/3 of the flat ring (with
    # hosts placed round robin, the flat ring crosses at every hop and the
    # hierarchy sends 1/3; bench/results/topology.md has both).
    flat, hier = sent["ring"] / PAYLOAD, sent["hierarchical"] / PAYLOAD
    print(f"bytes over the hosts' links per allreduce: flat ring {flat:.3f} x payload, "
          f"hierarchical {hier:.3f} x payload ({hier / flat:.3f} of the flat ring)")
    assert 3.0 <= flat < 3.3, flat  # 2 crossings x 1.5 payloads, plus headers
    assert 2.0 <= hier < 2.2, hier  # 2 leaders x 1 payload, plus headers
    assert 0.6 < hier / flat < 0.7
