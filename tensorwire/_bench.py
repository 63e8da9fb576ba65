"""``tensorwire bench``: size sweeps in the style of the OSU micro-benchmarks.

``p2p`` times the transport alone (a message echoed by the peer), ``rpc`` a
unary call that echoes a tensor, ``allreduce`` the collective over N ranks
(busbw as nccl-tests defines it), ``ps`` a parameter-server push_pull. By
default the peers are processes started here, on loopback. ``--connect URL``
measures against a peer that ``tensorwire bench p2p --serve --listen URL``
(or ``rpc``, or ``tensorwire ps serve``) runs on another host, and
``allreduce`` under a launcher's environment (torchrun, srun) measures the
ranks it was started as.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from .errors import ConfigError

__all__ = ("Progress", "Row", "check_plot", "format_csv", "format_json", "format_table",
           "parse_sizes", "plot", "sweep_allreduce", "sweep_p2p", "sweep_ps", "sweep_rpc")

DEFAULT_SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One size's figures."""

    size: int
    latency_us: float
    bandwidth_gbs: float
    busbw_gbs: float | None = None


def parse_sizes(text: str) -> list[int]:
    """``"8,1K,4MiB"`` -> byte counts.

    Raises:
        ValueError: a size that is not a number with an optional unit.
    """
    sizes = []
    for part in text.split(","):
        token = part.strip().upper()
        number = token.rstrip("KMGIB")
        unit = token[len(number):]
        if not number.isdigit() or unit not in _UNITS:
            raise ValueError(f"bad size {part!r}: use e.g. 8, 64K, 4M, 1G")
        sizes.append(int(number) * _UNITS[unit])
    return sizes


def repetitions(size: int) -> int:
    """Enough round trips for ~0.2 s at 1 GB/s, between 5 and 2,000."""
    return int(max(5, min(2000, 2e8 // max(size, 1))))


class Progress:
    """A labelled progress bar with rate and time left (tqdm) on a terminal;
    nothing at all when ``stream`` is not one, or when not ``shown``."""

    def __init__(self, total: int, label: str, *, stream: TextIO | None = None,
                 shown: bool = True) -> None:
        from tqdm import tqdm

        stream = stream or sys.stderr
        # leave=False: the bar gives its line back to the table that follows.
        self._bar = tqdm(total=total, desc=label, unit="size", file=stream, leave=False,
                         disable=not (shown and stream.isatty()), dynamic_ncols=True)

    def step(self, label: str) -> None:
        """One size done; ``label`` names it."""
        self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


async def _time_round_trips(call: Callable[[], Awaitable[Any]], size: int) -> float:
    """Median seconds per round trip over a few batches, after a warm-up."""
    await call()
    reps = repetitions(size)
    batch = max(1, reps // 5)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(batch):
            await call()
        samples.append((time.perf_counter() - start) / batch)
    return statistics.median(samples)


def _row(size: int, round_trip: float) -> Row:
    # One-way latency is half the round trip (OSU's osu_latency); the echo
    # moves the bytes both ways.
    return Row(size, round_trip / 2 * 1e6, 2 * size / round_trip / 1e9)


async def sweep_p2p(address: str, sizes: Sequence[int], progress: Progress) -> list[Row]:
    """Echo messages of each size through a transport peer at ``address``."""
    from .transports import connect

    rows = []
    conn = await connect(address)
    try:
        for size in sizes:
            payload = np.ones(size, np.uint8)
            buffer = np.empty(size, np.uint8)

            def into(info: Any, buffer: Any = buffer) -> Any:
                return buffer

            async def echo(payload: Any = payload, into: Any = into) -> None:
                await conn.send([payload])
                await conn.recv(allocator=into)

            rows.append(_row(size, await _time_round_trips(echo, size)))
            progress.step(_human(size))
    finally:
        await conn.close()
    return rows


async def sweep_rpc(address: str, sizes: Sequence[int], progress: Progress) -> list[Row]:
    """Call ``Bench.echo`` with a tensor of each size."""
    from .rpc import connect

    rows = []
    async with connect(address, timeout=120) as client:
        for size in sizes:
            payload = np.ones(size, np.uint8)

            async def echo(payload: Any = payload) -> None:
                await client.call("tensorwire.Bench.echo", payload)

            rows.append(_row(size, await _time_round_trips(echo, size)))
            progress.step(_human(size))
    return rows


async def sweep_ps(addresses: Sequence[str], sizes: Sequence[int],
                   progress: Progress) -> list[Row]:
    """``push_pull`` of one float32 tensor of each size through the shards at
    ``addresses`` (one worker, synchronous, SGD with a zero learning rate)."""
    from . import ps

    rows = []
    for size in sizes:
        client = await ps.connect(addresses, worker=0, num_workers=1, optimizer=ps.SGD(lr=0.0))
        try:
            name = f"tensorwire.bench.{size}"
            tensor = np.zeros(max(size // 4, 1), np.float32)
            await client.init({name: tensor})
            grads = {name: np.ones_like(tensor)}

            async def step(grads: Any = grads, client: Any = client) -> None:
                await client.push_pull(grads)

            seconds = await _time_round_trips(step, size)
        finally:
            await client.close()
        # Like the echo: the push sends the bytes and the pull brings them back.
        rows.append(Row(tensor.nbytes, seconds * 1e6, 2 * tensor.nbytes / seconds / 1e9))
        progress.step(_human(size))
    return rows


async def serve_p2p(listen: str, ready: Callable[[str], None]) -> None:
    """Echo every message back until cancelled."""
    from .errors import ConnectionClosedError
    from .transports import Connection
    from .transports import listen as transport_listen

    async def echo(conn: Connection) -> None:
        with contextlib.suppress(ConnectionClosedError):
            while True:
                await conn.send(await conn.recv())

    listener = await transport_listen(listen, echo)
    ready(listener.address)
    try:
        await asyncio.Event().wait()
    finally:
        await listener.close()


async def serve_rpc(listen: str, ready: Callable[[str], None]) -> None:
    """Host the ``tensorwire.Bench`` echo service until cancelled."""
    from . import rpc

    class Bench(rpc.Service):
        service_name = "tensorwire.Bench"

        @rpc.method
        async def echo(self, value: Any) -> Any:
            return value

    server = rpc.Server([Bench()])
    (address,) = await server.start(listen)
    ready(address)
    try:
        await asyncio.Event().wait()
    finally:
        await server.close(grace=0)


async def sweep_allreduce(group: Any, sizes: Sequence[int], progress: Progress) -> list[Row]:
    """Allreduce float32 arrays of each size over ``group`` (every rank runs this)."""
    rows = []
    factor = 2 * (group.world_size - 1) / group.world_size if group.world_size > 1 else 0.0
    for size in sizes:
        # Zeros: a sum of ones in place doubles every round and overflows
        # float32 (a RuntimeWarning on every rank) long before the last one.
        x = np.zeros(max(size // 4, 1), np.float32)
        await group.barrier()
        def once(x: Any = x) -> Awaitable[Any]:
            return group.allreduce(x)  # type: ignore[no-any-return]

        seconds = await _time_round_trips(once, size)
        algbw = x.nbytes / seconds / 1e9
        rows.append(Row(x.nbytes, seconds * 1e6, algbw, algbw * factor))
        progress.step(_human(size))
    return rows


def _human(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def format_table(rows: Sequence[Row]) -> str:
    busbw = any(r.busbw_gbs is not None for r in rows)
    # A collective reports time per operation and algbw; p2p and rpc report
    # one-way latency and the bandwidth of the echo.
    first, second = ("time (µs)", "algbw (GB/s)") if busbw else ("latency (µs)",
                                                                 "bandwidth (GB/s)")
    header = f"{'size':>10}  {first:>14}  {second:>16}"
    if busbw:
        header += f"  {'busbw (GB/s)':>12}"
    lines = [header]
    for r in rows:
        line = f"{_human(r.size):>10}  {r.latency_us:>14,.1f}  {r.bandwidth_gbs:>16.3f}"
        if busbw:
            line += f"  {r.busbw_gbs or 0.0:>12.3f}"
        lines.append(line)
    return "\n".join(lines)


def format_json(series: Mapping[str, Sequence[Row]]) -> str:
    """Every transport's rows as one JSON list; each row names its transport."""
    return json.dumps([{"transport": name, **dataclasses.asdict(r)}
                       for name, rows in series.items() for r in rows], indent=2)


def format_csv(series: Mapping[str, Sequence[Row]]) -> str:
    """Every transport's rows as one CSV table with a ``transport`` column."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["transport", *(f.name for f in dataclasses.fields(Row))])
    for name, rows in series.items():
        for r in rows:
            writer.writerow([name, *dataclasses.astuple(r)])
    return out.getvalue()


def check_plot(path: str) -> None:
    """Fail before a sweep, not after it, when ``plot(..., path)`` could not write.

    Raises:
        ConfigError: matplotlib is not installed, or the folder is missing.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'tensorwire[plot]'") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigError(f"--plot {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"--plot {path}: the folder {folder} is not writable")


def plot(series: Mapping[str, Sequence[Row]], path: str) -> None:
    """Bandwidth and latency against message size, log axes, one line per series.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (bandwidth, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for name, rows in series.items():
        sizes = [r.size for r in rows]
        bandwidth.plot(sizes, [r.bandwidth_gbs for r in rows], marker="o", label=name)
        latency.plot(sizes, [r.latency_us for r in rows], marker="o", label=name)
    for axis, label in ((bandwidth, "bandwidth (GB/s)"), (latency, "latency (µs)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
