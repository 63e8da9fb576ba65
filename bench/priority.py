"""Priority scheduling: how soon the first layer's parameters are back.

One shard on an emulated host whose link is shaped to ``--rate`` each way
(``tensorwire.testing.netbed``, needs root), one synchronous worker on
another host with the same rate. The model has ``--layers`` tensors of
``--layer-kib`` each, one chunk and one message per layer. Each step hands
``push_pull_each`` the gradients in the order a backward pass makes them,
last layer first, and times how long until the *first* layer's parameters
are back (what the next forward pass needs to start) and until all are.

- FIFO (``PSConfig(priority=False)``): messages go in the order the
  gradients came, all at once.
- priority (the default): messages go in the order of ``init``'s dict (the
  forward order), at most ``window`` in flight per shard, the rest in a
  priority queue.

    sudo python bench/priority.py         # writes bench/results/priority.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "priority.md"
ROOT = Path(__file__).resolve().parents[1]
KiB = 1 << 10
MiB = 1 << 20


async def worker(address: str, layers: int, layer_kib: int, steps: int, priority: bool,
                 window: int) -> None:
    from tensorwire import ps

    rng = np.random.default_rng(0)
    params = {f"layer{i:03d}": rng.standard_normal(layer_kib * KiB // 4).astype(np.float32)
              for i in range(layers)}
    config = ps.PSConfig(chunk_bytes=layer_kib * KiB, message_bytes=layer_kib * KiB,
                         priority=priority, window=window, timeout=120)
    client = await ps.connect([address], worker=0, num_workers=1, optimizer=ps.SGD(lr=0.01),
                              config=config)
    first_name = next(iter(params))
    # The backward pass makes the last layer's gradient first.
    grads = {name: np.full_like(params[name], 1e-3) for name in reversed(params)}
    firsts, alls = [], []
    async with client:
        await client.init(params)
        for step in range(steps + 1):
            started = time.perf_counter()
            arrivals = client.push_pull_each(grads)
            await arrivals[first_name]
            first = time.perf_counter() - started
            await arrivals
            whole = time.perf_counter() - started
            if step:  # the first is a warm-up
                firsts.append(first)
                alls.append(whole)
    print(json.dumps({"first": firsts, "all": alls}), flush=True)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tensorwire.testing.netbed import Testbed

    bed = Testbed(2)
    bed.up()
    shard: asyncio.subprocess.Process | None = None
    try:
        for k in range(2):
            bed.shape(k, rate=args.rate)
        shard = await asyncio.create_subprocess_exec(
            *bed.command(0, [sys.executable, "-m", "tensorwire", "ps", "serve", "--listen",
                             f"tcp://{bed.address(0)}:0"]),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        assert shard.stdout is not None
        while True:
            line = (await asyncio.wait_for(shard.stdout.readline(), 60)).decode()
            if not line:
                raise RuntimeError("the shard exited")
            if line.startswith("listening on "):
                address = line.split()[-1]
                break
        results: dict[str, Any] = {}
        started = time.monotonic()
        # Alternate the two modes so both see the same load.
        for _ in range(args.rounds):
            for mode in ("fifo", "priority"):
                run = await asyncio.create_subprocess_exec(
                    *bed.command(1, [sys.executable, __file__, "--worker", address,
                                     "--mode", mode, "--layers", str(args.layers),
                                     "--layer-kib", str(args.layer_kib),
                                     "--steps", str(args.steps), "--window", str(args.window)]),
                    cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
                out, err = await asyncio.wait_for(run.communicate(), 600)
                if run.returncode != 0:
                    raise RuntimeError(err.decode()[-3000:])
                got = json.loads(out.decode().strip().splitlines()[-1])
                entry = results.setdefault(mode, {"first": [], "all": []})
                entry["first"] += got["first"]
                entry["all"] += got["all"]
        results["wall"] = time.monotonic() - started
        return results
    finally:
        if shard is not None and shard.returncode is None:
            shard.kill()
            await shard.wait()
        bed.down()


def write(args: argparse.Namespace, results: dict[str, Any], load: tuple[float, float]) -> str:
    model = args.layers * args.layer_kib * KiB
    rows = []
    for mode, label in (("fifo", "FIFO (gradient order, all at once)"),
                        ("priority", f"priority (forward order, window {args.window})")):
        first = statistics.median(results[mode]["first"])
        whole = statistics.median(results[mode]["all"])
        rows.append((label, first, whole))
    gain = rows[0][1] / rows[1][1]
    lines = [
        "# Priority scheduling of parameter-server messages",
        "",
        f"Command: `sudo python bench/priority.py` (took {results['wall']:.0f} s)",
        "",
        f"- CPU: {platform.machine()}, {os.cpu_count()} cores; Linux {platform.release()}; "
        f"load average before {load[0]:.2f}, after {load[1]:.2f}.",
        "- Test bed: `tensorwire.testing.netbed`; the shard's host and the worker's host each "
        f"have a {args.rate} link each way (tc tbf); tcp://; one shard, one synchronous worker.",
        f"- Model: {args.layers} layers of {args.layer_kib} KiB float32 "
        f"({model / MiB:.0f} MiB), one chunk and one message per layer "
        "(`chunk_bytes = message_bytes`), SGD on the shard.",
        "- Each step: `push_pull_each(grads)` with the gradients in backward order (last "
        "layer first); timed until the first layer's parameters are back "
        "(`await arrivals[first]`) and until every layer is. "
        f"Median of {len(results['fifo']['first'])} steps per mode "
        f"({args.rounds} runs of {args.steps} steps after a warm-up, modes alternating).",
        "",
        "| order | first layer back | whole step |",
        "|---|---:|---:|",
        *(f"| {label} | {first * 1e3:.0f} ms | {whole * 1e3:.0f} ms |"
          for label, first, whole in rows),
        "",
        f"The first layer's parameters are back {gain:.0f}x sooner with priorities: the next "
        "forward pass can start while the other layers are still on the wire. The whole "
        "step takes about as long either way (the same bytes cross the same link).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=["fifo", "priority"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--layer-kib", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.worker, args.layers, args.layer_kib, args.steps,
                           args.mode == "priority", args.window))
        return
    load = os.getloadavg()[0]
    results = asyncio.run(bench(args))
    text = write(args, results, (load, os.getloadavg()[0]))
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
