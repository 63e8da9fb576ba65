"""One rank of a multi-process collective test.

Run as ``python -m tests.collective._worker SCENARIO RANK WORLD MASTER LISTEN``.
Every rank can rebuild every other rank's input (seeded by rank and case),
so each checks its own results against a NumPy reference computed locally.
Prints one JSON line per finding; exits non-zero on a failed check.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorwire.collective import Group, GroupConfig, ReduceOp
from tensorwire.errors import CollectiveError, InvalidArgument

#: Small thresholds so that modest sizes exercise every algorithm. Liveness
#: as by default, within reason: five ranks on a shared 2-core VM can all
#: stall for seconds, and no scenario here needs a silent peer found sooner
#: (a rank that dies closes its connections and is found at once).
CONFIG = GroupConfig(timeout=60, rendezvous_timeout=60, small_bytes=16 << 10,
                     segment_bytes=256 << 10, heartbeat_interval=1, heartbeat_timeout=20)
#: For the scenario run across a link that is cut: the silent peer is found
#: by heartbeats, within seconds.
QUICK_LIVENESS = dataclasses.replace(CONFIG, heartbeat_interval=0.5, heartbeat_timeout=3)
SIZES = (0, 1, 1009, 3 * (1 << 20) // 4 + 3)  # empty, one, a prime, ~3 MiB of float32
DTYPES = ("int32", "int64", "float32", "float64")
REDUCTIONS = {
    "sum": lambda xs: np.sum(xs, axis=0),
    "min": lambda xs: np.min(xs, axis=0),
    "max": lambda xs: np.max(xs, axis=0),
    "product": lambda xs: np.prod(xs, axis=0),
    "avg": lambda xs: np.mean(xs, axis=0),
}


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def data(rank: int, case: int, count: int, dtype: str) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(rank * 7919 + case)
    if dtype.startswith("int"):
        # Small values keep products and sums exact in 32 bits.
        return rng.integers(-3, 4, count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def check(got: Any, want: Any, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape} != {want.shape}")
    if want.dtype.kind in "iu":
        ok = np.array_equal(got, want)
    else:
        ok = np.allclose(got, want, rtol=1e-5 if want.dtype == np.float32 else 1e-12, atol=1e-5)
    if not ok:
        raise AssertionError(f"{what}: values differ (first {got.ravel()[:4]} vs "
                             f"{want.ravel()[:4]})")


async def ops(group: Group) -> None:
    """Every operation, size, dtype and algorithm against NumPy."""
    n, rank = group.world_size, group.rank
    case = 0
    checks = 0
    for count in SIZES:
        for dtype in DTYPES:
            large = count > 10_000
            # Both algorithm families at every size that can tell them apart.
            algorithms = ("auto",) if large and dtype != "float32" else ("tree", "ring")
            for algorithm in algorithms:
                case += 1
                inputs = [data(r, case, count, dtype) for r in range(n)]
                for name, reference in REDUCTIONS.items():
                    if name == "avg" and dtype.startswith("int"):
                        continue
                    if name == "product" and large:
                        continue
                    x = inputs[rank].copy()
                    if algorithm == "ring" and 0 < count < n:
                        # A forced ring needs a block per rank: refused, not switched.
                        try:
                            group.allreduce(x, ReduceOp(name), algorithm=algorithm)
                        except InvalidArgument:
                            continue
                        raise AssertionError(f"ring on {count} elements was not refused")
                    got = await group.allreduce(x, ReduceOp(name), algorithm=algorithm)
                    assert got is x
                    check(x, reference(np.stack(inputs)).astype(dtype),
                          f"allreduce {name} {dtype}[{count}] {algorithm}")
                    checks += 1
                root = case % n
                x = inputs[rank].copy()
                await group.broadcast(x, root=root, algorithm=algorithm)
                check(x, inputs[root], f"broadcast {dtype}[{count}] {algorithm}")
                x = inputs[rank].copy()
                await group.reduce(x, root=root,
                                   algorithm="tree" if 0 < count < n else algorithm)
                if rank == root:
                    check(x, np.sum(np.stack(inputs), axis=0),
                          f"reduce {dtype}[{count}] {algorithm}")
                parts = await group.allgather(inputs[rank], algorithm=algorithm)
                check(parts, np.stack(inputs), f"allgather {dtype}[{count}] {algorithm}")
                x = inputs[rank].copy()
                mine = await group.reduce_scatter(x, algorithm=algorithm)
                want = np.array_split(np.sum(np.stack(inputs), axis=0), n)[rank]
                check(mine, want, f"reduce_scatter {dtype}[{count}] {algorithm}")
                checks += 4
                gathered = await group.gather(inputs[rank], root=root)
                if rank == root:
                    check(gathered, np.stack(inputs), f"gather {dtype}[{count}]")
                else:
                    assert gathered is None
                out = np.empty(count, dtype)
                table = np.stack([data(r, case + 1000, count, dtype) for r in range(n)])
                await group.scatter(out, table if rank == root else None, root=root)
                check(out, table[rank], f"scatter {dtype}[{count}]")
                sent = np.stack([data(rank * n + j, case, count // n + 1, dtype)
                                 for j in range(n)])
                received = await group.alltoall(sent)
                check(received, np.stack([data(i * n + rank, case, count // n + 1, dtype)
                                          for i in range(n)]), f"alltoall {dtype}[{count}]")
                checks += 3
    await group.barrier()
    # Several operations in flight at once, awaited together.
    xs = [np.full(100, rank + i, np.int64) for i in range(5)]
    works = [group.allreduce(x) for x in xs]
    await asyncio.gather(*works)
    for i, x in enumerate(xs):
        check(x, np.full(100, sum(r + i for r in range(n))), f"in flight {i}")
    # 2-D, Fortran order, 0-d.
    m = np.asfortranarray(np.arange(12.0).reshape(3, 4) * (rank + 1))
    await group.allreduce(m)
    check(m, np.arange(12.0).reshape(3, 4) * sum(range(1, n + 1)), "fortran allreduce")
    scalar = np.array(float(rank))
    await group.allreduce(scalar, ReduceOp.MAX)
    check(scalar, np.array(float(n - 1)), "0-d allreduce")
    report(rank=rank, checks=checks + 3, ok=True)


async def torch_ops(group: Group) -> None:
    import torch

    n, rank = group.world_size, group.rank
    t = torch.full((1000,), float(rank + 1))
    await group.allreduce(t)
    check(t.numpy(), np.full(1000, n * (n + 1) / 2), "torch allreduce")
    b = torch.arange(300_000, dtype=torch.float32) if rank == 0 else torch.zeros(300_000)
    await group.broadcast(b, root=0)
    check(b.numpy(), np.arange(300_000, dtype=np.float32), "torch broadcast")
    bf = torch.full((64,), float(rank + 1), dtype=torch.bfloat16)
    await group.allreduce(bf)
    check(bf.float().numpy(), np.full(64, n * (n + 1) / 2, np.float32), "torch bf16 allreduce")
    parts = await group.allgather(torch.full((3,), rank, dtype=torch.int64))
    assert isinstance(parts, torch.Tensor)
    check(parts.numpy(), np.repeat(np.arange(n), 3).reshape(n, 3), "torch allgather")
    report(rank=rank, ok=True)


async def p2p_and_subgroups(group: Group) -> None:
    n, rank = group.world_size, group.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    out = np.empty(1000, np.float64)
    sending = asyncio.ensure_future(group.send(np.full(1000, float(rank)), right, tag=7))
    await group.recv(out, left, tag=7)
    await sending
    check(out, np.full(1000, float(left)), "p2p ring")
    big = np.empty(1 << 20, np.float32)
    sending = asyncio.ensure_future(group.send(np.full(1 << 20, rank, np.float32), left, tag=1))
    await group.recv(big, right, tag=1)
    await sending
    check(big, np.full(1 << 20, right, np.float32), "p2p large")
    evens = await group.new_group([r for r in range(n) if r % 2 == 0])
    odds = await group.new_group([r for r in range(n) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    assert mine is not None and (odds if rank % 2 == 0 else evens) is None
    x = np.full(10, rank, np.int64)
    await mine.allreduce(x)
    check(x, np.full(10, sum(r for r in range(n) if r % 2 == rank % 2)), "subgroup allreduce")
    await group.allreduce(np.zeros(3))  # the parent still works alongside
    report(rank=rank, subgroup_rank=mine.rank, subgroup_size=mine.world_size,
           topology=group.topology, ok=True)


async def mismatch(group: Group) -> None:
    """The last rank calls broadcast where the others call allreduce."""
    x = np.ones(1000, np.float32)
    try:
        if group.rank == group.world_size - 1:
            await group.broadcast(x, root=0)
        else:
            await group.allreduce(x)
    except CollectiveError as exc:
        report(rank=group.rank, error=type(exc).__name__, ranks=list(exc.ranks), text=str(exc))
        # The group is broken: the next operation fails at once with the same error.
        try:
            group.barrier()
        except CollectiveError as again:
            report(rank=group.rank, again=type(again).__name__)


async def deadline(group: Group) -> None:
    """The last rank never calls the allreduce; the others time out naming it."""
    loop = asyncio.get_running_loop()
    if group.rank == group.world_size - 1:
        await asyncio.sleep(8)
        report(rank=group.rank, idle=True)
        return
    started = loop.time()
    try:
        await group.allreduce(np.ones(10), timeout=1.5)
    except CollectiveError as exc:
        report(rank=group.rank, error=type(exc).__name__, ranks=list(exc.ranks), text=str(exc),
               seconds=loop.time() - started)


async def dies(group: Group) -> None:
    """The last rank exits hard while the others are inside an allreduce."""
    loop = asyncio.get_running_loop()
    await group.allreduce(np.ones(10))
    last = group.world_size - 1
    signal = np.zeros(1)
    if group.rank == last:
        # Point-to-point messages run beside the collective order: each says
        # "my next allreduce has started".
        for peer in range(last):
            await group.recv(signal, peer)
        os._exit(3)
    started = loop.time()
    # Many steps of a large ring, so the ranks are mid-operation when it dies.
    work = group.allreduce(np.ones(1 << 22, np.float32), timeout=60)
    await group.send(signal, last)
    try:
        await work
    except CollectiveError as exc:
        report(rank=group.rank, error=type(exc).__name__, ranks=list(exc.ranks), text=str(exc),
               seconds=loop.time() - started)


async def until_failure(group: Group) -> None:
    """Allreduce until something fails (bounded: 400 operations or 30 s)."""
    loop = asyncio.get_running_loop()
    report(rank=group.rank, started=True)
    deadline = loop.time() + 30
    x = np.ones(1 << 18, np.float32)
    done = 0
    try:
        while done < 400 and loop.time() < deadline:
            await group.allreduce(x, timeout=20)
            x[:] = 1
            done += 1
            await asyncio.sleep(0.05)
    except CollectiveError as exc:
        report(rank=group.rank, error=type(exc).__name__, ranks=list(exc.ranks),
               text=str(exc), at=time.time(), done=done)


async def hierarchy_and_link_bytes(group: Group) -> None:
    """Hierarchical operations against NumPy; then a flat ring and a
    hierarchical allreduce of 16 MiB, each started when the test (which
    reads the hosts' link counters in between) writes a line to stdin."""
    n, rank = group.world_size, group.rank
    checks = 0
    for case, (count, dtype) in enumerate([(1, "int64"), (1009, "float32"),
                                           (300_000, "float64"), (70_001, "int32")]):
        inputs = [data(r, case, count, dtype) for r in range(n)]
        for name in ("sum", "max", "avg"):
            if name == "avg" and dtype.startswith("int"):
                continue
            x = inputs[rank].copy()
            await group.allreduce(x, ReduceOp(name), algorithm="hierarchical")
            check(x, REDUCTIONS[name](np.stack(inputs)).astype(dtype),
                  f"hierarchical allreduce {name} {dtype}[{count}]")
            checks += 1
        for root in range(n):
            x = inputs[rank].copy()
            await group.broadcast(x, root=root, algorithm="hierarchical")
            check(x, inputs[root], f"hierarchical broadcast {dtype}[{count}] root {root}")
            checks += 1
        parts = await group.allgather(inputs[rank], algorithm="hierarchical")
        check(parts, np.stack(inputs), f"hierarchical allgather {dtype}[{count}]")
        checks += 1
    report(rank=rank, topology=group.topology, checks=checks)
    loop = asyncio.get_running_loop()
    x = np.empty(4 << 20, np.float32)
    for algorithm in ("ring", "hierarchical"):
        await group.barrier()
        report(rank=rank, ready=algorithm)
        await loop.run_in_executor(None, sys.stdin.readline)
        x[:] = rank
        await group.allreduce(x, algorithm=algorithm)  # type: ignore[arg-type]
        check(x[:: 1 << 16], np.full(64, n * (n - 1) / 2, np.float32), f"{algorithm} 16 MiB")
        await group.barrier()
        report(rank=rank, done=algorithm)
    report(rank=rank, ok=True)


SCENARIOS: dict[str, Callable[[Group], Any]] = {
    "ops": ops,
    "torch": torch_ops,
    "p2p": p2p_and_subgroups,
    "mismatch": mismatch,
    "deadline": deadline,
    "dies": dies,
    "until_failure": until_failure,
    "hierarchy": hierarchy_and_link_bytes,
}


async def main(scenario: str, rank: int, world: int, master: str, listen: str) -> None:
    if scenario == "torch":
        # Importing torch blocks the event loop for seconds: not while heartbeats run.
        import torch  # noqa: F401
    config = QUICK_LIVENESS if scenario == "until_failure" else CONFIG
    group = await Group.create(rank=rank, world_size=world, master=master, listen=listen,
                               host_master=False, config=config)
    try:
        await SCENARIOS[scenario](group)
    finally:
        await group.close()


if __name__ == "__main__":
    name, rank_arg, world_arg, master_arg, listen_arg = sys.argv[1:6]
    asyncio.run(main(name, int(rank_arg), int(world_arg), master_arg, listen_arg))
