"""The parameter server across emulated hosts: a shard killed and restored.

Shard 0 runs on host 0 (checkpointing every 3 updates), shard 1 on host 1,
two synchronous workers on host 2. Shard 0 is killed with SIGKILL mid-
training and started again on the same address from its checkpoint
directory; the workers retry, training finishes, and both end with the same
parameters.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tensorwire.ps import _checkpoint
from tensorwire.testing.netbed import Testbed

from .conftest import spawn

STEPS = 40
WORKER = f"""
import json, sys
from tensorwire import ps
from tests.ps.workers import train
addresses, worker = sys.argv[1].split(","), int(sys.argv[2])
result = train(addresses, worker, 2, {STEPS}, ps.SGD(lr=0.02, momentum=0.5), "none", 60.0)
print(json.dumps({{k: v.tolist() for k, v in result["final"].items()}}), flush=True)
"""
STATUS = """
import asyncio, json, sys
import tensorwire as tw
async def main():
    async with tw.connect(sys.argv[1], timeout=10) as client:
        print(json.dumps(await client.call("tensorwire.ps.Shard.status")), flush=True)
asyncio.run(main())
"""


@asynccontextmanager
async def shard_in(bed: Testbed, host: int, listen: str,
                   *options: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    child = await spawn(bed, host, "-m", "tensorwire", "ps", "serve", "--listen", listen,
                        *options)
    try:
        assert child.stdout is not None
        address = ""
        while not address:
            line = (await asyncio.wait_for(child.stdout.readline(), 60)).decode()
            assert line, (await child.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
            if line.startswith("listening on "):
                address = line.split()[-1]
        yield child, address
    finally:
        if child.returncode is None:
            child.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(child.wait(), 20)
            except TimeoutError:
                child.kill()
                await child.wait()


@pytest.mark.slow
async def test_a_shard_killed_on_its_host_restores_and_training_finishes(
        bed: Testbed, tmp_path: Path) -> None:
    checkpoints = tmp_path / "shard0"
    options = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3")
    async with shard_in(bed, 0, f"tcp://{bed.address(0)}:0", *options) as (victim, first), \
            shard_in(bed, 1, f"tcp://{bed.address(1)}:0") as (_, second):
        addresses = f"{first},{second}"
        workers = [await spawn(bed, 2, "-c", WORKER, addresses, str(w)) for w in range(2)]
        # Kill once training is under way: a checkpoint past step 0 exists.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while True:
            found = _checkpoint.latest(checkpoints) if checkpoints.exists() else None
            if found is not None and found[1]["step"] > 0:
                break
            assert loop.time() < deadline, "no checkpoint within 60 s"
            await asyncio.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        await victim.wait()
        async with shard_in(bed, 0, first, *options) as (_, again):
            assert again == first
            restarted = time.monotonic() - killed
            outputs = await asyncio.wait_for(
                asyncio.gather(*(w.communicate() for w in workers)), 120)
            probe = await spawn(bed, 2, "-c", STATUS, first)
            status_out, _ = await asyncio.wait_for(probe.communicate(), 30)
    assert [w.returncode for w in workers] == [0, 0], [e.decode()[-2000:] for _, e in outputs]
    finals = [json.loads(out.decode().strip().splitlines()[-1]) for out, _ in outputs]
    assert finals[0] == finals[1]  # synchronous: every worker holds the same parameters
    status = json.loads(status_out.decode().strip().splitlines()[-1])
    assert status["restored_from"] is not None
    assert status["step"] == STEPS
    # At most the steps since the last checkpoint are lost, and counted.
    assert 0 <= status["lost_steps"] < STEPS
    print(f"ps shard killed on its host: restarted after {restarted:.2f} s from "
          f"{Path(status['restored_from']).name}, {status['lost_steps']} steps lost, "
          f"training finished at step {status['step']}")
