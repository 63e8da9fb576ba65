"""Soak: minutes of parameter-server push_pull with tensors of mixed sizes.

Two shard processes and two worker processes on loopback; every few seconds
the resident memory and the open file descriptors of each process are
sampled. After a warm-up, neither may grow: a leak shows as a steady climb.

    python bench/soak.py                 # 3 minutes, writes bench/results/soak.md
    python bench/soak.py --minutes 1
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results" / "soak.md"
#: Mixed sizes: a big matrix, a mid-size one, a vector over 4 MiB (several
#: chunks), and small ones that share messages.
SHAPES = {"embed": (1024, 1024), "dense": (512, 256), "big": (1_200_000,),
          "bias": (256,), "scale": (7,)}
SAMPLE_EVERY = 5.0
WARMUP = 30.0


def shard_main() -> None:
    from tensorwire import ps

    async def main() -> None:
        server = await ps.serve("tcp://127.0.0.1:0")
        print(server.addresses[0], flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.close(checkpoint=False)

    asyncio.run(main())


def worker_main(rank: int, addresses: list[str], seconds: float) -> None:
    from tensorwire import ps

    async def main() -> None:
        client = await ps.connect(addresses, worker=rank, num_workers=2,
                                  optimizer=ps.SGD(lr=1e-3))
        rng = np.random.default_rng(rank)
        await client.init({k: np.zeros(s, np.float32) for k, s in SHAPES.items()})
        end = time.monotonic() + seconds
        steps = 0
        while time.monotonic() < end and steps < 1_000_000:
            grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
            await client.push_pull(grads)
            steps += 1
        print(steps, flush=True)
        await client.close()

    asyncio.run(main())


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--addresses", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.shard:
        shard_main()
        return
    if args.worker is not None:
        worker_main(args.worker, args.addresses, args.seconds)
        return

    seconds = args.minutes * 60
    me = [sys.executable, __file__]
    shards = [subprocess.Popen([*me, "--shard"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for _ in range(2)]
    addresses = [s.stdout.readline().strip() for s in shards]  # type: ignore[union-attr]
    workers = [subprocess.Popen([*me, "--worker", str(r), "--seconds", str(seconds),
                                 "--addresses", *addresses], stdout=subprocess.PIPE, text=True)
               for r in range(2)]
    names = ["shard 0", "shard 1", "worker 0", "worker 1"]
    procs = [*shards, *workers]
    samples: list[tuple[float, list[int], list[int]]] = []
    started = time.monotonic()
    while all(p.poll() is None for p in procs):
        samples.append((time.monotonic() - started, [rss(p.pid) for p in procs],
                        [fds(p.pid) for p in procs]))
        time.sleep(SAMPLE_EVERY)
    for worker in workers:
        worker.wait(120)
    steps = [int(w.stdout.read().strip() or 0) for w in workers]  # type: ignore[union-attr]
    for shard in shards:
        shard.stdin.close()  # type: ignore[union-attr]
        shard.wait(30)
    write(args, names, samples, steps, time.monotonic() - started,
          [w.returncode for w in workers])
    print(f"wrote {args.output}")


def write(args: argparse.Namespace, names: list[str],
          samples: list[tuple[float, list[int], list[int]]], steps: list[int], took: float,
          codes: list[int | None]) -> None:
    mib = 1 << 20
    nbytes = sum(int(np.prod(s)) * 4 for s in SHAPES.values())
    lines = [
        "# Soak: parameter-server push_pull",
        "",
        f"Command: `python bench/soak.py --minutes {args.minutes:g}` (took {took:.0f} s)",
        "",
        f"- {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"Python {platform.python_version()}; loopback tcp://",
        f"- 2 shards, 2 workers (sync, SGD), {len(SHAPES)} tensors of "
        f"{nbytes / mib:.1f} MiB in all per step: "
        + ", ".join(f"{k} {s}" for k, s in SHAPES.items()),
        f"- steps: {steps} (workers' exit codes {codes})",
        f"- resident memory (MiB) and open file descriptors, sampled every "
        f"{SAMPLE_EVERY:g} s",
        "",
        "| t (s) | " + " | ".join(f"{n} RSS | {n} fds" for n in names) + " |",
        "|---:|" + "---:|---:|" * len(names),
    ]
    for t, memory, files in samples:
        lines.append(f"| {t:.0f} | " + " | ".join(
            f"{m / mib:.1f} | {f}" for m, f in zip(memory, files, strict=True)) + " |")
    warm = [s for s in samples if s[0] >= WARMUP]
    lines += ["", "## Verdict", ""]
    if len(warm) < 4:
        lines.append(f"- too short: no samples after the {WARMUP:g} s warm-up")
    else:
        # RSS swings by a message buffer from one sample to the next; a leak
        # shows as a higher peak in the second half than in the first.
        half = len(warm) // 2
        early, late = warm[:half], warm[half:]
        for i, name in enumerate(names):
            early_peak = max(sample[1][i] for sample in early) / mib
            late_peak = max(sample[1][i] for sample in late) / mib
            fds_seen = sorted({sample[2][i] for sample in warm})
            ok = late_peak - early_peak < 4 and len(fds_seen) == 1
            lines.append(
                f"- {name}: peak RSS {early_peak:.1f} MiB in the first half after warm-up, "
                f"{late_peak:.1f} MiB in the second ({late_peak - early_peak:+.1f}); "
                f"open fds {fds_seen}: {'flat' if ok else '**grew**'}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
