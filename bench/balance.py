"""Bandwidth-aware shard balancing on emulated hosts with one slow link.

Four shards, each on its own emulated host (``tensorwire.testing.netbed``,
network namespaces, needs root); three hosts' links are shaped to
``--fast`` each way, one to ``--slow``. A worker on a fifth, unshaped host
trains synchronously with ``push_pull`` on a model of ``--megabytes``
float32 (tensors of ``--tensor-kib``, one chunk each), placed evenly by
bytes. After ``--steps`` timed steps it asks the shards how many bytes they
served and how long they waited, turns that into each shard's effective
bandwidth, and rebalances (``PSClient.rebalance``), then times ``--steps``
more steps.

Reported: the step time before and after (median), the predicted-time
imbalance (largest shard's bytes / bandwidth over the mean) before and
after, the bytes moved, and the target: the step time if every link had
the measured average bandwidth, that is the step's bytes (both directions)
over the sum of the measured bandwidths.

    sudo python bench/balance.py          # writes bench/results/balance.md
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

RESULTS = Path(__file__).parent / "results" / "balance.md"
ROOT = Path(__file__).resolve().parents[1]
KiB = 1 << 10
MiB = 1 << 20


def model(megabytes: int, tensor_kib: int) -> dict[str, np.ndarray]:
    count = max(1, megabytes * MiB // (tensor_kib * KiB))
    rng = np.random.default_rng(0)
    return {f"layer{i:03d}": rng.standard_normal(tensor_kib * KiB // 4).astype(np.float32)
            for i in range(count)}


async def worker(addresses: list[str], megabytes: int, tensor_kib: int, steps: int) -> None:
    from tensorwire import ps

    params = model(megabytes, tensor_kib)
    config = ps.PSConfig(chunk_bytes=tensor_kib * KiB, timeout=120)
    client = await ps.connect(addresses, worker=0, num_workers=1,
                              optimizer=ps.SGD(lr=0.01), config=config)
    async with client:
        await client.init(params)
        grads = {k: np.full_like(v, 1e-3) for k, v in params.items()}
        for _ in range(2):
            await client.push_pull(grads)
        await client.bandwidth()  # start measuring here

        async def timed() -> list[float]:
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                await client.push_pull(grads)
                times.append(time.perf_counter() - started)
            return times

        before = await timed()
        report = await client.rebalance()
        loads_after = client.placement.loads()
        after = await timed()
        # The bandwidths again, measured over the balanced steps.
        measured_after = await client.bandwidth()
        print(json.dumps({"before": before, "after": after, "report": report,
                          "loads_after": loads_after, "bandwidth_after": measured_after,
                          "step_bytes": 2 * sum(v.nbytes for v in params.values())}),
              flush=True)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    from tensorwire.testing.netbed import Testbed

    bed = Testbed(5)
    bed.up()
    children: list[asyncio.subprocess.Process] = []
    try:
        rates = [args.fast] * 3 + [args.slow]
        for k, rate in enumerate(rates):
            bed.shape(k, rate=rate)
        addresses = []
        for k in range(4):
            child = await asyncio.create_subprocess_exec(
                *bed.command(k, [sys.executable, "-m", "tensorwire", "ps", "serve", "--listen",
                                 f"tcp://{bed.address(k)}:0"]),
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
            children.append(child)
            assert child.stdout is not None
            while True:
                line = (await asyncio.wait_for(child.stdout.readline(), 60)).decode()
                if not line:
                    raise RuntimeError("a shard exited")
                if line.startswith("listening on "):
                    addresses.append(line.split()[-1])
                    break
        before_bytes = [sum(bed.link_bytes(k)) for k in range(4)]
        started = time.monotonic()
        run = await asyncio.create_subprocess_exec(
            *bed.command(4, [sys.executable, __file__, "--worker", ",".join(addresses),
                             "--megabytes", str(args.megabytes),
                             "--tensor-kib", str(args.tensor_kib),
                             "--steps", str(args.steps)]),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(run.communicate(), 600)
        if run.returncode != 0:
            raise RuntimeError(err.decode()[-3000:])
        result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
        result["wall"] = time.monotonic() - started
        result["link_bytes"] = [sum(bed.link_bytes(k)) - b for k, b in enumerate(before_bytes)]
        result["rates"] = rates
        return result
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
            await child.wait()
        bed.down()


def write(args: argparse.Namespace, result: dict[str, Any], load: tuple[float, float]) -> str:
    report = result["report"]
    measured = [float(b) for b in report["bandwidth"]]
    step_bytes = result["step_bytes"]
    before, after = statistics.median(result["before"]), statistics.median(result["after"])
    ideal = step_bytes / sum(measured)
    after_bw = [b for b in result["bandwidth_after"] if b]
    ideal_after = step_bytes / sum(after_bw) if len(after_bw) == 4 else float("nan")
    predicted = report["predicted"]
    after_predicted = report.get("predicted_after") or predicted
    mean_before = sum(predicted) / len(predicted)
    mean_after = sum(after_predicted) / len(after_predicted)
    moved = report.get("bytes_moved", 0)
    model_bytes = step_bytes // 2
    lines = [
        "# Bandwidth-aware shard balancing",
        "",
        f"Command: `sudo python bench/balance.py` (took {result['wall']:.0f} s)",
        "",
        f"- CPU: {platform.machine()}, {os.cpu_count()} cores; Linux {platform.release()}; "
        f"load average before {load[0]:.2f}, after {load[1]:.2f}.",
        "- Test bed: `tensorwire.testing.netbed`, one network namespace per emulated host on "
        "one bridge; a token bucket (tc tbf) on both ends of a shaped host's link.",
        f"- Shards 0-2 on hosts with {args.fast} links each way, shard 3 behind {args.slow}; "
        "one synchronous worker on an unshaped fifth host; tcp://.",
        f"- Model: {model_bytes / MiB:.0f} MiB of float32 in {args.tensor_kib} KiB tensors "
        "(one chunk each), SGD on the shards, placed evenly by bytes (the default).",
        f"- Each step is one push_pull: {step_bytes / MiB:.0f} MiB (gradients up, parameters "
        f"down). Step times: median of {args.steps} steps before and after.",
        "- Bandwidth per shard: bytes the shard says it received and sent for the worker "
        "over the time the worker had calls to it in flight, less the time the shard says "
        "they waited for other workers (`PSClient.bandwidth`). 1 MB/s = 1e6 bytes/s.",
        "- Predicted time of a shard: the bytes it holds over its bandwidth, what the planner "
        "(`ps.balance`) evens out. A step moves those bytes twice (gradients up, then "
        "parameters down, one 8 MiB message per shard), so it takes about twice the "
        "largest predicted time.",
        "",
        "| shard | link | measured MB/s | MiB held before | MiB held after | predicted s before "
        "| predicted s after | MB/s measured after the move |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    loads_before = [p * b for p, b in zip(predicted, measured, strict=True)]
    for k in range(4):
        again = result["bandwidth_after"][k]
        lines.append(
            f"| {k} | {result['rates'][k]} | {measured[k] / 1e6:.1f} | "
            f"{loads_before[k] / MiB:.1f} | {result['loads_after'][k] / MiB:.1f} | "
            f"{predicted[k]:.3f} | {after_predicted[k]:.3f} | "
            f"{'—' if again is None else f'{again / 1e6:.1f}'} |")
    verdict = "met" if after <= 1.10 * ideal else "missed"
    lines += [
        "",
        "Predicted-time imbalance (largest / mean): "
        f"{max(predicted) / mean_before:.2f} before, "
        f"{max(after_predicted) / mean_after:.2f} after the move.",
        "",
        f"Bytes moved: {moved / MiB:.1f} MiB of state ({report.get('chunks_moved', 0)} chunks,"
        f" {report.get('parameter_bytes_moved', 0) / model_bytes:.0%} of the parameters; SGD "
        f"without momentum keeps no other state), in {report.get('seconds', 0):.2f} s.",
        "",
        "| | step time (median) |",
        "|---|---:|",
        f"| before rebalancing | {before:.3f} s |",
        f"| after rebalancing | {after:.3f} s |",
        f"| every link at the measured average bandwidth ({sum(measured) / 4 / 1e6:.1f} MB/s) "
        f"| {ideal:.3f} s |",
        "",
        f"Target: after rebalancing within 10% of the average-bandwidth time: "
        f"{after / ideal:.2f}x, {verdict}. Measured again over the balanced steps the links "
        f"add up to {sum(after_bw) / 1e6:.1f} MB/s (average-bandwidth time "
        f"{ideal_after:.3f} s, {after / ideal_after:.2f}x).",
        "",
        f"Bytes on the shard hosts' links during the run (both ways, MiB, from the "
        f"namespaces' counters): {', '.join(f'{b / MiB:.0f}' for b in result['link_bytes'])}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", metavar="ADDRESSES", help=argparse.SUPPRESS)
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--tensor-kib", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fast", default="400mbit")
    parser.add_argument("--slow", default="100mbit")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.worker.split(","), args.megabytes, args.tensor_kib, args.steps))
        return
    load = os.getloadavg()[0]
    result = asyncio.run(bench(args))
    text = write(args, result, (load, os.getloadavg()[0]))
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
