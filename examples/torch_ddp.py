"""PyTorch DDP with tensorwire's allreduce hook: an MLP on scikit-learn's digits.

    tensorwire launch --nproc-per-node 3 examples/torch_ddp.py
    python examples/torch_ddp.py                        # starts 3 ranks itself
    python examples/torch_ddp.py --compression fp16     # half the bytes, error feedback
    torchrun --nproc-per-node 3 examples/torch_ddp.py   # the same script under torchrun

A plain DDP script plus two lines: torch.distributed stays on gloo for what
DDP does at start (it broadcasts the model), and the gradients go through a
tensorwire group (``register_comm_hook``), with its transports (tcp://,
ucx://), algorithms, hierarchical topology and compression.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel

import tensorwire.torch as twt
from tensorwire.collective import SyncGroup, launch

BATCH = 32  # per rank


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=3, help="ranks to start without a launcher")
    parser.add_argument("--listen", default="tcp://127.0.0.1:0",
                        help="the ranks' data transport (tcp:// or ucx://)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--compression", default=None,
                        help="fp16, bf16, int8, fp8 or topk (default: none)")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")                       # MASTER_ADDR, MASTER_PORT, RANK, ...
    group = SyncGroup.from_env()                          # the same environment
    rank, world = group.rank, group.world_size

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x / 16.0, dtype=torch.float32)[order]
    y = torch.tensor(y)[order]
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    mine = slice(rank, None, world)                       # this rank's share of the data

    torch.manual_seed(rank)                               # DDP broadcasts rank 0's weights
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    model.register_comm_hook(twt.AllreduceState(group, compression=args.compression),
                             twt.allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    xs, ys = x_train[mine], y_train[mine]
    steps = len(xs) // BATCH
    for epoch in range(args.epochs):
        perm = torch.randperm(len(xs), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            batch = perm[step * BATCH:(step + 1) * BATCH]
            optimizer.zero_grad()
            loss = loss_fn(model(xs[batch]), ys[batch])
            loss.backward()                               # the hook averages over the group
            optimizer.step()
        with torch.no_grad():
            accuracy = (model.module(x_test).argmax(1) == y_test).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch}  loss {loss.item():.4f}  test accuracy {accuracy:.3f}",
                  flush=True)

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    parts = [torch.empty_like(weights) for _ in range(world)]
    group.all_gather(parts, weights)
    assert all(torch.equal(parts[0], p) for p in parts), "ranks diverged"
    if rank == 0:
        sent = sum(m["bytes_out"] for m in group.metrics().values())
        print(f"trained on {world} ranks: weights identical on every rank, "
              f"rank 0 sent {sent / 2**20:.1f} MiB", flush=True)
    group.close()
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    if "RANK" in os.environ:
        train(args)
        return
    result = asyncio.run(launch([sys.executable, __file__, *sys.argv[1:]], args.n,
                                listen=args.listen))
    sys.exit(result.exit_code)


if __name__ == "__main__":
    main()
