"""The parameter server across emulated hosts: a shard killed and restored,
the workers' own link cut, a worker killed.

Shard 0 runs on host 0, shard 1 on host 1, two synchronous workers on host
2. In the first test shard 0 (checkpointing every 3 updates) is killed with
SIGKILL mid-training and started again on the same address from its
checkpoint directory; the workers retry, training finishes, and both end
with the same parameters. In the second the workers' host loses its link for
a few seconds; they notice within their heartbeat timeout, reconnect by
themselves once it is back, and end with exactly the parameters of the same
steps run in one process: no push was lost or applied twice. In the third a
synchronous worker on its own host is killed; the survivor on another host
fails at its deadline, naming the missing worker.
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

import numpy as np
import pytest

from tensorwire import ps
from tensorwire.ps import _checkpoint
from tensorwire.testing.netbed import Testbed

from ..ps.workers import initial, reference
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
PROGRESS_WORKER = f"""
import asyncio, json, logging, sys, time
from tensorwire import ps, rpc
logging.basicConfig(level=logging.INFO)
from tests.ps.workers import CHUNK_BYTES, gradient, initial
addresses, worker = sys.argv[1].split(","), int(sys.argv[2])
async def main():
    # Heartbeats every 0.5 s, a silent shard is dead after 2 s: a cut link
    # shows as Unavailable well inside the cut.
    config = ps.PSConfig(chunk_bytes=CHUNK_BYTES, timeout=30, retry_timeout=30,
                         rpc=rpc.ClientConfig(heartbeat_interval=0.5, heartbeat_timeout=2,
                                              connect_timeout=1))
    client = await ps.connect(addresses, worker=worker, num_workers=2,
                              optimizer=ps.SGD(lr=0.02, momentum=0.5), config=config)
    async with client:
        params = await client.init(initial(worker))
        for step in range({STEPS}):
            params = await client.push_pull(gradient(params, worker, step))
            print(json.dumps({{"step": step, "at": time.monotonic()}}), flush=True)
            await asyncio.sleep(0.05)
    print(json.dumps({{k: v.tolist() for k, v in params.items()}}), flush=True)
asyncio.run(main())
"""
LONE_WORKER = """
import asyncio, json, sys, time
import numpy as np
from tensorwire import ps
from tensorwire.errors import TensorwireError
addresses, worker = sys.argv[1].split(","), int(sys.argv[2])
async def main():
    config = ps.PSConfig(chunk_bytes=1024, timeout=3)
    client = await ps.connect(addresses, worker=worker, num_workers=2, optimizer=ps.SGD(lr=0.1),
                              config=config)
    async with client:
        await client.init({"w": np.zeros(1000, np.float32)})
        step = 0
        while True:
            try:
                await client.push_pull({"w": np.ones(1000, np.float32)})
            except TensorwireError as exc:
                print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                                  "at": time.monotonic()}), flush=True)
                return
            print(json.dumps({"step": step}), flush=True)
            step += 1
            await asyncio.sleep(0.02)
asyncio.run(main())
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


async def shard_status(bed: Testbed, host: int, address: str) -> dict[str, object]:
    probe = await spawn(bed, host, "-c", STATUS, address)
    out, err = await asyncio.wait_for(probe.communicate(), 30)
    assert probe.returncode == 0, err.decode()[-2000:]
    status: dict[str, object] = json.loads(out.decode().strip().splitlines()[-1])
    return status


@pytest.mark.slow
async def test_the_workers_link_cut_for_seconds_loses_and_doubles_nothing(
        bed: Testbed) -> None:
    cut_seconds = 4.0
    async with shard_in(bed, 0, f"tcp://{bed.address(0)}:0") as (_, first), \
            shard_in(bed, 1, f"tcp://{bed.address(1)}:0") as (_, second):
        addresses = f"{first},{second}"
        workers = [await spawn(bed, 2, "-c", PROGRESS_WORKER, addresses, str(w))
                   for w in range(2)]
        assert workers[0].stdout is not None
        stderrs = [asyncio.ensure_future(w.stderr.read()) for w in workers]  # type: ignore[union-attr]
        # Cut the workers' host once training is under way.
        while True:
            line = await asyncio.wait_for(workers[0].stdout.readline(), 60)
            assert line, (await stderrs[0]).decode()[-2000:]
            if json.loads(line)["step"] == 9:
                break
        bed.link(2, up=False)
        await asyncio.sleep(cut_seconds)
        bed.link(2, up=True)
        back = time.monotonic()
        # The first step finished after the link came back.
        while True:
            line = await asyncio.wait_for(workers[0].stdout.readline(), 60)
            assert line, (await stderrs[0]).decode()[-2000:]
            report = json.loads(line)
            if "step" not in report or report["at"] > back:
                break
        recovered = time.monotonic() - back
        rest = await asyncio.wait_for(asyncio.gather(*(w.stdout.read() for w in workers)),  # type: ignore[union-attr]
                                      120)
        errors = await asyncio.gather(*stderrs)
        await asyncio.gather(*(w.wait() for w in workers))
        statuses = [await shard_status(bed, 2, address) for address in (first, second)]
    assert [w.returncode for w in workers] == [0, 0], [e.decode()[-2000:] for e in errors]
    finals = [json.loads(out.decode().strip().splitlines()[-1]) for out in rest]
    assert finals[0] == finals[1]
    # The calls in flight at the cut lost their connection and were retried,
    # by the RPC client (idempotent) or the PS client.
    retried = [b"after losing the connection" in e or b"unavailable" in e for e in errors]
    assert any(retried), [e.decode()[-2000:] for e in errors]
    # Exactly the steps of a run with no fault: nothing lost, nothing twice.
    expected = reference(initial(0), 2, STEPS, ps.SGD(lr=0.02, momentum=0.5))
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(finals[0][name], np.float32), value,
                                   rtol=1e-5, atol=1e-6)
    for status in statuses:
        assert status["step"] == STEPS
        assert status["lost_steps"] == 0
    print(f"ps workers' link cut for {cut_seconds:.0f} s: training went on "
          f"{recovered:.2f} s after the link was back, finished at step {STEPS}")


@pytest.mark.slow
async def test_a_killed_worker_is_named_by_the_survivor_at_its_deadline(
        bed: Testbed) -> None:
    async with shard_in(bed, 0, f"tcp://{bed.address(0)}:0") as (_, first), \
            shard_in(bed, 0, f"tcp://{bed.address(0)}:0") as (_, second):
        addresses = f"{first},{second}"
        survivor, victim = [await spawn(bed, host, "-c", LONE_WORKER, addresses, str(worker))
                            for worker, host in ((0, 1), (1, 2))]
        assert survivor.stdout is not None and victim.stdout is not None
        while True:
            line = await asyncio.wait_for(victim.stdout.readline(), 60)
            assert line, (await victim.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
            if json.loads(line).get("step") == 5:
                break
        victim.kill()
        killed = time.monotonic()
        await victim.wait()
        while True:
            line = await asyncio.wait_for(survivor.stdout.readline(), 30)
            assert line, (await survivor.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
            report = json.loads(line)
            if "error" in report:
                break
        assert await asyncio.wait_for(survivor.wait(), 30) == 0
    assert report["error"] == "DeadlineExceeded", report
    assert "workers [1]" in report["message"], report
    detected = report["at"] - killed
    # The 3 s deadline of the step the survivor was in, not a hang.
    assert detected < 30
    print(f"ps worker killed on its host: the survivor on another host failed after "
          f"{detected:.2f} s with: {report['message']}")
