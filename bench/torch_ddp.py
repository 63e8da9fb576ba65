"""DDP step time: gloo against each tensorwire hook, over tcp:// and ucx://, side by side.

For each world size (2 and 4 processes) and transport, one set of processes
on this host trains, in turn, the example's model (an MLP on digits-sized
inputs, 9k parameters) and a larger one (about 25M parameters, so
communication dominates) with DDP and each of:

- ``gloo``: DDP's own allreduce over gloo (the baseline; measured in the
  tcp:// set only, gloo has its own transport);
- ``allreduce``: ``tensorwire.torch.allreduce_hook``;
- ``allreduce fp16``: the same with ``compression="fp16"``;
- ``ps``: ``tensorwire.torch.ps_hook`` with one shard served by this
  process (``ps.Aggregate``: the shard sums, the workers step), over the
  set's transport; the client runs on the group's loop thread
  (``loop_of=group``), as ucx:// needs.

Rank 0 reports the median step time (forward, backward with the hook,
optimizer step) over the timed steps, after warm-up steps.

    python bench/torch_ddp.py             # writes bench/results/torch_ddp.md
    python bench/torch_ddp.py --quick     # fewer steps
    python bench/torch_ddp.py --worlds 2 --models large --hooks gloo,allreduce \\
        --output /tmp/ddp.md                # a subset (gloo always runs over tcp://)
    python bench/torch_ddp.py --rounds 5  # every set 5 times, round-robin

With ``--rounds N`` every set runs N times, one round after the other; the
table pools the steps of all rounds, and the targets take gloo's speed over
the hook's round by round (both measured minutes apart at most), reporting
the median and the range of those ratios: on this shared host one run's
ratio moves by more than the targets' margins.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "torch_ddp.md"
WORLDS = [2, 4]
TRANSPORTS = ["tcp", "ucx"]
MODELS = {"example MLP (9k)": (64, [128], 10), "large MLP (25M)": (2048, [4096, 4096], 10)}
HOOKS = ["gloo", "allreduce", "allreduce fp16", "ps"]
BATCH = 32


def build(spec: tuple[int, list[int], int]) -> Any:
    import torch

    inputs, hidden, classes = spec
    layers: list[Any] = []
    width = inputs
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, classes))
    torch.manual_seed(0)
    return torch.nn.Sequential(*layers)


def rank_main(args: argparse.Namespace) -> None:
    """One rank: every model with every hook; rank 0 prints JSON lines."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import tensorwire.torch as twt
    from tensorwire import ps
    from tensorwire.collective import GroupConfig, SyncGroup
    from tensorwire.rpc import ClientConfig
    from tensorwire.transports import TransportConfig, UCXOptions

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    # Where the processes outnumber the cores, UCX must not spin on them
    # (docs/collective.md, "Performance"), as in bench/collective.py.
    ucx = UCXOptions(spin=0) if world > (os.cpu_count() or 1) else UCXOptions()
    transport = TransportConfig(ucx=ucx)
    dist.init_process_group("gloo")
    group = SyncGroup.from_env(config=GroupConfig(timeout=600, transport=transport))
    rank = group.rank
    shards = os.environ["BENCH_SHARDS"].split(",")
    for index, (name, spec) in enumerate(MODELS.items()):
        if name not in args.models:
            continue
        steps, warm = (args.steps_large, 1) if "large" in name else (args.steps_small, 3)
        x = torch.randn(BATCH, spec[0], generator=torch.Generator().manual_seed(rank))
        y = torch.randint(0, spec[2], (BATCH,), generator=torch.Generator().manual_seed(rank))
        for hook in args.hooks:
            if hook == "gloo" and args.transport != "tcp":
                continue
            model = DistributedDataParallel(build(spec))
            client = None
            if hook.startswith("allreduce"):
                model.register_comm_hook(
                    twt.AllreduceState(group, compression="fp16" if "fp16" in hook else None),
                    twt.allreduce_hook)
            elif hook == "ps":
                client = ps.SyncClient([shards[index]], worker=rank, num_workers=world,
                                       optimizer=ps.Aggregate(), loop_of=group,
                                       config=ps.PSConfig(rpc=ClientConfig(transport=transport)))
                model.register_comm_hook(twt.PSState(client, model.module), twt.ps_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            loss_fn = torch.nn.CrossEntropyLoss()
            times = []
            for step in range(warm + steps):
                dist.barrier()
                started = time.perf_counter()
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()
                if step >= warm:
                    times.append(time.perf_counter() - started)
            if client is not None:
                client.close()
            if rank == 0:
                print(json.dumps({"model": name, "hook": hook, "times": times}), flush=True)
    group.close()
    dist.destroy_process_group()


async def run_set(world: int, transport: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One launch of ``world`` ranks over ``transport``; rank 0's JSON lines."""
    from tensorwire import ps
    from tensorwire.collective import launch

    listen = f"{transport}://127.0.0.1:0"
    # The shards listen on the set's transport; each rank's client shares
    # its group's loop (loop_of=group), as ucx:// runs one loop per process.
    shards = [await ps.serve(listen) for _ in MODELS]
    out = io.StringIO()
    try:
        argv = [sys.executable, __file__, "--as-rank", "--transport", transport,
                "--steps-small", str(args.steps_small), "--steps-large", str(args.steps_large),
                "--models", ",".join(args.models), "--hooks", ",".join(args.hooks)]
        env = {**os.environ, "BENCH_SHARDS": ",".join(s.addresses[0] for s in shards),
               "PYTHONPATH": str(ROOT)}
        result = await launch(argv, world, listen=listen, env=env, output=out)
    finally:
        for shard in shards:
            await shard.close(checkpoint=False)
    if result.exit_code != 0:
        raise SystemExit(f"{world} ranks over {transport}:// failed:\n{out.getvalue()[-3000:]}")
    return [json.loads(line.removeprefix("[rank 0] ")) for line in out.getvalue().splitlines()
            if line.startswith("[rank 0] {")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="tcp", help=argparse.SUPPRESS)
    parser.add_argument("--steps-small", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--steps-large", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--worlds", type=_choices([str(w) for w in WORLDS]),
                        default=[str(w) for w in WORLDS],
                        help="comma-separated world sizes (default: all)")
    parser.add_argument("--transports", type=_choices(TRANSPORTS), default=TRANSPORTS,
                        help="comma-separated transports (default: all)")
    parser.add_argument("--models", type=_choices(MODELS), default=list(MODELS),
                        help="comma-separated models, by the first word of their name "
                             "(example, large; default: all)")
    parser.add_argument("--hooks", type=_choices(HOOKS), default=HOOKS,
                        help="comma-separated hooks (default: all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every set this many times (default 1)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.as_rank:
        rank_main(args)
        return
    if args.quick:
        args.steps_small, args.steps_large = 10, 2
    before = os.getloadavg()
    started = time.time()
    # (world, model, variant, transport) -> the steps' times of each round
    table: dict[tuple[int, str, str, str], list[list[float]]] = {}
    for number in range(args.rounds):
        for world in map(int, args.worlds):
            for transport in args.transports:
                print(f"round {number + 1}: {world} processes over {transport}:// ...",
                      flush=True)
                for row in asyncio.run(run_set(world, transport, args)):
                    variant = ("gloo" if row["hook"] == "gloo"
                               else f"{row['hook']} {transport}://")
                    table.setdefault((world, row["model"], variant, transport),
                                     []).append(row["times"])
    write(args, table, time.time() - started, before, os.getloadavg())
    print(f"wrote {args.output}")


def _choices(names: Any) -> Any:
    """An argparse type: a comma-separated subset of ``names``, each given
    whole or by its first word, in ``names``' order."""
    names = list(names)

    def parse(text: str) -> list[str]:
        wanted = set()
        for item in text.split(","):
            found = [n for n in names if item.strip() in (n, n.split()[0])]
            if not found:
                raise argparse.ArgumentTypeError(f"{item!r} is not one of {names}")
            # "allreduce" names that hook alone, not "allreduce fp16" too.
            wanted.add(next((n for n in found if n == item.strip()), found[0]))
        return [n for n in names if n in wanted]

    return parse


def _subset(args: argparse.Namespace) -> list[str]:
    """The options of this run, as given on the command line."""
    out = ["--quick"] if args.quick else []
    if args.rounds != 1:
        out.append(f"--rounds {args.rounds}")
    for name, full in (("worlds", [str(w) for w in WORLDS]), ("transports", TRANSPORTS),
                       ("models", list(MODELS)), ("hooks", HOOKS)):
        chosen = getattr(args, name)
        if chosen != full:
            out.append(f"--{name} '{','.join(chosen)}'")
    return out


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write(args: argparse.Namespace, table: dict[tuple[int, str, str, str], list[list[float]]],
          took: float, before: tuple[float, ...], after: tuple[float, ...]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    lines = [
        "# DDP step time: gloo and tensorwire's hooks",
        "",
        f"Command: `python bench/torch_ddp.py{' '.join(['', *_subset(args)])}` "
        f"(took {took:.0f} s)",
        "",
        f"- CPU: {cpu}, {os.cpu_count()} cores, loopback only; Linux {platform.release()}",
        f"- Python {platform.python_version()}; tensorwire {version('tensorwire')}; "
        f"torch {version('torch')}; ucxx {version('ucxx-cu12')}",
        f"- tensorwire tree: {commit}",
        f"- Load average (1/5/15 min) before the run {before[0]:.2f}/{before[1]:.2f}/"
        f"{before[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}.",
        f"- A step: forward, backward (the hook's communication inside it), SGD step; batch "
        f"{BATCH} per rank, one torch thread per process. Median of {args.steps_small} "
        f"timed steps (example MLP, after 3 warm-up steps) or {args.steps_large} (large "
        f"MLP, after 1), with min-max beside it"
        + (f"; {args.rounds} rounds, their steps pooled" if args.rounds > 1 else "")
        + ". All processes share the same 2 cores "
        "(with other work on the machine): compute competes with communication, and "
        "the figures are noisy (compare within one table, not across runs).",
        "- gloo: DDP's built-in allreduce (its own transport). allreduce: "
        "`tensorwire.torch.allreduce_hook`; fp16: with `compression=\"fp16\"` (half the "
        "bytes); ps: `tensorwire.torch.ps_hook` to one shard in the benchmark's own "
        "process (`ps.Aggregate`), which serves every rank, over the set's transport "
        "(each bucket pushed as DDP hands it over; the client on the group's loop).",
        "",
    ]
    verdicts = []
    for world in map(int, args.worlds):
        lines += [f"## {world} processes", "",
                  "| model | variant | step time (ms), median | min-max (ms) | vs gloo |",
                  "|---|---|---:|---:|---:|"]
        for model in args.models:
            baseline = table.get((world, model, "gloo", "tcp"))
            gloo = statistics.median(_pooled(baseline)) if baseline else None
            for (w, m, variant, _), rounds in table.items():
                if w != world or m != model:
                    continue
                times = _pooled(rounds)
                median = statistics.median(times)
                lines.append(f"| {model} | {variant} | {median * 1e3:,.1f} | "
                             f"{min(times) * 1e3:,.1f}-{max(times) * 1e3:,.1f} | "
                             + (f"{gloo / median:.2f}x |" if gloo else "- |"))
            for transport in args.transports:
                key = (world, model, f"allreduce {transport}://", transport)
                if key in table and baseline:
                    ratios = [statistics.median(g) / statistics.median(t)
                              for g, t in zip(baseline, table[key], strict=True)]
                    verdicts.append((world, model, transport, ratios))
        lines.append("")
    lines += ["## Targets", "",
              "Target: the allreduce hook at least as fast as gloo at 2 processes, and "
              "faster over ucx://. (\"vs gloo\" above: gloo's median step time over ours; "
              "above 1 is faster.)", ""]
    if args.rounds > 1:
        lines += ["Each ratio below is the median of the rounds' ratios (gloo's median "
                  "step time in a round over the hook's in the same round), with their "
                  "range; the verdict reads the median.", ""]
    for world, model, transport, ratios in verdicts:
        if world != 2:
            continue
        ratio = statistics.median(ratios)
        verdict = "met" if (ratio > 1 if transport == "ucx" else ratio >= 1) else "**missed**"
        spread = (f" (rounds: {min(ratios):.2f}x to {max(ratios):.2f}x)"
                  if len(ratios) > 1 else "")
        lines.append(f"- 2 processes, {model}, allreduce hook over {transport}://: "
                     f"{ratio:.2f}x gloo{spread}: {verdict}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")


def _pooled(rounds: list[list[float]]) -> list[float]:
    return [t for times in rounds for t in times]


if __name__ == "__main__":
    main()
