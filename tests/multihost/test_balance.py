"""Bandwidth-aware shard balancing across emulated hosts with one slow link.

Three shards on hosts 0-2, host 2's link shaped to a quarter of the others';
two synchronous workers on host 3, worker 0 checking the shards' measured
bandwidth every few steps (``PSConfig.rebalance_every``). The placement
must change so that the slow shard holds less, both workers must follow it,
and training must end with exactly the parameters of the same steps run in
one process: no push lost or applied twice across the move.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tensorwire.testing.netbed import Testbed

from ..ps.workers import reference
from . import _ps_balance as job
from .conftest import spawn

STEPS = 10
WORKERS = 2


async def start_shard(bed: Testbed, host: int) -> tuple[asyncio.subprocess.Process, str]:
    child = await spawn(bed, host, "-m", "tensorwire", "ps", "serve", "--listen",
                        f"tcp://{bed.address(host)}:0")
    assert child.stdout is not None
    while True:
        line = (await asyncio.wait_for(child.stdout.readline(), 60)).decode()
        assert line, "the shard exited"
        if line.startswith("listening on "):
            return child, line.split()[-1]


@pytest.mark.parametrize("bed", [4], indirect=True)
async def test_a_slow_shard_gives_chunks_away_and_training_stays_exact(
        bed: Testbed, tmp_path: Path) -> None:
    for host, rate in ((0, "200mbit"), (1, "200mbit"), (2, "50mbit")):
        bed.shape(host, rate=rate)
    shards = [await start_shard(bed, host) for host in range(3)]
    try:
        addresses = [address for _, address in shards]
        workers = [await spawn(bed, 3, "-m", "tests.multihost._ps_balance", ",".join(addresses),
                               str(w), str(WORKERS), str(STEPS), str(tmp_path / f"w{w}.npz"))
                   for w in range(WORKERS)]
        outputs = await asyncio.wait_for(
            asyncio.gather(*(w.communicate() for w in workers)), 50)
    finally:
        for child, _ in shards:
            child.kill()
            await child.wait()
    assert [w.returncode for w in workers] == [0, 0], [e.decode()[-2000:] for _, e in outputs]
    reports = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]
    for report in reports:
        # Both workers ended on a placement worker 0 made from measurements.
        assert report["version"] >= 1 and report["addresses"] == addresses
        assert report["loads"] == reports[0]["loads"]
    fast, slow = reports[0]["loads"][:2], reports[0]["loads"][2]
    assert slow < 0.6 * min(fast), reports[0]["loads"]
    results = [np.load(tmp_path / f"w{w}.npz") for w in range(WORKERS)]
    start = {k[len("start."):]: results[0][k] for k in results[0].files if k.startswith("start.")}
    expected = reference(start, WORKERS, STEPS, job.OPTIMIZER)
    for result in results:
        for name, value in expected.items():
            np.testing.assert_allclose(result[f"final.{name}"], value, rtol=1e-5, atol=1e-6)
    print(f"ps balancing: the slow shard holds {slow / sum(reports[0]['loads']):.0%} of the "
          f"bytes after version {reports[0]['version']}")
