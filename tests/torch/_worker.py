"""One rank of a tensorwire.torch test, with torch itself as the oracle.

Run as ``python -m tests.torch._worker SCENARIO`` with the environment
``tensorwire launch`` sets (``RANK``, ``WORLD_SIZE``, ``TENSORWIRE_MASTER``)
plus ``TORCH_STORE`` (a file for torch's ``FileStore``, so no port is
guessed) and, for the parameter-server scenario, ``PS_ADDRESSES``. Prints one
JSON line with its findings; the test asserts on them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorwire.torch as twt
from tensorwire import ps
from tensorwire.collective import Algorithm, GroupConfig, SyncGroup
from tensorwire.errors import FailedPrecondition
from tensorwire.timeline import Timeline

CONFIG = GroupConfig(timeout=30, rendezvous_timeout=60, heartbeat_interval=1,
                     heartbeat_timeout=20)
BATCH = 16
#: DDP's default bucket is 25 MiB; small buckets give this small model
#: several, so the hooks see more than one per step.
BUCKET_MB = 0.004


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    # The file lists the writers in turn: shuffled once, the held-out part
    # is like the rest.
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return torch.tensor(x / 16.0, dtype=torch.float32)[order], torch.tensor(y)[order]


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 10))


def batch(x: torch.Tensor, y: torch.Tensor, step: int, rank: int,
          world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of step ``step``'s global batch."""
    lo = (step * BATCH * world + rank * BATCH) % (len(x) - BATCH * world)
    return x[lo:lo + BATCH], y[lo:lo + BATCH]


def global_batch(x: torch.Tensor, y: torch.Tensor, step: int,
                 world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(x, y, step, r, world) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def train(net: torch.nn.Module, opt: Any, steps: int, data: Callable[[int], Any]) -> None:
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        xb, yb = data(step)
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        opt.step()


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def ddp(group: SyncGroup, rank: int, world: int, device: str = "cpu",
        steps: int = 12, algorithm: Algorithm = "auto") -> dict[str, Any]:
    """DDP over gloo and DDP with the tensorwire hook end with the same weights
    (on ``device``: with ``"cuda"`` the buckets are CUDA tensors)."""
    x, y = (t.to(device) for t in digits())
    results = {}
    watch = _FirstBucketWatch(twt.allreduce_hook)
    for name in ("gloo", "tensorwire"):
        net = DDP(model().to(device), bucket_cap_mb=BUCKET_MB,
                  device_ids=[0] if device == "cuda" else None)
        if name == "tensorwire":
            net.register_comm_hook(twt.AllreduceState(group, algorithm=algorithm),
                                   watch.hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
        train(net, opt, steps, lambda s: batch(x, y, s, rank, world))
        results[name] = flat(net.module)
    diff = float((results["gloo"] - results["tensorwire"]).abs().max())
    moved = float((results["gloo"] - flat(model().to(device))).abs().max())
    # Every rank must hold the same bits: compare with rank 0's.
    mine = results["tensorwire"].clone()
    group.broadcast(mine, src=0)
    return {"diff": diff, "moved": moved,
            "same_bits": bool(torch.equal(mine, results["tensorwire"])),
            "first_back_before_last": watch.back, "buckets": watch.buckets}


def optimizer(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """DistributedOptimizer against one process on the concatenated batch."""
    x, y = digits()
    steps = 10
    net = model(seed=rank)  # different on purpose: broadcast_parameters fixes it
    twt.broadcast_parameters(net.state_dict(), group, root_rank=0)
    start_equal = bool(torch.equal(flat(net), flat(model(seed=0))))
    opt = twt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9),
                                   group)
    train(net, opt, steps, lambda s: batch(x, y, s, rank, world))
    alone = model(seed=0)
    train(alone, torch.optim.SGD(alone.parameters(), lr=0.2, momentum=0.9), steps,
          lambda s: global_batch(x, y, s, world))
    diff = float((flat(net) - flat(alone)).abs().max())
    # broadcast_optimizer_state: rank 0's Adam has state, the others none.
    adam = torch.optim.Adam(model().parameters(), lr=1e-3 * (rank + 1))
    if rank == 0:
        for p in adam.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        adam.step()
    twt.broadcast_optimizer_state(adam, group, root_rank=0)
    state = adam.state_dict()
    ref = torch.optim.Adam(model().parameters(), lr=1e-3)
    for p in ref.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    ref.step()
    want = ref.state_dict()
    state_equal = (state["param_groups"][0]["lr"] == 1e-3 and all(
        torch.equal(state["state"][i]["exp_avg"], want["state"][i]["exp_avg"])
        for i in want["state"]))
    return {"diff": diff, "start_equal": start_equal, "state_equal": state_equal}


def accumulate(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """DistributedOptimizer with two backward passes per step (each on half
    of this rank's batch, the loss halved) against one process on the
    concatenated batch; then a third pass before step() must raise."""
    x, y = digits()
    steps = 10
    net = model()
    opt = twt.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9),
                                   group, backward_passes_per_step=2)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        xb, yb = batch(x, y, step, rank, world)
        opt.zero_grad()
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            (loss_fn(net(xb[half]), yb[half]) / 2).backward()
        opt.step()
    alone = model()
    train(alone, torch.optim.SGD(alone.parameters(), lr=0.2, momentum=0.9), steps,
          lambda s: global_batch(x, y, s, world))
    diff = float((flat(net) - flat(alone)).abs().max())
    moved = float((flat(net) - flat(model())).abs().max())
    xb, yb = batch(x, y, 0, rank, world)
    opt.zero_grad()
    raised = ""
    for _ in range(3):
        try:
            loss_fn(net(xb), yb).backward()
        except FailedPrecondition as exc:
            raised = str(exc)
    opt.synchronize()  # what the first two passes started, on every rank
    return {"diff": diff, "moved": moved, "raised": raised}


def ps_hook(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """The PS hook, both modes, against plain SGD applied locally; and whether
    the first bucket was back from the shards before DDP handed over the last."""
    x, y = digits()
    steps = 8
    # One shard per job: a shard serves one job (one optimizer).
    addresses = os.environ["PS_ADDRESSES"].split(",")
    out: dict[str, Any] = {}
    for address, job, server_opt in ((addresses[0], "params", ps.SGD(lr=0.2)),
                                     (addresses[1], "grads", ps.Aggregate())):
        net = DDP(model(seed=rank), bucket_cap_mb=BUCKET_MB)
        client = ps.SyncClient([address], worker=rank, num_workers=world,
                               optimizer=server_opt, loop_of=group)
        try:
            state = twt.PSState(client, net.module)
            watch = _FirstBucketWatch(twt.ps_hook)
            net.register_comm_hook(state, watch.hook)
            opt = torch.optim.SGD(net.parameters(), lr=0.2 if job == "grads" else 0.0)
            train(net, opt, steps, lambda s: batch(x, y, s, rank, world))
        finally:
            client.close()
        alone = model(seed=0)
        train(alone, torch.optim.SGD(alone.parameters(), lr=0.2), steps,
              lambda s: global_batch(x, y, s, world))
        out[job] = float((flat(net.module) - flat(alone)).abs().max())
        out[f"{job}_first_back_before_last"] = watch.back
        out[f"{job}_buckets"] = watch.buckets
    return out


class _FirstBucketWatch:
    """Wraps a hook: when DDP hands over the last bucket of a step, waits
    (bounded) for the first bucket's future, and notes whether it was done.
    Had the hook sent nothing until the backward pass ended, it could not
    be."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        self.back: list[bool] = []
        self.buckets = 0
        self._first = threading.Event()

    # Unannotated on purpose: DDP checks a hook's annotations as objects.
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        self.buckets = max(self.buckets, bucket.index() + 1)
        if bucket.is_last() and bucket.index() > 0:
            self.back.append(self._first.wait(timeout=20))
        future = self.inner(state, bucket)
        if bucket.index() == 0:
            self._first.clear()
            future.then(lambda _: self._first.set())
        return future


def ps_ucx(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """ucx:// for the group and the PS client in one process, on one loop:
    the allreduce hook against gloo, then the PS hook against local SGD."""
    found = ddp(group, rank, world, steps=4)
    x, y = digits()
    net = DDP(model(seed=rank), bucket_cap_mb=BUCKET_MB)
    client = ps.SyncClient(os.environ["PS_ADDRESSES"].split(","), worker=rank,
                           num_workers=world, optimizer=ps.SGD(lr=0.2), loop_of=group)
    try:
        net.register_comm_hook(twt.PSState(client, net.module), twt.ps_hook)
        train(net, torch.optim.SGD(net.parameters(), lr=0.0), 4,
              lambda s: batch(x, y, s, rank, world))
        shard_links = list(client.client.addresses)
    finally:
        client.close()
    alone = model(seed=0)
    train(alone, torch.optim.SGD(alone.parameters(), lr=0.2), 4,
          lambda s: global_batch(x, y, s, world))
    return {**found, "ps": float((flat(net.module) - flat(alone)).abs().max()),
            "shards": shard_links, "group_listens": _listening(group)}


def _listening(group: SyncGroup) -> str:
    listener = group.group._runtime._listener
    return "" if listener is None else listener.address


def compress(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """fp16 and int8 with error feedback converge as plain does, with fewer
    bytes: the counts of what each sent, of the gradient's elements and steps."""
    x, y = digits()
    n_train = 1400
    steps = 200
    out: dict[str, Any] = {"elements": sum(p.numel() for p in model().parameters()),
                           "steps": steps}
    for codec in (None, "fp16", "int8"):
        before = _allreduce_bytes(group)
        net = DDP(model(), bucket_cap_mb=BUCKET_MB)
        net.register_comm_hook(twt.AllreduceState(group, compression=codec),
                               twt.allreduce_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        train(net, opt, steps, lambda s: batch(x[:n_train], y[:n_train], s, rank, world))
        with torch.no_grad():
            accuracy = float((net.module(x[n_train:]).argmax(1) == y[n_train:]).float().mean())
        out[str(codec)] = {"accuracy": accuracy, "bytes": _allreduce_bytes(group) - before}
    return out


def _allreduce_bytes(group: SyncGroup) -> int:
    return sum(m["bytes_out"] for name, m in group.metrics().items()
               if name.startswith(("allreduce", "allgather")))


def kill(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """The last rank dies mid-step; the others' backward raises within the timeout."""
    x, y = digits()
    net = DDP(model(), bucket_cap_mb=BUCKET_MB)
    state = twt.AllreduceState(group)
    net.register_comm_hook(state, twt.allreduce_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(5):
        xb, yb = batch(x, y, step, rank, world)
        opt.zero_grad()
        loss = loss_fn(net(xb), yb)
        if step == 3 and rank == world - 1:
            os._exit(17)
        started = time.monotonic()
        try:
            loss.backward()
        except Exception as exc:
            return {"step": step, "seconds": time.monotonic() - started,
                    "raised": type(exc).__name__, "message": str(exc)[:500],
                    "state_error": type(state.error).__name__}
        opt.step()
    return {"raised": None}


def ddp_hierarchical(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """The oracle of ``ddp`` with the hook's allreduces hierarchical, over the
    topology that main() declared (two emulated hosts); and how many of the
    group's operations ran hierarchically."""
    found = ddp(group, rank, world, algorithm="hierarchical")
    timeline = group.group.config.timeline
    assert timeline is not None
    calls = [e["args"]["call"] for e in timeline.events]
    return {**found, "hierarchical": sum(c.endswith(",hierarchical)") for c in calls)}


def cuda_staged(group: SyncGroup, rank: int, world: int) -> dict[str, Any]:
    """The hooks whose work runs in NumPy, on CUDA buckets (copied to host
    memory and back): the fp16 hook against the same hook on the CPU, and
    the PS hook against plain SGD applied locally."""
    x, y = digits()
    steps = 6
    trained = {}
    for device in ("cpu", "cuda"):
        net = DDP(model().to(device), bucket_cap_mb=BUCKET_MB,
                  device_ids=[0] if device == "cuda" else None)
        net.register_comm_hook(twt.AllreduceState(group, compression="fp16"),
                               twt.allreduce_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.2)
        train(net, opt, steps, lambda s, d=device: tuple(t.to(d) for t in batch(x, y, s, rank,
                                                                                 world)))
        trained[device] = flat(net.module).cpu()
    net = DDP(model(seed=rank).cuda(), bucket_cap_mb=BUCKET_MB, device_ids=[0])
    client = ps.SyncClient(os.environ["PS_ADDRESSES"].split(","), worker=rank,
                           num_workers=world, optimizer=ps.SGD(lr=0.2), loop_of=group)
    try:
        net.register_comm_hook(twt.PSState(client, net.module), twt.ps_hook)
        train(net, torch.optim.SGD(net.parameters(), lr=0.0), steps,
              lambda s: tuple(t.cuda() for t in batch(x, y, s, rank, world)))
    finally:
        client.close()
    alone = model(seed=0)
    train(alone, torch.optim.SGD(alone.parameters(), lr=0.2), steps,
          lambda s: global_batch(x, y, s, world))
    return {"fp16": float((trained["cpu"] - trained["cuda"]).abs().max()),
            "moved": float((trained["cuda"] - flat(model())).abs().max()),
            "ps": float((flat(net.module).cpu() - flat(alone)).abs().max())}


SCENARIOS = {"ddp": ddp, "optimizer": optimizer, "accumulate": accumulate, "ps": ps_hook,
             "ps_ucx": ps_ucx,
             "compress": compress,
             "kill": kill, "ddp_cuda": functools.partial(ddp, device="cuda"),
             "cuda_staged": cuda_staged, "ddp_hierarchical": ddp_hierarchical}
#: Scenarios whose group declares a topology: two emulated hosts, ranks
#: split in halves, and every allreduce above 1 KiB hierarchical.
HIERARCHICAL = {"ddp_hierarchical"}


def main() -> None:
    scenario = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.environ['TORCH_STORE']}",
                            rank=rank, world_size=world)
    config = CONFIG
    if scenario in HIERARCHICAL:
        hosts = {"a": list(range(world // 2)), "b": list(range(world // 2, world))}
        config = dataclasses.replace(CONFIG, topology=hosts, hierarchical_bytes=1 << 10,
                                     timeline=Timeline())
    group = SyncGroup.from_env(config=config)
    try:
        found = SCENARIOS[scenario](group, rank, world)
        report(rank=rank, ok=True, **found)
    finally:
        if scenario != "kill":
            group.close()
            dist.destroy_process_group()
    if scenario == "kill":
        os._exit(0)  # the group is broken and torch's store waits for the dead rank


if __name__ == "__main__":
    main()
