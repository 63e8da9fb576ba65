"""Data-parallel training with tensorwire collectives: average gradients, in place.

    python examples/allreduce.py                 # starts 4 ranks on loopback (tcp://)
    python examples/allreduce.py -n 3 --listen ucx://127.0.0.1:0
    torchrun --nproc-per-node 4 examples/allreduce.py     # or srun / mpirun

Each rank fits a linear model on its own shard of a synthetic data set and
averages its gradient with the others' (``allreduce``, ``ReduceOp.AVG``)
every step, so all ranks hold the same weights; rank 0's initial weights are
broadcast first. Without a launcher's environment the script starts the ranks
itself with ``collective.launch`` (what ``tensorwire launch`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import numpy as np

from tensorwire.collective import Group, ReduceOp, launch

FEATURES, SAMPLES, STEPS = 32, 4096, 60


async def train() -> None:
    group = await Group.from_env()
    rank, size = group.rank, group.world_size
    rng = np.random.default_rng(0)
    true_w = rng.standard_normal(FEATURES)
    x = rng.standard_normal((SAMPLES, FEATURES))
    y = x @ true_w + 0.01 * rng.standard_normal(SAMPLES)
    mine = slice(rank * SAMPLES // size, (rank + 1) * SAMPLES // size)  # this rank's shard
    w = np.random.default_rng(100 + rank).standard_normal(FEATURES)  # differs until broadcast
    await group.broadcast(w, root=0)
    for step in range(STEPS):
        residual = x[mine] @ w - y[mine]
        grad = x[mine].T @ residual / len(residual)
        await group.allreduce(grad, ReduceOp.AVG)  # every rank now holds the mean gradient
        w -= 0.1 * grad
        if step % 20 == 0 or step == STEPS - 1:
            loss = float(np.mean(residual**2))
            loss_all = np.array([loss])
            await group.allreduce(loss_all, ReduceOp.AVG)
            if rank == 0:
                print(f"step {step:3d}  mean loss over {size} ranks {loss_all[0]:.5f}", flush=True)
    weights = await group.allgather(w)
    assert all(np.array_equal(weights[0], other) for other in weights), "ranks diverged"
    if rank == 0:
        print(f"trained: |w - w_true| = {np.linalg.norm(w - true_w):.4f}, "
              f"weights identical on all {size} ranks")
    await group.close()


def main() -> None:
    if any(key in os.environ for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")):
        asyncio.run(train())
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="ranks to start (default 4)")
    parser.add_argument("--listen", default="tcp://127.0.0.1:0",
                        help="where each rank takes data connections (tcp:// or ucx://)")
    args = parser.parse_args()
    result = asyncio.run(launch([sys.executable, __file__], args.n, listen=args.listen))
    sys.exit(result.exit_code)


if __name__ == "__main__":
    main()
