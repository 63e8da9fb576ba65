"""Allreduce benchmark: tensorwire over tcp:// and ucx:// against gloo, side by side.

For each world size, each variant starts that many processes on this host;
every process allreduces float32 arrays from 8 B to 256 MiB (in place, sum)
and rank 0 reports the time per operation. Bandwidths follow nccl-tests:
algbw = bytes / time, busbw = algbw * 2 (n - 1) / n.

    python bench/collective.py            # writes bench/results/collective.md
    python bench/collective.py --quick    # fewer sizes and repetitions

gloo is torch.distributed's CPU backend (a CPU torch build will do); it
rendezvous through a FileStore, tensorwire through a rendezvous served here.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _spin_setting import tcp_spin

RESULTS = Path(__file__).parent / "results" / "collective.md"
SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [8, 64 << 10, 1 << 20, 16 << 20]
WORLDS = [2, 4]
VARIANTS = ["tensorwire tcp://", "tensorwire ucx://", "gloo"]


def repetitions(size: int, quick: bool) -> int:
    """Enough operations for ~0.5 s at 1 GB/s, at least 3."""
    budget = 0.15e9 if quick else 0.5e9
    return int(max(3, min(2000, budget // size)))


async def measure(run: Any, barrier: Any, sizes: list[int], quick: bool) -> list[float]:
    """Seconds per allreduce for each size (median of 3 timed batches).

    ``run(x)`` and ``barrier()`` are coroutines, so the same loop times both
    libraries.
    """
    results = []
    for size in sizes:
        x = np.ones(size // 4, np.float32)
        batch = max(1, repetitions(size, quick) // 3)
        await run(x)  # warm-up: connections, first touch of the pages
        batches = []
        for _ in range(3):
            await barrier()
            start = time.perf_counter()
            for _ in range(batch):
                await run(x)
            batches.append((time.perf_counter() - start) / batch)
        results.append(statistics.median(batches))
    return results


def tensorwire_rank(rank: int, world: int, master: str, listen: str, sizes: list[int],
                    quick: bool) -> list[float]:
    from tensorwire.collective import Group, GroupConfig
    from tensorwire.transports import TransportConfig, UCXOptions

    # More ranks than cores: UCX's poll-after-completion would take the core
    # the peer needs (UCXOptions.spin).
    ucx = UCXOptions()
    config = GroupConfig(timeout=600, transport=TransportConfig(ucx=ucx, tcp_spin=tcp_spin()))

    async def main() -> list[float]:
        group = await Group.create(rank=rank, world_size=world, master=master, listen=listen,
                                   host_master=False, config=config)
        try:
            return await measure(group.allreduce, group.barrier, sizes, quick)
        finally:
            await group.close()

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def gloo_rank(rank: int, world: int, store_path: str, sizes: list[int],
              quick: bool) -> list[float]:
    import torch
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)

    async def run(x: np.ndarray[Any, Any]) -> None:
        dist.all_reduce(torch.from_numpy(x))

    async def barrier() -> None:
        dist.barrier()

    try:
        return asyncio.run(measure(run, barrier, sizes, quick))
    finally:
        dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    sizes = json.loads(args.sizes)
    if args.variant == "gloo":
        out = gloo_rank(args.rank, args.world, args.address, sizes, args.quick)
    else:
        out = tensorwire_rank(args.rank, args.world, args.address, args.listen, sizes,
                              args.quick)
    if args.rank == 0:
        print(json.dumps(out), flush=True)


def run_variant(variant: str, world: int, sizes: list[int], quick: bool) -> list[float]:
    """Start ``world`` processes of ``variant``; rank 0's seconds per size."""
    common = ["--sizes", json.dumps(sizes), "--world", str(world)] + (["--quick"] if quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        server = None
        if variant == "gloo":
            address, listen = os.path.join(tmp, "store"), ""
        else:
            from tensorwire.collective import serve_rendezvous

            loop = asyncio.new_event_loop()
            server, address = loop.run_until_complete(
                serve_rendezvous("tcp://127.0.0.1:0", world))
            listen = "ucx://127.0.0.1:0" if "ucx" in variant else "tcp://127.0.0.1:0"
            # Serve the rendezvous from a thread while the ranks run.
            import threading

            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
        try:
            children = [
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", variant, "--rank", str(rank),
                     "--address", address, "--listen", listen, *common],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                )
                for rank in range(world)
            ]
            outputs = [child.communicate(timeout=1800) for child in children]
        finally:
            if server is not None:
                asyncio.run_coroutine_threadsafe(server.close(grace=0), loop).result(30)
                loop.call_soon_threadsafe(loop.stop)
        for child, (_, err) in zip(children, outputs, strict=True):
            if child.returncode != 0:
                raise RuntimeError(f"{variant} rank failed:\n{err[-3000:]}")
        for line in outputs[0][0].splitlines():
            if line.startswith("["):
                result: list[float] = json.loads(line)
                return result
        raise RuntimeError(f"{variant}: rank 0 printed no result:\n{outputs[0][1][-3000:]}")


def fmt_size(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        args.variant = args.worker
        worker(args)
        return

    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.time()
    load_before = os.getloadavg()
    table: dict[tuple[str, int], list[float]] = {}
    for world in WORLDS:
        for variant in VARIANTS:
            print(f"{variant} with {world} processes ...", flush=True)
            table[variant, world] = run_variant(variant, world, sizes, args.quick)
    load_after = os.getloadavg()
    write(args, sizes, table, time.time() - started, load_before, load_after)
    print(f"wrote {args.output}")


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write(args: argparse.Namespace, sizes: list[int], table: dict[tuple[str, int], list[float]],
          took: float, before: tuple[float, ...], after: tuple[float, ...]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    lines = [
        "# Allreduce benchmark",
        "",
        f"Command: `python bench/collective.py{' --quick' if args.quick else ''}` "
        f"(took {took:.0f} s)",
        "",
        f"- CPU: {cpu}, {os.cpu_count()} cores, loopback only; Linux {platform.release()}",
        f"- Python {platform.python_version()}; NumPy {np.__version__}; "
        f"tensorwire {version('tensorwire')}; torch {version('torch')}; "
        f"ucxx {version('ucxx-cu12')}",
        f"- tensorwire tree: {commit}",
        f"- Load average (1/5/15 min) before the run {before[0]:.2f}/{before[1]:.2f}/"
        f"{before[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}.",
        "- float32 sum allreduce in place; time per operation is the median of 3 timed "
        "batches after a warm-up operation; every process of a variant runs on the same "
        "2 cores, so 4 processes share them two by two.",
        "- ucx:// runs with `UCXOptions(spin=0)` where the processes outnumber the cores "
        "(docs/collective.md, \"Performance\"), with UCX's defaults otherwise; tcp:// "
        f"with `TransportConfig(tcp_spin={tcp_spin()})`.",
        "- algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests' definition); "
        "1 GB/s = 1e9 bytes/s.",
        "",
    ]
    for world in WORLDS:
        factor = 2 * (world - 1) / world
        lines += [f"## {world} processes", ""]
        header = "| size |" + "".join(
            f" {v} time (µs) | {v} busbw (GB/s) |" for v in VARIANTS)
        lines += [header, "|---:|" + "---:|---:|" * len(VARIANTS)]
        for index, size in enumerate(sizes):
            row = f"| {fmt_size(size)} |"
            for variant in VARIANTS:
                seconds = table[variant, world][index]
                row += f" {seconds * 1e6:,.1f} | {size / seconds * factor / 1e9:.3f} |"
            lines.append(row)
        lines.append("")
    lines += ["## Targets", ""]
    for world in WORLDS:
        gloo = table["gloo", world]
        for variant, floor, ratio in (("tensorwire tcp://", 1 << 20, 1.0),
                                      ("tensorwire ucx://", 16 << 20, 1.5)):
            ours = table[variant, world]
            checked = [(s, g / o) for s, o, g in zip(sizes, ours, gloo, strict=True)
                       if s >= floor]
            worst = min(checked, key=lambda item: item[1])
            verdict = "met" if worst[1] >= ratio else "**missed**"
            lines.append(
                f"- {world} processes, {variant} busbw >= {ratio}x gloo's from "
                f"{fmt_size(floor)} up: {verdict} (lowest {worst[1]:.2f}x at "
                f"{fmt_size(worst[0])})")
        small = [(s, table["gloo", world][i] / table[v, world][i])
                 for i, s in enumerate(sizes) if s <= 64 << 10
                 for v in ("tensorwire tcp://", "tensorwire ucx://")]
        worst_small = min(small, key=lambda item: item[1])
        verdict = "met" if worst_small[1] >= 1.0 else "**missed**"
        lines.append(
            f"- {world} processes, small-message latency no worse than gloo's (up to 64 KiB): "
            f"{verdict} (worst: tensorwire takes {1 / worst_small[1]:.2f}x gloo's time at "
            f"{fmt_size(worst_small[0])})")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
