"""Gradient compression benchmark: where it pays and where it does not.

Three measurements, each bounded in count and time:

1. Codec throughput on this CPU: each compressor on one 4 MiB float32
   chunk (the default ``chunk_bytes``): compress, decompress, and what a
   worker pays per chunk with error feedback (compress, decompress the
   payload again to update the residual, subtract), in GB/s of float32 input.
2. The demo (``examples/ps_train.py``: 3 workers, 2 shards, digits MLP):
   gradient bytes per push_pull step, measured by a real client against an
   in-process shard on the demo's model and chunking, and the final test
   accuracy with each compressor, for two seeds.
3. Step time on the emulated multi-host test bed (``tensorwire.testing.netbed``,
   needs root): two shards on hosts 0 and 1, one worker on host 2 with a
   model of ``--megabytes`` float32; the median time of ``--steps`` push and
   push_pull calls per compressor, over links shaped to 1 Gbit/s, over the
   unshaped veth links, and with both shards on the worker's own host
   (loopback: the "local" link class); then one shard local and one remote
   behind 1 Gbit/s, with no compression, fp8/int8 on both links, and
   fp8/int8 on the remote link only (``{"remote": ...}``). Bytes on the
   worker's link (its ``eth0`` counters) per step come with it.

    python bench/compression.py            # writes bench/results/compression.md
    python bench/compression.py --quick    # fewer steps, one seed
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "compression.md"
ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
TENSOR = 4 * MiB
COMPRESSORS = ["none", "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "topk"]
# The demo's model: an MLP 64 -> 64 -> 10 in chunks of 2048 bytes.
DEMO_SHAPES = {"w0": (64, 64), "b0": (64,), "w1": (64, 10), "b1": (10,)}
DEMO_CHUNK_BYTES = 2048


# -- 1. codec throughput -----------------------------------------------------------


def codec_throughput(reps: int) -> list[dict[str, Any]]:
    from tensorwire import ps

    # decompress is the shard's side, not part of the public API.
    from tensorwire.ps._compress import decompress

    rng = np.random.default_rng(0)
    grad = rng.standard_normal(TENSOR // 4).astype(np.float32)
    # Heavy tails (Student's t, 2 degrees of freedom): a few entries far
    # larger than the rest, as gradients often have.
    heavy = rng.standard_t(2, TENSOR // 4).astype(np.float32)
    rows = []
    for name in COMPRESSORS:
        compressor = ps.compressor_for(name)
        payload = compressor.compress(grad)
        payload["codec"] = compressor.name
        sent = sum(v.nbytes for v in payload.values() if isinstance(v, np.ndarray))

        def best(fn: Any) -> float:
            # The fastest of the calls: on a shared machine the slower ones
            # measure the neighbours, not the codec.
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            return grad.nbytes / min(times) / 1e9

        feedback = ps.ErrorFeedback(compressor)
        feedback.compress("k", grad)  # the first call has no residual yet

        rows.append({
            "gauss_error": round_trip_error(compressor, grad, everything=True),
            "tail_error": round_trip_error(compressor, heavy, everything=True),
            "small_error": round_trip_error(compressor, heavy, everything=False),
            "name": name,
            "ratio": sent / grad.nbytes,
            "compress": best(lambda: compressor.compress(grad)),  # noqa: B023
            "decompress": best(lambda: decompress(payload, grad.size, grad.dtype)),  # noqa: B023
            "feedback": best(lambda: feedback.compress("k", grad)),  # noqa: B023
            "error_feedback": compressor.error_feedback,
        })
    return rows


def round_trip_error(compressor: Any, g: np.ndarray, *, everything: bool) -> float:
    """One round trip's RMS error over the RMS of the entries (no error feedback):
    of every entry, or only of those smaller in magnitude than the median."""
    from tensorwire.ps._compress import decompress

    payload = compressor.compress(g)
    payload["codec"] = compressor.name
    error = decompress(payload, g.size, g.dtype).astype(np.float64) - g
    kept = slice(None) if everything else np.abs(g) < np.median(np.abs(g))
    return float(np.sqrt(np.mean(error[kept] ** 2) / np.mean(g[kept].astype(np.float64) ** 2)))


# -- 2. the demo -------------------------------------------------------------------


def demo_bytes_per_step(name: str) -> int:
    """Gradient bytes one worker sends per push_pull, from the client's own count."""
    from tensorwire import ps

    async def main() -> int:
        shard = await ps.serve(f"inproc://bench-compression-{name}")
        try:
            client = await ps.connect(shard.addresses, worker=0, num_workers=1,
                                      optimizer=ps.SGD(lr=0.01), compression=name,
                                      config=ps.PSConfig(chunk_bytes=DEMO_CHUNK_BYTES))
            async with client:
                rng = np.random.default_rng(0)
                params = {k: rng.standard_normal(s).astype(np.float32)
                          for k, s in DEMO_SHAPES.items()}
                await client.init(params)
                for _ in range(3):
                    await client.push_pull({k: rng.standard_normal(s).astype(np.float32)
                                            for k, s in DEMO_SHAPES.items()})
                stats = client.metrics()["push_pull"]
                return int(stats["bytes_out"] // stats["calls"])
        finally:
            await shard.close()

    return asyncio.run(main())


def demo_accuracy(name: str, seed: int) -> tuple[float | None, float | None]:
    """The demo's final test accuracy and its last epoch's training loss."""
    try:
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "ps_train.py"), "--compression", name,
             "--seed", str(seed), "--min-accuracy", "0", "--time-limit", "90"],
            capture_output=True, text=True, timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, None
    found = re.search(r"final test accuracy ([0-9.]+)", out.stdout)
    losses = re.findall(r"loss ([0-9.]+)", out.stdout)
    return (float(found.group(1)) if found else None), (float(losses[-1]) if losses else None)


# -- 3. the test bed ---------------------------------------------------------------


def _link_counters() -> tuple[int, int]:
    """This host's eth0 bytes sent and received (``ip netns exec`` mounts its sysfs)."""
    base = Path("/sys/class/net/eth0/statistics")
    if not base.exists():
        return 0, 0
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def worker(addresses: list[str], megabytes: int, steps: int, label: str,
           specs: list[tuple[str, Any]]) -> None:
    """Inside host 2: time push and push_pull per compression; one JSON line each.

    Every compression has its own client and its own tensors, and the calls
    take turns (one call of each, then the next round), so a neighbour's
    burst of load falls on all of them alike.
    """
    import uvloop

    from tensorwire import ps

    count = max(1, megabytes * MiB // TENSOR)
    rng = np.random.default_rng(0)
    grads_base = [rng.standard_normal(TENSOR // 4).astype(np.float32) * 1e-3
                  for _ in range(count)]

    async def main() -> None:
        clients: dict[str, Any] = {}
        grads: dict[str, dict[str, np.ndarray]] = {}
        results: dict[str, dict[str, Any]] = {name: {"name": name} for name, _ in specs}
        try:
            for name, spec in specs:
                # Fresh tensor names per client: the shards keep every run's
                # chunks, and one client's clocks must not meet another's.
                names = [f"{label}.{name}.t{i}" for i in range(count)]
                client = await ps.connect(addresses, worker=0, num_workers=1,
                                          optimizer=ps.SGD(lr=0.01), compression=spec,
                                          config=ps.PSConfig(timeout=60))
                clients[name] = client
                await client.init({n: np.zeros(TENSOR // 4, np.float32) for n in names})
                grads[name] = dict(zip(names, grads_base, strict=True))
            for op in ("push", "push_pull"):
                times: dict[str, list[float]] = {name: [] for name in clients}
                link = {name: [0, 0] for name in clients}
                for name, client in clients.items():  # warm-up
                    await getattr(client, op)(grads[name])
                for _ in range(steps):
                    for name, client in clients.items():
                        before = _link_counters()
                        started = time.perf_counter()
                        await getattr(client, op)(grads[name])
                        times[name].append(time.perf_counter() - started)
                        after = _link_counters()
                        link[name][0] += after[0] - before[0]
                        link[name][1] += after[1] - before[1]
                for name in clients:
                    results[name][op] = {"median": statistics.median(times[name]),
                                         "min": min(times[name]),
                                         "tx": link[name][0] / steps,
                                         "rx": link[name][1] / steps}
        finally:
            for client in clients.values():
                await client.close()
        for name, _ in specs:
            print(json.dumps(results[name]), flush=True)

    uvloop.run(main())


def testbed_runs(megabytes: int, steps: int) -> tuple[list[tuple[str, list[dict[str, Any]]]],
                                                      str | None]:
    from tensorwire.testing.netbed import NamespaceUnavailable, Testbed

    bed = Testbed(3)
    try:
        bed.up()
    except NamespaceUnavailable as exc:
        bed.down()
        return [], str(exc)
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    shards: list[subprocess.Popen[str]] = []
    try:
        def start_shard(host: int, listen: str) -> str:
            child = subprocess.Popen(
                bed.command(host, [sys.executable, "-m", "tensorwire", "ps", "serve",
                                   "--listen", listen]),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, cwd=ROOT)
            shards.append(child)
            assert child.stdout is not None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                if line.startswith("listening on "):
                    return line.split()[-1]
            raise RuntimeError(f"shard on host {host} did not start")

        remote = [start_shard(0, f"tcp://{bed.address(0)}:0"),
                  start_shard(1, f"tcp://{bed.address(1)}:0")]
        local = [start_shard(2, "tcp://127.0.0.1:0"), start_shard(2, "tcp://127.0.0.1:0")]
        every = [(name, name) for name in COMPRESSORS]
        mixed = [("none", "none"), ("fp8 on both links", "fp8"),
                 ("int8 on both links", "int8"),
                 ('{"remote": "fp8"} (local: none)', {"remote": "fp8"}),
                 ('{"remote": "int8"} (local: none)', {"remote": "int8"})]
        plan: list[tuple[str, str | None, list[str], list[tuple[str, Any]]]] = [
            ("1 Gbit/s links, shards on hosts 0 and 1 (remote)", "1gbit", remote, every),
            ("unshaped veth links, shards on hosts 0 and 1 (remote, fast)", None, remote,
             every),
            ("shards on the worker's own host, loopback (local)", None, local, every),
            ("one shard on the worker's host (local), one on host 0 behind 1 Gbit/s "
             "(remote): compression per link class", "1gbit", [local[0], remote[0]], mixed),
        ]
        for index, (title, rate, addresses, specs) in enumerate(plan):
            for k in range(3):
                bed.shape(k, rate=rate)
            out = subprocess.run(
                bed.command(2, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                ",".join(addresses), "--megabytes", str(megabytes),
                                "--steps", str(steps), "--label", f"run{index}",
                                "--specs", json.dumps(specs)]),
                capture_output=True, text=True, timeout=300, cwd=ROOT)
            if out.returncode != 0:
                raise RuntimeError(f"worker failed: {out.stderr[-3000:]}")
            runs.append((title, [json.loads(line) for line in out.stdout.splitlines()
                                 if line.startswith("{")]))
            print(f"  {title}: done", flush=True)
    finally:
        for child in shards:
            child.terminate()
        for child in shards:
            try:
                child.wait(timeout=20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        bed.down()
    return runs, None


# -- the report ----------------------------------------------------------------------


def report(args: argparse.Namespace, codec: list[dict[str, Any]],
           demo: list[dict[str, Any]], runs: list[tuple[str, list[dict[str, Any]]]],
           skipped: str | None, took: float, load: tuple[float, float]) -> str:
    import tensorwire

    lines = [
        "# Gradient compression benchmark",
        "",
        f"Command: `python bench/compression.py{' --quick' if args.quick else ''}` "
        f"(took {took:.0f} s)",
        "",
        f"- CPU: {platform.machine()}, {os.cpu_count()} cores, shared with other work; "
        f"Linux {platform.release()}",
        f"- Python {platform.python_version()}; NumPy {np.__version__}; "
        f"tensorwire {tensorwire.__version__}",
        f"- Load average before {load[0]:.2f}, after {load[1]:.2f}. Timings on a shared "
        "2-core machine are noisy; read the ratios, not the third digit.",
        "- 1 GB = 1e9 bytes, 1 MiB = 2**20 bytes.",
        "",
        "## 1. Codec throughput (one 4 MiB float32 chunk)",
        "",
        f"Fastest of {args.reps} calls. GB/s of float32 input. \"worker pays\" is "
        "`ErrorFeedback.compress`, what `push` runs per chunk: for lossy codecs it "
        "adds the residual, compresses, decodes its own payload and keeps the new "
        "residual. For a codec to pay, the worker's cost must be below the time the "
        "saved bytes take on the wire: at 1 Gbit/s (0.125 GB/s) a codec that saves "
        "3/4 of the bytes pays from about 0.1 GB/s; on a 25 GB/s shared-memory copy "
        "none of these does.",
        "",
        "",
        "Error: one round trip without error feedback, RMS error over the RMS of the "
        "entries, on the normal chunk and on a heavy-tailed one (Student's t, 2 degrees "
        "of freedom: a few entries much larger than the rest), over all entries and over "
        "the smaller half. A per-chunk scale set by the largest entry leaves int8 few "
        "steps for the small ones; fp8 keeps their relative precision.",
        "",
        "| compressor | bytes sent / float32 bytes | compress | decompress (shard) | "
        "worker pays (with error feedback) | error, normal | error, heavy tails | "
        "error, heavy tails, smaller half |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in codec:
        errors = (f"{row['gauss_error']:.2g} | {row['tail_error']:.2g} | "
                  f"{row['small_error']:.2g}")
        if row["name"] == "none":
            lines.append(f"| none | 1.000 | — (no work) | — | — | {errors} |")
            continue
        feedback = f"{row['feedback']:.2f}" if row["error_feedback"] else \
            f"{row['feedback']:.2f} (no residual)"
        lines.append(f"| {row['name']} | {row['ratio']:.3f} | {row['compress']:.2f} | "
                     f"{row['decompress']:.2f} | {feedback} | {errors} |")
    lines += [
        "",
        "## 2. The demo: bytes per step and test accuracy",
        "",
        "`python examples/ps_train.py --compression NAME --seed S` (3 workers, 2 shards, "
        "synchronous, SGD with momentum, 15 epochs, chunks of 2048 bytes; 450 test "
        "images, so one image is 0.002 of accuracy). Bytes per step: the gradient bytes "
        "one worker sends per push_pull (the client's `metrics()`, arrays as sent), "
        "measured on the demo's model against an in-process shard. Parameters come back "
        f"uncompressed ({sum(int(np.prod(s)) for s in DEMO_SHAPES.values()) * 4} bytes "
        "per step). `topk` keeps 1% of each chunk's entries (5 of 512).",
        "",
        "| compressor | gradient bytes per step | vs none | "
        + " | ".join(f"seed {s}: test accuracy (last epoch's loss)" for s in args.seeds)
        + " |",
        "|---|---:|---:|" + "---:|" * len(args.seeds),
    ]
    base = next(r["bytes"] for r in demo if r["name"] == "none")
    for row in demo:
        cells = []
        for acc, loss in row["accuracy"]:
            cells.append("failed" if acc is None else
                         f"{acc:.3f} ({loss:.4f})" if loss is not None else f"{acc:.3f}")
        lines.append(f"| {row['name']} | {row['bytes']} | {row['bytes'] / base:.3f} | "
                     f"{' | '.join(cells)} |")
    lines += ["", "## 3. Step time on the emulated multi-host test bed", ""]
    if skipped is not None:
        lines += [f"Skipped: {skipped}.", ""]
    else:
        lines += [
            f"One worker on host 2 and two shards (SGD), a model of {args.megabytes} MiB "
            "float32 in 4 MiB tensors (one chunk each), `tensorwire.testing.netbed` with "
            "`shape(k, rate=\"1gbit\")` on every host's link or none. Each compression has "
            "its own client and tensors; the calls take turns, one of each per round, "
            f"{args.steps} rounds after one warm-up; median (and fastest) call. push sends "
            "gradients only; push_pull also brings the parameters back, uncompressed. "
            "`speed-up` is none's median over this one's. Link MiB: the worker host's "
            "eth0 counters per push_pull (sent / received, TCP/IP headers included; "
            "zero on loopback).",
            "",
            "Why push_pull gains less than push: links are full duplex and the "
            "parameters come back uncompressed, so once the gradients going out are "
            "smaller, the step waits for the parameters coming in (the model's bytes on "
            "the worker's receive side) and for the shards' update, which compression "
            "does not shorten.",
            "",
        ]
        for title, rows in runs:
            none = next((r for r in rows if r["name"] == "none"), None)
            lines += [
                f"### {title}",
                "",
                "| compression | push (s) | push speed-up | push_pull (s) | "
                "push_pull speed-up | link MiB sent / received per push_pull |",
                "|---|---:|---:|---:|---:|---:|",
            ]
            for row in rows:
                push, pp = row["push"], row["push_pull"]
                sp = none["push"]["median"] / push["median"] if none else float("nan")
                spp = none["push_pull"]["median"] / pp["median"] if none else float("nan")
                lines.append(
                    f"| {row['name']} | {push['median']:.3f} ({push['min']:.3f}) | {sp:.2f}x | "
                    f"{pp['median']:.3f} ({pp['min']:.3f}) | {spp:.2f}x | "
                    f"{pp['tx'] / MiB:.1f} / {pp['rx'] / MiB:.1f} |")
            lines.append("")
    lines += ["## Where compression paid (computed from the medians above)", "",
              *verdict(runs), ""]
    return "\n".join(lines)


def verdict(runs: list[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """Plain statements computed from the figures above: >10% faster or slower than none."""
    out = []
    for title, rows in runs:
        none = next((r for r in rows if r["name"] == "none"), None)
        if none is None:
            continue
        others = [r for r in rows if r is not none]
        for op in ("push", "push_pull"):
            base = none[op]["median"]
            paid = [r["name"] for r in others if r[op]["median"] < base * 0.9]
            lost = [r["name"] for r in others if r[op]["median"] > base * 1.1]
            even = [r["name"] for r in others if r["name"] not in paid + lost]
            out.append(f"- {title}, {op}: paid (>10% faster than none): "
                       f"{', '.join(paid) or '—'}; did not pay (>10% slower): "
                       f"{', '.join(lost) or '—'}; within 10%: {', '.join(even) or '—'}.")
        by = {r["name"]: r for r in rows}
        for codec in ("fp8", "int8"):
            both = by.get(f"{codec} on both links")
            remote = by.get(f'{{"remote": "{codec}"}} (local: none)')
            if both is None or remote is None:
                continue
            out.append(
                f"- Per link class, {codec}: compressing only the remote link vs both: push "
                f"{remote['push']['median']:.3f} s vs {both['push']['median']:.3f} s, "
                f"push_pull {remote['push_pull']['median']:.3f} s vs "
                f"{both['push_pull']['median']:.3f} s (none: {by['none']['push']['median']:.3f}"
                f" s / {by['none']['push_pull']['median']:.3f} s).")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="run", help=argparse.SUPPRESS)
    parser.add_argument("--specs", default="[]", help=argparse.SUPPRESS)
    parser.add_argument("--no-testbed", action="store_true", help="skip part 3")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker.split(","), args.megabytes, args.steps, args.label,
               [(name, spec) for name, spec in json.loads(args.specs)])
        return
    args.seeds = [0] if args.quick else [0, 1]
    if args.quick:
        args.steps, args.reps = 3, 3
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    print("codec throughput", flush=True)
    codec = codec_throughput(args.reps)
    print("demo", flush=True)
    demo = []
    for name in COMPRESSORS:
        accs = [demo_accuracy(name, seed) for seed in args.seeds]
        demo.append({"name": name, "bytes": demo_bytes_per_step(name), "accuracy": accs})
        print(f"  {name}: {accs}", flush=True)
    runs: list[tuple[str, list[dict[str, Any]]]] = []
    skipped: str | None = "not run (--no-testbed)"
    if not args.no_testbed:
        print("test bed", flush=True)
        runs, skipped = testbed_runs(args.megabytes, args.steps)
        if skipped is not None:
            skipped = f"cannot make network namespaces here ({skipped})"
    text = report(args, codec, demo, runs, skipped, time.perf_counter() - started,
                  (load_before, os.getloadavg()[0]))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
