"""Parameter-server benchmark: push, pull and push_pull throughput beside the raw transport.

For each transport (tcp://, ucx://) and each count of workers (1-4) and
shards (1-4), every shard and every worker is its own process (spawn
context, uvloop). Each worker holds a model of ``--megabytes`` float32
(tensors of 4 MiB, one chunk each) in synchronous mode with plain SGD on the
shards, and times, in turn, ``rounds`` pushes, ``rounds`` pulls and
``rounds`` push_pulls, all workers starting each phase together.

Throughput is model bytes moved per second: per worker (its bytes over its
time) and in aggregate (all workers' bytes over the phase's wall time).
push_pull counts both directions (2 x model bytes per call). Beside it, the
raw transport's bandwidth measured in the same run between two processes
(``tensorwire.transports``, no RPC): one way (the model's frames sent, a
tiny acknowledgement back) and echo (sent and returned, both directions).

For the target (push_pull at 80% of the raw bandwidth one worker has),
raw echo and one-worker-one-shard push_pull also run alternately a few times,
so both see the same load on a shared host.

Also: placement imbalance on ResNet-50's parameter shapes, and the wall time
of the demo (examples/ps_train.py).

    python bench/ps.py                 # writes bench/results/ps.md
    python bench/ps.py --quick         # fewer rounds, 1/2/4 workers and shards
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "ps.md"
ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TENSOR = 4 * MiB


def _model(megabytes: int) -> dict[str, np.ndarray]:
    count = max(1, megabytes * MiB // TENSOR)
    rng = np.random.default_rng(0)
    return {f"t{i}": rng.standard_normal(TENSOR // 4).astype(np.float32) for i in range(count)}


def _loop_run(main: Any) -> Any:
    import uvloop

    return uvloop.run(main)


# --- processes ---------------------------------------------------------------


def shard_main(url: str, ready: Any, stop: Any) -> None:
    async def main() -> None:
        from tensorwire import ps

        shard = await ps.serve(url)
        ready.put(shard.addresses[0])
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await shard.close(checkpoint=False)

    _loop_run(main())


def worker_main(rank: int, workers: int, addresses: list[str], megabytes: int, rounds: int,
                message_mib: int, barrier: Any, results: Any) -> None:
    async def main() -> None:
        from tensorwire import ps

        loop = asyncio.get_running_loop()
        model = _model(megabytes)
        grads = {k: v * 1e-3 for k, v in model.items()}
        client = await ps.connect(addresses, worker=rank, num_workers=workers,
                                  optimizer=ps.SGD(lr=0.01),
                                  config=ps.PSConfig(message_bytes=message_mib * MiB))
        async with client:
            await client.init(model)
            await client.push_pull(grads)  # warm-up: connections, first allocations
            times: dict[str, float] = {}
            walls: dict[str, float] = {}
            for phase in ("push", "pull", "push_pull"):
                await loop.run_in_executor(None, barrier.wait)
                started = time.perf_counter()
                samples = []
                for _ in range(rounds):
                    begun = time.perf_counter()
                    if phase == "push":
                        await client.push(grads)
                    elif phase == "pull":
                        await client.pull()
                    else:
                        await client.push_pull(grads)
                    samples.append(time.perf_counter() - begun)
                times[phase] = statistics.median(samples)
                await loop.run_in_executor(None, barrier.wait)
                walls[phase] = time.perf_counter() - started
            results.put((rank, times, walls, client.imbalance))

    _loop_run(main())


def raw_server(url: str, ready: Any, stop: Any) -> None:
    async def main() -> None:
        from tensorwire.errors import ConnectionClosedError
        from tensorwire.transports import listen

        async def serve(conn: Any) -> None:
            with contextlib.suppress(ConnectionClosedError):
                while True:
                    frames = await conn.recv()
                    if len(frames) > 1 and bytes(frames[0]) == b"echo":
                        await conn.send(frames)
                    else:
                        await conn.send([b"ack"])

        listener = await listen(url, serve)
        ready.put(listener.address)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await listener.close()

    _loop_run(main())


def raw_client(address: str, megabytes: int, rounds: int, results: Any) -> None:
    async def main() -> None:
        from tensorwire.transports import connect

        frames = list(_model(megabytes).values())
        nbytes = sum(f.nbytes for f in frames)
        async with await connect(address) as conn:
            out = {}
            for kind in ("oneway", "echo"):
                head = b"echo" if kind == "echo" else b"data"
                await conn.send([head, *frames])
                await conn.recv()
                samples = []
                for _ in range(rounds):
                    started = time.perf_counter()
                    await conn.send([head, *frames])
                    await conn.recv()
                    samples.append(time.perf_counter() - started)
                moved = nbytes * (2 if kind == "echo" else 1)
                out[kind] = moved / statistics.median(samples) / 1e9
            results.put(out)

    _loop_run(main())


# --- runs --------------------------------------------------------------------


def run_raw(url: str, megabytes: int, rounds: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    ready, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=raw_server, args=(url, ready, stop))
    server.start()
    try:
        address = ready.get(timeout=60)
        client = ctx.Process(target=raw_client, args=(address, megabytes, rounds, results))
        client.start()
        out: dict[str, float] = results.get(timeout=300)
        client.join(30)
        return out
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()


def allreduce_rank(rank: int, workers: int, master: str, url: str, megabytes: int, rounds: int,
                   results: Any) -> None:
    async def main() -> None:
        from tensorwire.collective import Group

        group = await Group.create(rank=rank, world_size=workers, master=master, listen=url,
                                   host_master=False)
        # The whole model as one bucket, as data-parallel training reduces it.
        flat = np.concatenate(list(_model(megabytes).values()))
        await group.allreduce(flat)
        times = []
        for _ in range(rounds):
            await group.barrier()
            start = time.perf_counter()
            await group.allreduce(flat)
            times.append(time.perf_counter() - start)
        await group.close()
        results.put(statistics.median(times))

    _loop_run(main())


def run_allreduce(url: str, workers: int, megabytes: int, rounds: int) -> float:
    """Per worker GB/s of a ring allreduce of the model: 2 x model bytes / time,
    counted as push_pull counts its bytes."""
    import threading

    from tensorwire.collective import serve_rendezvous

    loop = asyncio.new_event_loop()
    server, master = loop.run_until_complete(serve_rendezvous("tcp://127.0.0.1:0", workers))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=allreduce_rank,
                         args=(r, workers, master, url, megabytes, rounds, results))
             for r in range(workers)]
    try:
        for p in procs:
            p.start()
        seconds = statistics.median(results.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        asyncio.run_coroutine_threadsafe(server.close(grace=0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    return 2 * len(_model(megabytes)) * TENSOR / seconds / 1e9


def run_ps(url: str, workers: int, shards: int, megabytes: int, rounds: int,
           message_mib: int = 8) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    barrier = ctx.Barrier(workers)
    servers = [ctx.Process(target=shard_main, args=(url, ready, stop)) for _ in range(shards)]
    procs: list[Any] = []
    for p in servers:
        p.start()
    try:
        addresses = sorted(ready.get(timeout=60) for _ in servers)
        procs = [ctx.Process(target=worker_main,
                             args=(r, workers, addresses, megabytes, rounds, message_mib,
                                   barrier, results))
                 for r in range(workers)]
        for p in procs:
            p.start()
        reports = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        stop.set()
        for p in [*procs, *servers]:
            p.join(30)
            if p.is_alive():
                p.kill()
    nbytes = len(_model(megabytes)) * TENSOR
    row: dict[str, Any] = {"imbalance": reports[0][3]}
    for phase in ("push", "pull", "push_pull"):
        moved = nbytes * (2 if phase == "push_pull" else 1)
        per_worker = [moved / times[phase] / 1e9 for _, times, _, _ in reports]
        wall = max(walls[phase] for _, _, walls, _ in reports)
        row[phase] = (statistics.mean(per_worker), workers * moved * rounds / wall / 1e9)
    return row


def resnet50_shapes() -> list[tuple[int, ...]]:
    """torchvision's ResNet-50 parameter shapes (25,557,032 parameters)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if block == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    return [*shapes, (1000, 2048), (1000,)]


def placement_rows() -> list[str]:
    from tensorwire import ps

    specs = [ps.TensorSpec(f"p{i:03d}", s, "<f4") for i, s in enumerate(resnet50_shapes())]
    assert sum(math.prod(s.shape) for s in specs) == 25_557_032
    chunks = ps.chunk_tensors(specs, 4 * MiB)
    total = sum(c.nbytes for c in chunks)
    rows = []
    for shards in range(1, 17):
        old = ps.place(chunks, shards)
        new = ps.resize(old, shards + 1)
        rows.append(f"| {shards} | {old.imbalance:.4f} | {new.imbalance:.4f} | "
                    f"{old.moved_bytes(new) / total:.3f} | {1 / (shards + 1):.3f} |")
    return rows


def demo_time() -> tuple[float, str]:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ps_train.py")],
                         capture_output=True, text=True, timeout=300, check=True)
    last = out.stdout.strip().splitlines()[-1]
    return time.perf_counter() - started, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--megabytes", type=int, default=32, help="model size per worker")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--alternations", type=int, default=5,
                        help="alternating raw / push_pull runs for the target line")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    counts = [1, 2, 4] if args.quick else [1, 2, 3, 4]
    rounds = 3 if args.quick else args.rounds
    started = time.perf_counter()
    load_before = os.getloadavg()
    sections = []
    for url in ("tcp://127.0.0.1:0", "ucx://127.0.0.1:0"):
        scheme = url.split(":")[0]
        lines = [
            f"### {scheme}://",
            "",
            "| workers | shards | raw one way | raw echo | push per worker | push aggregate | "
            "pull per worker | pull aggregate | push_pull per worker | push_pull aggregate | "
            "push_pull aggregate / raw echo | ring allreduce per worker |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        single = []
        for workers in counts:
            ring = run_allreduce(url, workers, args.megabytes, rounds) if workers > 1 else None
            for shards in counts:
                # The raw transport just before each configuration: this
                # shared host's load changes within a run.
                raw = run_raw(url, args.megabytes, max(rounds, 5))
                row = run_ps(url, workers, shards, args.megabytes, rounds)
                pp = row["push_pull"]
                ratio = pp[1] / raw["echo"]
                if workers == 1:
                    single.append(ratio)
                print(f"{scheme} W={workers} S={shards}: raw echo {raw['echo']:.2f}, push "
                      f"{row['push'][0]:.2f}, pull {row['pull'][0]:.2f}, push_pull {pp[0]:.2f} "
                      "GB/s per worker", flush=True)
                lines.append(
                    f"| {workers} | {shards} | {raw['oneway']:.2f} | {raw['echo']:.2f} | "
                    f"{row['push'][0]:.2f} | {row['push'][1]:.2f} | {row['pull'][0]:.2f} | "
                    f"{row['pull'][1]:.2f} | {pp[0]:.2f} | {pp[1]:.2f} | {ratio:.0%} | "
                    f"{'—' if ring is None else f'{ring:.2f}'} |")
        lines += ["", f"One worker, push_pull over the raw echo: median "
                  f"{statistics.median(single):.0%} (from {min(single):.0%} to "
                  f"{max(single):.0%}) over 1-{counts[-1]} shards; target 80%."]
        sections.append("\n".join(lines))
    target = ["## Target: one worker, one shard, alternating runs", "",
              f"{args.alternations} runs of the raw echo and of push_pull (one worker, one "
              "shard), alternating so both see the same load; each run's figure is the "
              "median of its rounds.", "",
              "| transport | raw echo, median of runs | push_pull, median of runs | ratio | "
              "raw echo, best run | push_pull, best run | ratio |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for url in ("tcp://127.0.0.1:0", "ucx://127.0.0.1:0"):
        raws, pps = [], []
        for _ in range(args.alternations):
            raws.append(run_raw(url, args.megabytes, max(rounds, 5))["echo"])
            pps.append(run_ps(url, 1, 1, args.megabytes, rounds)["push_pull"][0])
        mid_raw, mid_pp = statistics.median(raws), statistics.median(pps)
        print(f"{url}: raw echo {raws}, push_pull {pps}", flush=True)
        target.append(f"| {url.split(':')[0]}:// | {mid_raw:.2f} | {mid_pp:.2f} | "
                      f"{mid_pp / mid_raw:.0%} | {max(raws):.2f} | {max(pps):.2f} | "
                      f"{max(pps) / max(raws):.0%} |")
    demo_seconds, demo_line = demo_time()
    elapsed = time.perf_counter() - started
    load_after = os.getloadavg()
    import tensorwire

    command = "python bench/ps.py" + (" --quick" if args.quick else "")
    text = "\n".join([
        "# Parameter-server benchmark",
        "",
        f"Command: `{command}` (took {elapsed:.0f} s)",
        "",
        f"- CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"loopback only; {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}; NumPy {np.__version__}; "
        f"tensorwire {tensorwire.__version__}",
        f"- Load average before {load_before[0]:.2f}, after {load_after[0]:.2f}. Every "
        "process shares the same 2 cores: with 4 workers and 4 shards, 8 processes take "
        "turns, so the larger rows measure CPU contention more than the wire.",
        f"- Model per worker: {args.megabytes} MiB of float32 in 4 MiB tensors (one chunk "
        f"each), synchronous mode, SGD on the shards; per worker the median of {rounds} "
        "timed calls per phase after one warm-up push_pull. 1 GB = 1e9 bytes.",
        "- Raw: the transport alone between two processes (`tensorwire.transports`, no "
        "RPC), measured just before each row with the same frames: one way (sent, a tiny "
        "acknowledgement back) and echo (sent and returned, both directions), median of "
        "the rounds.",
        "- push_pull counts both directions. The last column divides the aggregate "
        "push_pull throughput (all workers' bytes over the phase's wall time; with one "
        "worker, that worker's) by the raw echo of one connection. With several workers "
        "there are several connections, which together can beat one.",
        "- Ring allreduce: the same model as one float32 bucket, allreduced by as many "
        "processes as there are workers (tensorwire.collective over the same transport, no "
        "shards), counted as push_pull counts: 2 x model bytes per call per worker; "
        "median of the rounds.",
        "",
        "\n\n".join(sections),
        "",
        *target,
        "",
        "## Placement on ResNet-50 (161 tensors, 102 MB, 4 MiB chunks)",
        "",
        "| shards k | imbalance (max / mean) | after adding a shard | bytes moved "
        "(fraction) | 1/(k+1) |",
        "|---:|---:|---:|---:|---:|",
        *placement_rows(),
        "",
        "## Demo",
        "",
        f"`python examples/ps_train.py` (2 shards, 3 worker processes, 15 epochs): "
        f"{demo_seconds:.1f} s wall time including process start-up; it printed "
        f"\"{demo_line}\".",
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
