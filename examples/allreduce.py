"""Data-parallel training with tensorwire collectives: average gradients, in place.

    python examples/allreduce.py                 # starts 4 ranks on loopback (tcp://)
    python examples/allreduce.py -n 3 --listen ucx://127.0.0.1:0
    torchrun --nproc-per-node 4 examples/allreduce.py     # or srun / mpirun

Each rank fits a linear model on its own shard of a synthetic data set and
averages its gradient with the others' (``allreduce``, ``ReduceOp.AVG``)
every step, so all ranks hold the same weights; rank 0's initial weights are
broadcast first. Without a launcher's environment the script starts the ranks
itself and serves their rendezvous.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import numpy as np

from tensorwire.collective import Group, ReduceOp, serve_rendezvous

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


async def launch(processes: int, listen: str) -> int:
    """Start the ranks with a torchrun-style environment; serve their rendezvous."""
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", processes)
    env = {**os.environ, "WORLD_SIZE": str(processes), "TENSORWIRE_MASTER": master,
           "TENSORWIRE_MASTER_HOSTED": "1", "TENSORWIRE_LISTEN": listen}
    children = [
        await asyncio.create_subprocess_exec(sys.executable, __file__,
                                             env={**env, "RANK": str(rank)})
        for rank in range(processes)
    ]
    codes = await asyncio.gather(*(child.wait() for child in children))
    await server.close()
    return max(codes, key=abs)


def main() -> None:
    if any(key in os.environ for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")):
        asyncio.run(train())
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="ranks to start (default 4)")
    parser.add_argument("--listen", default="tcp://127.0.0.1:0",
                        help="where each rank takes data connections (tcp:// or ucx://)")
    args = parser.parse_args()
    sys.exit(asyncio.run(launch(args.n, args.listen)))


if __name__ == "__main__":
    main()
