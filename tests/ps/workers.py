"""Code the parameter-server tests run in worker and shard processes.

Importable by spawned children; every function here is a whole process's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from tensorwire import ps

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"w": (40, 30), "v": (50,), "b": (7,)}
CHUNK_BYTES = 1024  # small, so tensors spread over both shards


def initial(worker: int) -> dict[str, np.ndarray]:
    """Different per worker: the test checks the first worker's values win."""
    rng = np.random.default_rng(100 + worker)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def gradient(params: dict[str, np.ndarray], worker: int, step: int) -> dict[str, np.ndarray]:
    """Depends on the parameters, so reading stale ones would show."""
    rng = np.random.default_rng(1000 * step + worker)
    return {
        name: (np.float32(0.1 * (worker + 1)) * value
               + rng.standard_normal(value.shape).astype(np.float32))
        for name, value in params.items()
    }


def reference(start: dict[str, np.ndarray], workers: int, steps: int,
              optimizer: ps.Optimizer) -> dict[str, np.ndarray]:
    """The same steps in one process: mean gradient, one optimizer step."""
    params = {k: v.copy() for k, v in start.items()}
    state = {k: optimizer.init_state(v) for k, v in params.items()}
    for step in range(steps):
        grads = [gradient(params, w, step) for w in range(workers)]
        for name in params:
            mean = sum(g[name] for g in grads) / np.float32(workers)
            params[name], state[name] = optimizer.step(params[name], mean, state[name], step + 1)
    return params


def train(addresses: list[str], worker: int, workers: int, steps: int,
          optimizer: ps.Optimizer, compression: str = "none",
          retry_timeout: float = 30.0, hold: tuple[int, Any] | None = None) -> dict[str, Any]:
    """Sync training with push_pull; returns the initial and final parameters.

    ``hold``: (step, event); the worker waits for the event (a manager's
    ``Event``) before it pushes that step, and in sync mode so does every
    other worker's next pull.
    """

    async def main() -> dict[str, Any]:
        config = ps.PSConfig(chunk_bytes=CHUNK_BYTES, retry_timeout=retry_timeout, timeout=30)
        client = await ps.connect(addresses, worker=worker, num_workers=workers,
                                  optimizer=optimizer,
                                  compression=compression, config=config)
        async with client:
            start = await client.init(initial(worker))
            start = {k: v.copy() for k, v in start.items()}
            params = start
            for step in range(steps):
                if hold is not None and step == hold[0]:
                    await asyncio.to_thread(hold[1].wait)
                params = await client.push_pull(gradient(params, worker, step))
            return {"start": start, "final": params, "imbalance": client.imbalance}

    return asyncio.run(main())


def count(addresses: list[str], worker: int, workers: int, steps: int, consistency: str,
          staleness: int, delay: float) -> list[list[float]]:
    """Each push adds 1 to this worker's slot of two counter tensors (one per
    shard); returns, per step, what the pull after that push saw."""

    async def main() -> list[list[float]]:
        client = await ps.connect(
            addresses, worker=worker, num_workers=workers, consistency=consistency,  # type: ignore[arg-type]
            staleness=staleness, optimizer=ps.SGD(lr=float(workers)),
            config=ps.PSConfig(timeout=30),
        )
        seen = []
        async with client:
            zeros = np.zeros(workers, np.float64)
            await client.init({"c0": zeros, "c1": zeros})
            grad = np.zeros(workers, np.float64)
            grad[worker] = -1.0  # SGD: c -= lr * grad / workers, so c[worker] += 1
            for _ in range(steps):
                if delay:
                    time.sleep(delay)  # noqa: ASYNC251 - a slow worker's computation blocks too
                params = await client.push_pull({"c0": grad, "c1": grad})
                # Both shards answered for this clock; keep the older view.
                seen.append(np.minimum(params["c0"], params["c1"]).tolist())
        return seen

    return asyncio.run(main())


@contextlib.asynccontextmanager
async def shard_process(url: str, *options: str) -> AsyncIterator[tuple[Any, str]]:
    """``tensorwire ps serve`` in a child process; yields (process, address)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tensorwire", "ps", "serve", "--listen", url, *options,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    errors = bytearray()
    # Keep reading stderr (and later stdout, where UCX may log) so no pipe fills.
    drains = [asyncio.get_running_loop().create_task(_drain(child.stderr, errors))]
    try:
        address = ""
        while not address:
            line = (await asyncio.wait_for(child.stdout.readline(), 60)).decode()
            if not line:
                await child.wait()
                await drains[0]
                raise RuntimeError(f"the shard process exited: {errors.decode()[-2000:]}")
            if line.startswith("listening on "):
                address = line.split()[-1]
        drains.append(asyncio.get_running_loop().create_task(_drain(child.stdout, None)))
        yield child, address
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
        for drain in drains:
            drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await drain


async def _drain(stream: asyncio.StreamReader, keep: bytearray | None) -> None:
    while data := await stream.read(65536):
        if keep is not None:
            keep += data


def train_moving(addresses: list[str], worker: int, workers: int, steps: int,
                 optimizer: ps.Optimizer, moves: dict[int, list[str]]) -> dict[str, Any]:
    """Sync training with push_pull; worker 0 changes the placement to
    ``moves[step]``'s shards before those steps. Returns the initial and
    final parameters, the reports of the moves and the placement version
    this worker ended on."""

    async def main() -> dict[str, Any]:
        config = ps.PSConfig(chunk_bytes=CHUNK_BYTES, timeout=30)
        client = await ps.connect(addresses, worker=worker, num_workers=workers,
                                  optimizer=optimizer, config=config)
        reports = []
        async with client:
            start = await client.init(initial(worker))
            start = {k: v.copy() for k, v in start.items()}
            params = start
            for step in range(steps):
                if worker == 0 and step in moves:
                    reports.append(await client.reshard(moves[step]))
                params = await client.push_pull(gradient(params, worker, step))
            return {"start": start, "final": params, "reports": reports,
                    "version": client.version, "addresses": client.addresses}

    return asyncio.run(main())


def count_moving(addresses: list[str], worker: int, workers: int, steps: int,
                 consistency: str, staleness: int, moves: dict[int, list[str]]) -> list[float]:
    """Each push adds 1 to this worker's slot of six counter tensors; worker 0
    changes the placement to ``moves[step]``'s shards before those steps.
    Returns the counters' final values (lowest over the tensors) per worker."""

    async def main() -> list[float]:
        client = await ps.connect(
            addresses, worker=worker, num_workers=workers, consistency=consistency,  # type: ignore[arg-type]
            staleness=staleness, optimizer=ps.SGD(lr=float(workers)),
            config=ps.PSConfig(timeout=30))
        async with client:
            names = [f"c{i}" for i in range(6)]
            await client.init({name: np.zeros(workers, np.float64) for name in names})
            grad = np.zeros(workers, np.float64)
            grad[worker] = -1.0  # SGD: c -= lr * grad / workers, so c[worker] += 1
            for step in range(steps):
                if worker == 0 and step in moves:
                    await client.reshard(moves[step])
                await client.push_pull({name: grad for name in names})
            # Every worker's pushes are in once all have finished: pull until so.
            for _ in range(200):
                params = await client.pull()
                low = np.min([params[name] for name in names], axis=0)
                if low.sum() >= workers * steps:
                    break
                await asyncio.sleep(0.05)
            high = np.max([params[name] for name in names], axis=0)
            return [*low.tolist(), *high.tolist()]

    return asyncio.run(main())
