"""A synchronous parameter-server worker for the balancing test, run inside an
emulated host::

    python -m tests.multihost._ps_balance ADDRESSES RANK WORKERS STEPS OUT.npz

Trains ``model()`` with :func:`tests.ps.workers.gradient`, worker 0 checking
the shards' bandwidth every ``CHECK_EVERY`` steps (``PSConfig.rebalance_every``),
and writes the final parameters to ``OUT.npz``; prints a JSON line with the
placement it ended on.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np

from tensorwire import ps

from ..ps.workers import gradient

KiB = 1 << 10
TENSOR_KIB = 128
TENSORS = 16
CHECK_EVERY = 3
OPTIMIZER = ps.SGD(lr=0.01, momentum=0.5)


def model() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {f"layer{i:02d}": rng.standard_normal(TENSOR_KIB * KiB // 4).astype(np.float32)
            for i in range(TENSORS)}


async def train(addresses: list[str], worker: int, workers: int, steps: int,
                out: str) -> None:
    config = ps.PSConfig(chunk_bytes=TENSOR_KIB * KiB, timeout=60,
                         rebalance_every=CHECK_EVERY, rebalance_threshold=0.2)
    client = await ps.connect(addresses, worker=worker, num_workers=workers,
                              optimizer=OPTIMIZER, config=config)
    async with client:
        params = await client.init(model())
        start = {k: v.copy() for k, v in params.items()}
        for step in range(steps):
            params = await client.push_pull(gradient(params, worker, step))
        np.savez(out, **{f"final.{k}": v for k, v in params.items()},
                 **{f"start.{k}": v for k, v in start.items()})
        print(json.dumps({"version": client.version, "addresses": client.addresses,
                          "loads": client.placement.loads()}), flush=True)


def main() -> None:
    addresses, rank, workers, steps, out = sys.argv[1:]
    asyncio.run(train(addresses.split(","), int(rank), int(workers), int(steps), out))


if __name__ == "__main__":
    main()
