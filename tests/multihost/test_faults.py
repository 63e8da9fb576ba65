"""Faults across emulated hosts: every process runs in a network namespace of
its own (tensorwire/testing/netbed.py), so links can really go down.

Skipped with the reason where namespaces cannot be made (not root).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tensorwire.testing.netbed import Testbed

from .conftest import spawn

HAS_UCX = importlib.util.find_spec("ucxx") is not None


@contextlib.asynccontextmanager
async def server_in(bed: Testbed, host: int, *argv: str) -> AsyncIterator[str]:
    """A server process in ``host``; yields the address it printed."""
    child = await spawn(bed, host, "-m", "tests.multihost._proc", *argv)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        assert line, (await child.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
        yield line.decode().strip()
    finally:
        if child.returncode is None:
            assert child.stdin is not None
            child.stdin.close()
            try:
                await asyncio.wait_for(child.wait(), 10)
            except TimeoutError:
                child.kill()
                await child.wait()


async def lines(stream: asyncio.StreamReader, into: list[dict[str, Any]]) -> None:
    async for raw in stream:
        text = raw.decode().strip()
        if text.startswith("{"):
            into.append(json.loads(text))


async def ranks_in(bed: Testbed, scenario: str, listen_scheme: str,
                   master: str) -> tuple[list[asyncio.subprocess.Process],
                                         list[dict[str, Any]], list[asyncio.Task[None]]]:
    """One collective rank per host, reporting into the returned list as it goes."""
    reports: list[dict[str, Any]] = []
    children, readers = [], []
    for k in range(bed.hosts):
        child = await spawn(bed, k, "-m", "tests.collective._worker", scenario, str(k),
                            str(bed.hosts), master, f"{listen_scheme}://{bed.address(k)}:0")
        assert child.stdout is not None
        children.append(child)
        readers.append(asyncio.ensure_future(lines(child.stdout, reports)))
    return children, reports, readers


async def finish(children: list[asyncio.subprocess.Process], timeout: float) -> list[str]:
    """Wait for the ranks; their stderr tails."""
    try:
        outputs = await asyncio.wait_for(
            asyncio.gather(*(child.stderr.read() for child in children)),  # type: ignore[union-attr]
            timeout)
        await asyncio.wait_for(asyncio.gather(*(child.wait() for child in children)), 10)
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
    return [out.decode()[-3000:] for out in outputs]


SCHEMES = ["tcp", pytest.param("ucx", marks=pytest.mark.skipif(
    not HAS_UCX, reason="ucxx is not installed"))]


@pytest.mark.slow
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_collectives_across_hosts(bed: Testbed, scheme: str) -> None:
    async with server_in(bed, 0, "rendezvous", bed.address(0), str(bed.hosts)) as master:
        children, reports, _ = await ranks_in(bed, "ops", scheme, master)
        errors = await finish(children, 120)
    assert [c.returncode for c in children] == [0] * bed.hosts, "\n".join(errors)
    assert sorted(r["rank"] for r in reports if r.get("ok")) == list(range(bed.hosts))


async def test_each_host_is_its_own_in_the_topology(bed: Testbed) -> None:
    async with server_in(bed, 0, "rendezvous", bed.address(0), str(bed.hosts)) as master:
        children, reports, _ = await ranks_in(bed, "p2p", "tcp", master)
        errors = await finish(children, 60)
    assert [c.returncode for c in children] == [0] * bed.hosts, "\n".join(errors)
    (topology,) = {json.dumps(r["topology"], sort_keys=True) for r in reports}
    assert json.loads(topology) == {bed.hostname(k): [k] for k in range(bed.hosts)}


@pytest.mark.slow
async def test_a_cut_link_fails_the_collective_naming_the_rank(bed: Testbed) -> None:
    async with server_in(bed, 0, "rendezvous", bed.address(0), str(bed.hosts)) as master:
        children, reports, _ = await ranks_in(bed, "until_failure", "tcp", master)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while len([r for r in reports if r.get("started")]) < bed.hosts:
            assert loop.time() < deadline, reports
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # let a few allreduces complete across the hosts
        cut = time.time()
        bed.link(2, up=False)  # host 2's cable is pulled, its process lives on
        errors = await finish(children, 90)
    failures = {r["rank"]: r for r in reports if "error" in r}
    assert set(failures) == {0, 1, 2}, (reports, errors)
    for rank in (0, 1):
        failure = failures[rank]
        assert failure["done"] > 0, failure
        assert failure["ranks"] == [2], failure
        # Found by heartbeats (3 s), far inside the 20 s operation deadline.
        assert failure["at"] - cut < 10, failure
    # Host 2 itself learns it lost the others (rank 0's rendezvous went silent).
    assert failures[2]["at"] - cut < 10, failures[2]
    # Seen with -s; docs/reliability.md quotes these.
    print("link cut: detected after " + ", ".join(
        f"rank {r} {failures[r]['at'] - cut:.2f} s ({failures[r]['error']})" for r in (0, 1, 2)))


@pytest.mark.slow
@pytest.mark.parametrize("bed", [2], indirect=True)
async def test_rpc_across_a_link_that_flaps(bed: Testbed) -> None:
    async with server_in(bed, 1, "ledger", bed.address(1)) as address:
        caller = await spawn(bed, 0, "-m", "tests.multihost._proc", "caller", address, "9")
        reports: list[dict[str, Any]] = []
        assert caller.stdout is not None
        reading = asyncio.ensure_future(lines(caller.stdout, reports))
        await asyncio.sleep(2.5)
        down = time.time()
        bed.link(1, up=False)
        await asyncio.sleep(3)
        up = time.time()
        bed.link(1, up=True)
        errors = await finish([caller], 60)
        await reading
    assert caller.returncode == 0, errors
    calls = [r for r in reports if "key" in r]
    (tally,) = [r["tally"] for r in reports if "tally" in r]
    before = [c for c in calls if c["at"] + c["took"] < down]
    during = [c for c in calls if down + 0.5 < c["at"] < up - 1.5]
    after = [c for c in calls if c["at"] > up + 2.5]
    assert before and all(c["outcome"] == "ok" for c in before), before
    # While the link is down calls fail, clearly and within their deadline.
    assert during and all(c["outcome"] in ("Unavailable", "DeadlineExceeded") for c in during)
    assert all(c["took"] < 3 for c in calls), max(c["took"] for c in calls)
    # The client reconnects by itself once the link is back.
    assert after and all(c["outcome"] == "ok" for c in after), after
    first_failure = min(c["at"] + c["took"] for c in calls if c["outcome"] != "ok")
    back = min(c["at"] for c in calls if c["at"] > up and c["outcome"] == "ok")
    failed = [c for c in calls if c["outcome"] != "ok"]
    print(f"link flap: first failure {first_failure - down:.2f} s after the cut, first success "
          f"{back - up:.2f} s after the link came back; {len(failed)} of {len(calls)} calls "
          f"failed ({sorted({c['outcome'] for c in failed})}), "
          f"{sum(1 for c in failed if tally.get(c['key']) == 1)} of them applied once, "
          "none twice")
    # Nothing acknowledged is lost, nothing is applied twice.
    assert all(tally.get(c["key"]) == 1 for c in calls if c["outcome"] == "ok")
    assert all(count == 1 for count in tally.values())
