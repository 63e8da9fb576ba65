"""Hierarchical vs flat-ring allreduce across emulated hosts with 1 Gbit/s links.

Two hosts of the test bed (tensorwire/testing/netbed.py, one network
namespace each, links shaped with a token bucket), two ranks on each; ranks
on one host talk over its loopback. For each placement of the ranks
(contiguous, as torchrun and srun place them, and round robin) and each
size, every rank allreduces a float32 array with ``algorithm="ring"`` and
with ``algorithm="hierarchical"``; the benchmark reads each host's link
counters around the timed operations, so the bytes that crossed between the
hosts are measured, not computed. With contiguous ranks it then measures
bucketed allreduces with priorities (``Group.allreduce_many``): how soon
the first layer's gradient is back, against FIFO order.

    sudo python bench/topology.py            # writes bench/results/topology.md
    sudo python bench/topology.py --quick    # fewer sizes

Needs root and iproute2 (network namespaces).
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
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "topology.md"
MiB = 1 << 20
SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [1 * MiB, 16 * MiB]
HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST
RATE = "1gbit"
PLACEMENTS = {
    "contiguous": [[0, 1], [2, 3]],
    "round robin": [[0, 2], [1, 3]],
}
ALGORITHMS = ("ring", "hierarchical")
#: The priority experiment's model: LAYERS gradients of LAYER_BYTES, in
#: buckets of BUCKET_BYTES.
LAYERS, LAYER_BYTES, BUCKET_BYTES = 32, 2 * MiB, 4 * MiB
PRIORITY_REPEATS = 3


def iterations(size: int) -> int:
    """Timed operations per case: a few, fewer at the large sizes (~3 s of
    1 Gbit/s link at 256 MiB each)."""
    return 10 if size <= 4 * MiB else 4 if size <= 16 * MiB else 2


# -- the ranks -----------------------------------------------------------------


async def rank_main(rank: int, master: str, listen: str, sizes: list[int],
                    priority: bool) -> None:
    from tensorwire.collective import Group, GroupConfig

    config = GroupConfig(timeout=600, rendezvous_timeout=120)
    group = await Group.create(rank=rank, world_size=WORLD, master=master, listen=listen,
                               host_master=False, config=config)
    loop = asyncio.get_running_loop()
    try:
        print(json.dumps({"rank": rank, "topology": group.topology}), flush=True)
        for size in sizes:
            x = np.ones(size // 4, np.float32)
            for algorithm in ALGORITHMS:
                case = f"{algorithm} {size}"
                # Nothing moves between the driver's reading of the link
                # counters and its word to start the next case.
                await loop.run_in_executor(None, sys.stdin.readline)
                await group.allreduce(x, algorithm=algorithm)  # type: ignore[arg-type]
                await group.barrier()
                print(json.dumps({"rank": rank, "ready": case}), flush=True)
                await loop.run_in_executor(None, sys.stdin.readline)
                await group.barrier()
                count = iterations(size)
                start = time.perf_counter()
                for _ in range(count):
                    await group.allreduce(x, algorithm=algorithm)  # type: ignore[arg-type]
                seconds = (time.perf_counter() - start) / count
                await group.barrier()
                x[:] = 1  # keep the values finite
                print(json.dumps({"rank": rank, "done": case, "seconds": seconds}), flush=True)
        if priority:
            await priority_main(group)
    finally:
        await group.close()


async def priority_main(group: Any) -> None:
    """Gradients listed as a backward pass yields them (last layer first),
    allreduced in buckets in list order (FIFO) or in the order the next
    forward pass needs them (priority): how long until layer 0 is back?"""
    # grads[k] is layer LAYERS - 1 - k.
    grads = [np.ones(LAYER_BYTES // 4, np.float32) for _ in range(LAYERS)]
    forward = [LAYERS - 1 - k for k in range(LAYERS)]
    for mode in ("fifo", "priority"):
        firsts, totals = [], []
        for _ in range(PRIORITY_REPEATS):
            await group.barrier()
            start = time.perf_counter()
            futures = group.allreduce_many(grads, priorities=forward if mode == "priority"
                                           else None, bucket_bytes=BUCKET_BYTES)
            await futures[LAYERS - 1]
            firsts.append(time.perf_counter() - start)
            await asyncio.gather(*futures)
            totals.append(time.perf_counter() - start)
            for g in grads:
                g[:] = 1
        print(json.dumps({"rank": group.rank, "priority": mode, "first": statistics.median(firsts),
                          "total": statistics.median(totals)}), flush=True)


async def rendezvous_main(host: str) -> None:
    from tensorwire.collective import GroupConfig, serve_rendezvous

    server, address = await serve_rendezvous(f"tcp://{host}:0", WORLD,
                                             config=GroupConfig(rendezvous_timeout=120))
    print(address, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.close(grace=0)


# -- the driver ------------------------------------------------------------------


class Ranks:
    """The rank processes of one placement and what they print."""

    def __init__(self, children: list[asyncio.subprocess.Process]) -> None:
        self.children = children
        self.reports: list[dict[str, Any]] = []
        self.readers = [asyncio.ensure_future(self._read(c)) for c in children]

    async def _read(self, child: asyncio.subprocess.Process) -> None:
        assert child.stdout is not None
        async for raw in child.stdout:
            text = raw.decode().strip()
            if text.startswith("{"):
                self.reports.append(json.loads(text))

    async def wait(self, key: str, value: str, timeout: float) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            got = [r for r in self.reports if r.get(key) == value]
            if len(got) == WORLD:
                return got
            if loop.time() > deadline or any(c.returncode not in (None, 0)
                                             for c in self.children):
                errors = [(await c.stderr.read()).decode()[-2000:]  # type: ignore[union-attr]
                          for c in self.children if c.returncode not in (None, 0)]
                raise RuntimeError(f"ranks did not report {key}={value}: {errors}")
            await asyncio.sleep(0.02)

    async def go(self) -> None:
        for child in self.children:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            await child.stdin.drain()


async def run_placement(bed: Any, hosts: list[list[int]], sizes: list[int],
                        priority: bool) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (algorithm, size): seconds per allreduce and bytes each host sent per allreduce."""
    def spawn(k: int, *argv: str) -> Any:
        return asyncio.create_subprocess_exec(
            *bed.command(k, [sys.executable, __file__, *argv]), cwd=ROOT,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)

    rendezvous = await spawn(0, "--rendezvous", bed.address(0))
    children: list[asyncio.subprocess.Process] = []
    try:
        assert rendezvous.stdout is not None
        master = (await asyncio.wait_for(rendezvous.stdout.readline(), 60)).decode().strip()
        host_of = {rank: k for k, ranks in enumerate(hosts) for rank in ranks}
        for rank in range(WORLD):
            k = host_of[rank]
            children.append(await spawn(k, "--rank", str(rank), "--master", master,
                                        "--listen", f"tcp://{bed.address(k)}:0",
                                        "--sizes", json.dumps(sizes),
                                        *(["--priority"] if priority else [])))
        ranks = Ranks(children)
        out: dict[tuple[str, int], dict[str, Any]] = {}
        for size in sizes:
            for algorithm in ALGORITHMS:
                case = f"{algorithm} {size}"
                await ranks.go()
                await ranks.wait("ready", case, 300)
                before = [bed.link_bytes(k) for k in range(HOSTS)]
                await ranks.go()
                done = await ranks.wait("done", case, 300)
                after = [bed.link_bytes(k) for k in range(HOSTS)]
                count = iterations(size)
                sent = [(a[0] - b[0]) / count for a, b in zip(after, before, strict=True)]
                out[algorithm, size] = {"seconds": max(r["seconds"] for r in done),
                                        "sent": sent}
                print(f"  {case}: {out[algorithm, size]['seconds'] * 1e3:.1f} ms, "
                      f"{[round(s / size, 3) for s in sent]} x payload per host", flush=True)
        if priority:
            for mode in ("fifo", "priority"):
                done = await ranks.wait("priority", mode, 300)
                out[mode, 0] = {"first": max(r["first"] for r in done),
                                "total": max(r["total"] for r in done)}
                print(f"  {mode}: first layer after {out[mode, 0]['first'] * 1e3:.0f} ms, "
                      f"all after {out[mode, 0]['total'] * 1e3:.0f} ms", flush=True)
        topology = next(r["topology"] for r in ranks.reports if "topology" in r)
        out["topology", 0] = {"topology": topology}
        await asyncio.wait_for(asyncio.gather(*(c.wait() for c in children)), 120)
        return out
    finally:
        for child in (*children, rendezvous):
            if child.returncode is None:
                child.kill()
                await child.wait()


def theory(placement: list[list[int]], algorithm: str) -> float:
    """Payloads each host sends over its link per allreduce, by the schedules."""
    n = WORLD
    if algorithm == "hierarchical":
        return 2 * (HOSTS - 1) / HOSTS
    host_of = {rank: k for k, ranks in enumerate(placement) for rank in ranks}
    crossings = sum(host_of[r] != host_of[(r + 1) % n] for r in range(n))
    # Each ring hop carries 2 (n - 1) / n payloads; the crossings share the hosts.
    return crossings * 2 * (n - 1) / n / HOSTS


def span(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def fmt_size(size: int) -> str:
    return f"{size // MiB} MiB"


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write(path: Path, quick: bool, sizes: list[int],
          results: dict[str, dict[tuple[str, int], dict[str, Any]]], took: float,
          load: tuple[tuple[float, ...], tuple[float, ...]]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    before, after = load
    factor = 2 * (WORLD - 1) / WORLD
    lines = [
        "# Hierarchical allreduce across hosts",
        "",
        f"Command: `sudo python bench/topology.py{' --quick' if quick else ''}` "
        f"(took {took:.0f} s)",
        "",
        f"- CPU: {cpu}, {os.cpu_count()} cores; Linux {platform.release()}; Python "
        f"{platform.python_version()}; NumPy {np.__version__}; tensorwire "
        f"{version('tensorwire')}; tree {commit}",
        f"- Load average (1/5/15 min) before the run {before[0]:.2f}/{before[1]:.2f}/"
        f"{before[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}.",
        f"- Test bed: {HOSTS} emulated hosts (network namespaces on one switch), each "
        f"link shaped to {RATE} each way (tc tbf); {PER_HOST} ranks per host, which talk "
        "over the host's loopback (tcp://). float32 sum allreduce in place, "
        "`algorithm=\"ring\"` (the flat ring over all 4 ranks) vs "
        "`algorithm=\"hierarchical\"` (chain reduce to each host's leader, ring among the "
        "leaders, chain broadcast inside each host).",
        "- **All 4 ranks share the machine's 2 cores**: the reductions, the loopback "
        "copies inside a host and the shaped links' traffic all compete for them, so "
        "the times are noisy and the intra-host phases cost more than on a real host.",
        "- time: seconds per allreduce (the slowest rank's mean over "
        "the timed operations: 10 up to 4 MiB, 4 at 16 MiB, 2 above, after one "
        "warm-up); busbw = size / time * 2(n-1)/n (nccl-tests' definition, n = 4); "
        "1 GB/s = 1e9 bytes/s.",
        "- inter-host bytes: what each host's link sent per allreduce (mean of the "
        "hosts, from the namespaces' eth0 counters, so Ethernet/IP/TCP headers, "
        "heartbeats and the barriers count), in payloads (bytes / size); *theory* is "
        "what the schedules send: the flat ring sends 2(n-1)/n payloads over each of its "
        "hops that cross between hosts, the leaders' ring 2(h-1)/h per host.",
        "",
    ]
    for name, placement in PLACEMENTS.items():
        table = results.get(name)
        if table is None:
            continue
        topology = table["topology", 0]["topology"]
        lines += [
            f"## Ranks placed {name}: "
            + ", ".join(f"{host} = ranks {ranks}" for host, ranks in topology.items()),
            "",
            "| size | ring time (ms) | ring busbw (GB/s) | hierarchical time (ms) "
            "| hierarchical busbw (GB/s) | time hier/ring | inter-host payloads ring "
            "(theory) | inter-host payloads hier (theory) | bytes hier/ring |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        flat_theory, hier_theory = theory(placement, "ring"), theory(placement, "hierarchical")
        for size in sizes:
            ring, hier = table["ring", size], table["hierarchical", size]
            ring_sent = sum(ring["sent"]) / HOSTS / size
            hier_sent = sum(hier["sent"]) / HOSTS / size
            lines.append(
                f"| {fmt_size(size)} | {ring['seconds'] * 1e3:,.1f} | "
                f"{size / ring['seconds'] * factor / 1e9:.3f} | {hier['seconds'] * 1e3:,.1f} | "
                f"{size / hier['seconds'] * factor / 1e9:.3f} | "
                f"{hier['seconds'] / ring['seconds']:.2f} | {ring_sent:.3f} ({flat_theory:.2f}) | "
                f"{hier_sent:.3f} ({hier_theory:.2f}) | {hier_sent / ring_sent:.2f} |")
        lines.append("")
    contiguous = results.get("contiguous", {})
    if ("fifo", 0) in contiguous:
        fifo, prio = contiguous["fifo", 0], contiguous["priority", 0]
        lines += [
            "## Priority: time until the first layer's gradient is back",
            "",
            f"Ranks placed contiguous, same links. A model of {LAYERS} layers with "
            f"{LAYER_BYTES // MiB} MiB of float32 gradient each ({LAYERS * LAYER_BYTES // MiB} "
            "MiB), listed as the backward pass produces them (last layer first), "
            f"allreduced with `group.allreduce_many(grads, bucket_bytes={BUCKET_BYTES // MiB} "
            "MiB)` (fused into buckets, hierarchical by the automatic choice): *FIFO* in list "
            "order (`priorities=None`), *priority* in the order the next forward pass needs "
            "them (`priorities=` layer index). Median of "
            f"{PRIORITY_REPEATS} runs, the slowest rank.",
            "",
            "| order | layer 0 back (ms) | all layers back (ms) |",
            "|---|---:|---:|",
            f"| FIFO | {fifo['first'] * 1e3:,.0f} | {fifo['total'] * 1e3:,.0f} |",
            f"| priority | {prio['first'] * 1e3:,.0f} | {prio['total'] * 1e3:,.0f} |",
            "",
            f"With priorities the first layer is back after "
            f"{prio['first'] / fifo['first']:.2f} of the FIFO time, so the next forward pass "
            "can start that much earlier; the whole step takes "
            f"{prio['total'] / fifo['total']:.2f} of the FIFO time (the same bytes move). "
            "Priorities order the buckets of one call (all ranks derive the same order from "
            "it); a bucket already on the wire is not preempted.",
            "",
        ]
    lines += reading(results, sizes)
    path.write_text("\n".join(lines) + "\n")


def reading(results: dict[str, dict[tuple[str, int], dict[str, Any]]],
            sizes: list[int]) -> list[str]:
    """What the tables say, against the issue's target."""
    out = ["## Reading", ""]
    for name, placement in PLACEMENTS.items():
        table = results.get(name)
        if table is None:
            continue
        byte_ratios = [sum(table["hierarchical", s]["sent"]) / sum(table["ring", s]["sent"])
                       for s in sizes]
        time_ratios = [table["hierarchical", s]["seconds"] / table["ring", s]["seconds"]
                       for s in sizes]
        predicted = theory(placement, "hierarchical") / theory(placement, "ring")
        out.append(
            f"- {name}: from {fmt_size(sizes[0])} to {fmt_size(sizes[-1])} the hierarchical "
            f"allreduce sends {span(byte_ratios)} of the flat ring's bytes between the hosts "
            f"(the schedules predict {predicted:.2f}) and takes {span(time_ratios)} of its "
            "time.")
    out += [
        "- The issue's target, inter-host bytes down to 1/ranks-per-host (here 1/2) of "
        "the flat ring, is met with ranks placed round robin (1/3) but cannot be with "
        "contiguous ranks: a flat ring over contiguous ranks crosses between the hosts "
        "only h times, carrying 2(n-1)/n = 1.5 payloads per host, while any allreduce "
        "between 2 hosts must move at least 2(h-1)/h = 1 payload over each host's link "
        "(each host needs the other's half reduced, and must hand over its own): 2/3 is "
        "the floor, and the hierarchy reaches it.",
        "- The time follows the bytes less closely where the flat ring is already "
        "good (contiguous): the intra-host phases (loopback copies and reductions) "
        "overlap the leaders' ring chunk by chunk, but four ranks on two cores make "
        "them compete with the ring for CPU.",
        "",
    ]
    return out


async def drive(args: argparse.Namespace) -> None:
    from tensorwire.testing.netbed import Testbed

    sizes = QUICK_SIZES if args.quick else SIZES
    started = time.time()
    load_before = os.getloadavg()
    results: dict[str, dict[tuple[str, int], dict[str, Any]]] = {}
    bed = Testbed(HOSTS)
    try:
        bed.up()
        for k in range(HOSTS):
            bed.shape(k, rate=RATE)
        for name, placement in PLACEMENTS.items():
            print(f"ranks placed {name}: {placement}", flush=True)
            results[name] = await run_placement(bed, placement, sizes,
                                                priority=name == "contiguous")
    finally:
        bed.down()
    write(args.output, args.quick, sizes, results, time.time() - started,
          (load_before, os.getloadavg()))
    print(f"wrote {args.output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--priority", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rendezvous:
        asyncio.run(rendezvous_main(args.rendezvous))
    elif args.rank is not None:
        asyncio.run(rank_main(args.rank, args.master, args.listen, json.loads(args.sizes),
                              args.priority))
    else:
        asyncio.run(drive(args))


if __name__ == "__main__":
    main()
