"""Transport benchmark: one-way bandwidth, round-trip latency and large echoes, side by side.

Each variant runs as a server process and a client process (UCX reads its
settings once per process, so every variant gets fresh ones). One connection
per variant carries every size: the client announces ``(mode, size, count)``
and then runs it. Receivers reuse one buffer per size, as a training loop
reusing its gradient buffers would, for every variant alike; a bandwidth
run's first message, which faults that buffer in, is not timed. The large
echoes (64 MiB and more) of tcp:// and ucx:// receive into the default
allocator's buffers instead (the buffer pool, huge pages where the kernel
offers them), as an application does; the table header states the kernel's
huge page mode.

    python bench/transports.py            # writes bench/results/transports.md
    python bench/transports.py --quick    # fewer sizes and repetitions
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "transports.md"
CONTROL = struct.Struct("<4sQQ")  # mode, size, count
SIZES = [8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [8, 4 << 10, 1 << 20, 64 << 20]
#: Messages of at least this size are also echoed (mode "echo": the issue 22
#: target, tcp:// at least 90% of a bare blocking socket).
ECHO_MIN = 64 << 20
#: The modes in which the server sends each message back.
REPLIED = (b"lat ", b"echo")


def counts(size: int, budget: float, quick: bool) -> tuple[int, int]:
    """(bandwidth messages, latency round trips) for one size."""
    scale = 0.3 if quick else 1.0
    bw = int(max(4, min(20_000, (1.5e9 * budget * scale) // max(size, 1))))
    lat = int(max(4, min(5_000, (0.5e9 * budget * scale) // max(size, 1))))
    return bw, lat


def announced(mode: str, count: int) -> int:
    """The messages a client announces: a bandwidth run and an echo send one
    untimed first, so that the receiver's fresh buffer faults in outside the
    clock (on a VM whose memory the host backs lazily, touching fresh pages
    ran at 0.1 GB/s, which five 64 MiB messages could not hide)."""
    return count + 1 if mode in ("bw", "echo") else count


def timed(samples: list[float], count: int) -> float:
    """The median of the last ``count`` round trips (the first of an echo is
    the untimed warm-up)."""
    return statistics.median(samples[len(samples) - count :])


# --- raw blocking sockets: the ceiling -------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def raw_socket_server(ready: Any) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(f"{listener.getsockname()[1]}")
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    control = bytearray(CONTROL.size)
    while True:
        try:
            _recv_exact(conn, memoryview(control))
        except ConnectionError:
            return
        mode, size, count = CONTROL.unpack(control)
        buf = memoryview(np.empty(size, np.uint8).data)
        for _ in range(count):
            _recv_exact(conn, buf)
            if mode in REPLIED:
                conn.sendall(buf)
        if mode == b"bw  ":
            conn.sendall(b"k")


def raw_socket_client(address: str, plan: list[tuple[str, int, int]]) -> list[float]:
    conn = socket.create_connection(("127.0.0.1", int(address)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    results = []
    for mode, size, count in plan:
        data = np.ones(size, np.uint8)
        back = memoryview(np.empty(size, np.uint8).data)
        conn.sendall(CONTROL.pack(mode.encode().ljust(4), size, announced(mode, count)))
        if mode == "bw":
            conn.sendall(data)  # warm-up: the receiver's buffer faults in
            start = time.perf_counter()
            for _ in range(count):
                conn.sendall(data)
            conn.recv(1)
            results.append(size * count / (time.perf_counter() - start))
        else:
            samples = []
            for _ in range(announced(mode, count)):
                start = time.perf_counter()
                conn.sendall(data)
                _recv_exact(conn, back)
                samples.append(time.perf_counter() - start)
            results.append(timed(samples, count))
    conn.close()
    return results


# --- asyncio streams on uvloop: what the event loop alone costs ---------------


def streams_server(ready: Any, cpu: int | None = None) -> None:
    _pin(cpu)
    import uvloop

    async def main() -> None:
        finished = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    mode, size, count = CONTROL.unpack(await reader.readexactly(CONTROL.size))
                    for _ in range(count):
                        data = await reader.readexactly(size)
                        if mode in REPLIED:
                            writer.write(data)
                    if mode == b"bw  ":
                        writer.write(b"k")
            except asyncio.IncompleteReadError:
                finished.set()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=1 << 20)
        ready.put(str(server.sockets[0].getsockname()[1]))
        await finished.wait()
        server.close()

    uvloop.run(main())


def streams_client(
    address: str, plan: list[tuple[str, int, int]], cpu: int | None = None
) -> list[float]:
    _pin(cpu)
    import uvloop

    async def main() -> list[float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(address), limit=1 << 20)
        results = []
        for mode, size, count in plan:
            data = np.ones(size, np.uint8).data
            writer.write(CONTROL.pack(mode.encode().ljust(4), size, announced(mode, count)))
            if mode == "bw":
                writer.write(data)  # warm-up: the receiver's buffer faults in
                await writer.drain()
                start = time.perf_counter()
                for _ in range(count):
                    writer.write(data)
                    await writer.drain()
                await reader.readexactly(1)
                results.append(size * count / (time.perf_counter() - start))
            else:
                samples = []
                for _ in range(announced(mode, count)):
                    start = time.perf_counter()
                    writer.write(data)
                    await reader.readexactly(size)
                    samples.append(time.perf_counter() - start)
                results.append(timed(samples, count))
        writer.close()
        return results

    result: list[float] = uvloop.run(main())
    return result


# --- tensorwire transports ---------------------------------------------------


def _tw_config(ucx_tls: str | None) -> Any:
    from tensorwire.transports import TransportConfig, UCXOptions

    if ucx_tls is None:
        return TransportConfig()
    return TransportConfig(ucx=UCXOptions(tls=tuple(ucx_tls.split(","))))


def _run(loop: str, main: Callable[[], Any]) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def tw_server(
    ready: Any, url: str, loop: str, ucx_tls: str | None, cpu: int | None = None
) -> None:
    _pin(cpu)
    from tensorwire.errors import ConnectionClosedError
    from tensorwire.transports import listen

    async def main() -> None:
        finished = asyncio.Event()

        async def handle(conn: Any) -> None:
            try:
                while True:
                    (control,) = await conn.recv()
                    mode, size, count = CONTROL.unpack(bytes(control))
                    buf = np.empty(size, np.uint8)

                    def into(info: Any, buf: Any = buf) -> Any:
                        return buf

                    for _ in range(count):
                        # An echo receives as an application would, into
                        # buffers of the default allocator (the pool, backed
                        # by huge pages where the kernel offers them).
                        message = await conn.recv(allocator=None if mode == b"echo" else into)
                        if mode in REPLIED:
                            await conn.send(message)
                    if mode == b"bw  ":
                        await conn.send([b"k"])
            except ConnectionClosedError:
                finished.set()

        listener = await listen(url, handle, config=_tw_config(ucx_tls))
        ready.put(listener.address)
        await finished.wait()
        await listener.close()

    _run(loop, main)


def tw_client(
    address: str,
    plan: list[tuple[str, int, int]],
    loop: str,
    ucx_tls: str | None,
    cpu: int | None = None,
) -> list[float]:
    _pin(cpu)
    from tensorwire.transports import connect

    async def main() -> list[float]:
        conn = await connect(address, config=_tw_config(ucx_tls))
        results = []
        for mode, size, count in plan:
            data = np.ones(size, np.uint8)
            back = np.empty(size, np.uint8)
            await conn.send([CONTROL.pack(mode.encode().ljust(4), size, announced(mode, count))])
            if mode == "bw":
                await conn.send([data])  # warm-up: the receiver's buffer faults in
                start = time.perf_counter()
                for _ in range(count):
                    await conn.send([data])
                await conn.recv()
                results.append(size * count / (time.perf_counter() - start))
            else:
                allocator = None if mode == "echo" else lambda info, back=back: back
                samples = []
                for _ in range(announced(mode, count)):
                    start = time.perf_counter()
                    await conn.send([data])
                    await conn.recv(allocator=allocator)
                    samples.append(time.perf_counter() - start)
                results.append(timed(samples, count))
        await conn.close()
        return results

    result: list[float] = _run(loop, main)
    return result


# --- raw ucxx: UCX without tensorwire, set up as ucx:// sets it up ------------
#
# Worker addresses are exchanged over a TCP socket, endpoints are created from
# them with UCX error handling off, messages carry explicit tags, progress is
# ucxx's "blocking" mode: the settings that let UCX pick shared memory / CMA
# on one host (see tensorwire/transports/ucx.py).

_TAG_CONTROL, _TAG_DATA, _TAG_BACK = 1, 2, 3
_LEN = struct.Struct("<I")


def _ucx_env(tls: str | None) -> None:
    if tls is not None:
        os.environ["UCX_TLS"] = tls
    os.environ.setdefault("UCX_RNDV_SCHEME", "put_zcopy")


async def _exchange_addresses(sock: socket.socket, ours: bytes) -> bytes:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, _LEN.pack(len(ours)) + ours)
    header = b""
    while len(header) < _LEN.size:
        header += await loop.sock_recv(sock, _LEN.size - len(header))
    (size,) = _LEN.unpack(header)
    theirs = b""
    while len(theirs) < size:
        theirs += await loop.sock_recv(sock, size - len(theirs))
    return theirs


async def _ucxx_endpoint(ucxx: Any, sock: socket.socket) -> Any:
    peer = await _exchange_addresses(sock, bytes(ucxx.get_worker_address()))
    address = ucxx.get_ucx_address_from_buffer(peer)
    return await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)


def raw_ucxx_server(ready: Any, tls: str | None) -> None:
    _ucx_env(tls)
    import ucxx

    async def main() -> None:
        ucxx.init(progress_mode="blocking")
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        ready.put(str(listener.getsockname()[1]))
        sock, _ = await loop.sock_accept(listener)
        ep = await _ucxx_endpoint(ucxx, sock)
        control = np.empty(CONTROL.size, np.uint8)
        while True:
            await ep.recv(control, tag=_TAG_CONTROL, force_tag=True)
            mode, size, count = CONTROL.unpack(control.tobytes())
            if mode == b"end ":
                break
            buf = np.empty(size, np.uint8)
            for _ in range(count):
                await ep.recv(buf, tag=_TAG_DATA, force_tag=True)
                if mode in REPLIED:
                    await ep.send(buf, tag=_TAG_BACK, force_tag=True)
            if mode == b"bw  ":
                await ep.send(np.ones(1, np.uint8), tag=_TAG_BACK, force_tag=True)
        await ep.send(np.ones(1, np.uint8), tag=_TAG_BACK, force_tag=True)
        sock.close()

    asyncio.run(main())


def raw_ucxx_client(address: str, plan: list[tuple[str, int, int]], tls: str | None) -> list[float]:
    _ucx_env(tls)
    import ucxx

    async def main() -> list[float]:
        ucxx.init(progress_mode="blocking")
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", int(address)))
        ep = await _ucxx_endpoint(ucxx, sock)
        ack = np.empty(1, np.uint8)
        results = []
        for mode, size, count in plan:
            data = np.ones(size, np.uint8)
            back = np.empty(size, np.uint8)
            control = np.frombuffer(
                CONTROL.pack(mode.encode().ljust(4), size, announced(mode, count)), np.uint8)
            await ep.send(control, tag=_TAG_CONTROL, force_tag=True)
            if mode == "bw":
                await ep.send(data, tag=_TAG_DATA, force_tag=True)  # warm-up
                start = time.perf_counter()
                for _ in range(count):
                    await ep.send(data, tag=_TAG_DATA, force_tag=True)
                await ep.recv(ack, tag=_TAG_BACK, force_tag=True)
                results.append(size * count / (time.perf_counter() - start))
            else:
                samples = []
                for _ in range(announced(mode, count)):
                    start = time.perf_counter()
                    await ep.send(data, tag=_TAG_DATA, force_tag=True)
                    await ep.recv(back, tag=_TAG_BACK, force_tag=True)
                    samples.append(time.perf_counter() - start)
                results.append(timed(samples, count))
        end = np.frombuffer(CONTROL.pack(b"end ", 0, 0), np.uint8)
        await ep.send(end, tag=_TAG_CONTROL, force_tag=True)
        await ep.recv(ack, tag=_TAG_BACK, force_tag=True)
        sock.close()
        return results

    result: list[float] = asyncio.run(main())
    return result


# --- orchestration -----------------------------------------------------------


def _client_entry(queue: Any, fn: Callable[..., list[float]], args: tuple[Any, ...]) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as exc:
        queue.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def run_variant(
    server: Callable[..., None],
    server_args: tuple[Any, ...],
    client: Callable[..., list[float]],
    client_args: tuple[Any, ...],
    plan: list[tuple[str, int, int]],
    timeout: float,
) -> list[float] | str:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Queue(), ctx.Queue()
    srv = ctx.Process(target=server, args=(ready, *server_args), daemon=True)
    srv.start()
    try:
        address = ready.get(timeout=60)
        cli = ctx.Process(
            target=_client_entry, args=(done, client, (address, plan, *client_args)), daemon=True
        )
        cli.start()
        status, value = done.get(timeout=timeout)
        cli.join(10)
        return value if status == "ok" else f"failed: {value}"
    except Exception as exc:  # a variant that cannot run is reported, not fatal
        return f"failed: {type(exc).__name__}: {exc}"
    finally:
        srv.join(10)
        if srv.is_alive():
            srv.kill()


def variants(ucx: bool) -> list[tuple[str, Callable[..., None], tuple[Any, ...],
                                      Callable[..., list[float]], tuple[Any, ...]]]:
    out: list[Any] = [
        ("raw socket (blocking)", raw_socket_server, (), raw_socket_client, ()),
        ("asyncio streams (uvloop)", streams_server, (), streams_client, ()),
        ("tcp:// asyncio", tw_server, ("tcp://127.0.0.1:0", "asyncio", None), tw_client,
         ("asyncio", None)),
        ("tcp:// uvloop", tw_server, ("tcp://127.0.0.1:0", "uvloop", None), tw_client,
         ("uvloop", None)),
        # Both processes pinned to one CPU: no cross-CPU wake-up per message.
        ("asyncio streams (uvloop), one CPU", streams_server, (0,), streams_client, (0,)),
        ("tcp:// uvloop, one CPU", tw_server, ("tcp://127.0.0.1:0", "uvloop", None, 0),
         tw_client, ("uvloop", None, 0)),
    ]
    if ucx:
        for label, tls in (("UCX over TCP", "tcp"), ("UCX default", None)):
            out.append((f"ucx:// {label}", tw_server, ("ucx://127.0.0.1:0", "uvloop", tls),
                        tw_client, ("uvloop", tls)))
            out.append((f"raw ucxx {label}", raw_ucxx_server, (tls,), raw_ucxx_client, (tls,)))
    return out


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def environment() -> str:
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import tensorwire
    from tensorwire.transports import transparent_huge_pages

    lines = [
        f"- CPU: {cpu}, {os.cpu_count()} cores; Python {platform.python_version()}; "
        f"NumPy {np.__version__}; tensorwire {tensorwire.__version__}",
        f"- transparent huge pages: {transparent_huge_pages()} (tensorwire's receive buffers of "
        "2 MiB and more get huge pages under 'always' and 'madvise')",
    ]
    # Versions from the package metadata: importing ucxx here would set UCX
    # variables in this process's environment, which spawned children inherit.
    try:
        ucxx_version = importlib.metadata.version("ucxx-cu12")
        ucx_version = importlib.metadata.version("libucx-cu12")
        lines.append(f"- ucxx {ucxx_version}, UCX (libucx wheel) {ucx_version}")
    except importlib.metadata.PackageNotFoundError:
        lines.append("- ucxx not installed")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, shorter runs")
    parser.add_argument("--no-ucx", action="store_true", help="skip the ucx:// variants")
    parser.add_argument("--rounds", type=int, default=3, help="runs per variant (median)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    sizes = QUICK_SIZES if args.quick else SIZES
    plan: list[tuple[str, int, int]] = []
    for size in sizes:
        bw, lat = counts(size, 0.25, args.quick)
        plan.append(("bw", size, bw))
        if size <= 1 << 20:
            plan.append(("lat", size, lat))
        if size >= ECHO_MIN:
            plan.append(("echo", size, lat))
    # Every variant runs once per round, round-robin, and each cell is the
    # median over the rounds: on a small shared machine one run can be off
    # by 2x.
    runs: dict[str, list[list[float] | str]] = {}
    for round_ in range(args.rounds):
        for name, server, server_args, client, client_args in variants(not args.no_ucx):
            print(f"round {round_ + 1}: {name} ...", file=sys.stderr)
            result = run_variant(server, server_args, client, client_args, plan, timeout=600)
            runs.setdefault(name, []).append(result)
    rows: dict[str, list[float] | str] = {}
    for name, results in runs.items():
        good = [r for r in results if not isinstance(r, str)]
        if not good:
            rows[name] = str(results[0])
        else:
            rows[name] = [statistics.median(values) for values in zip(*good, strict=True)]
    write_results(args.output, plan, rows, " ".join(["python", *sys.argv]), args.rounds)


NOTES = """## Notes

- Small-message round trips. The blocking-socket baseline never enters an
  event loop: its process sleeps in recv() and is woken by the kernel
  directly. Every asyncio transport (plain asyncio streams included) sleeps
  in epoll and is woken through the event loop; on this 2-vCPU VM a wake-up
  of a process on the other CPU is where most of the round trip goes, and
  how long it takes varies 2x from run to run (compare the asyncio-streams
  column, which has no tensorwire code at all, and the "one CPU" columns,
  where both processes share one CPU and no message crosses CPUs). tcp:// adds
  about 10 µs of Python per message and side over a bare socket call
  (framing, the receive-side frame reader, the allocator hand-off), measured
  in-process with a blocking peer: `send()` costs 2 µs more than a bare
  `sendmsg()`. Closing the gap to a blocking socket would take a busy-polling
  receive (burning a core, as raw ucxx does) or the frame reader in C.
- raw ucxx keeps polling its worker from Python (`asyncio.sleep(0)` loops in
  its request wait), so it spins a core per side; that is where its lower
  round trip comes from. ucx:// polls for at most 200 µs after traffic and
  then sleeps on UCX's wakeup descriptor: an idle connection costs no CPU.
- Large messages. On one host UCX (its default choice: shared memory for
  small messages, CMA for large) copies each large message once, straight
  into the receiver's buffer, where TCP copies it twice through the
  kernel: see the last target line for how far ucx:// beats tcp:// here.
  Raw ucxx itself tops out at the memory copy bandwidth of the host (about
  8-10 GB/s on the 2-vCPU VMs these files come from); ucx:// sends each
  frame as its own UCX message after a header message, which costs most at
  1-4 MiB. A bandwidth run's first message is not timed: on a VM whose host
  backs guest memory lazily, the first touch of a fresh receive buffer ran
  at 0.1 GB/s, and it made every variant look slow from 64 MiB on.
- Small-message bandwidth (below 32 KiB) is bounded by the per-message
  Python cost of an asyncio transport; the RPC layer gathers messages that
  queue up behind a stuck write into one `sendmsg` (`Connection.send_many`).
"""


def _cell(plan: list[tuple[str, int, int]], rows: dict[str, list[float] | str], name: str,
          mode: str, size: int) -> float | None:
    values = rows.get(name)
    if values is None or isinstance(values, str):
        return None
    for i, (m, s, _) in enumerate(plan):
        if m == mode and s == size:
            return values[i]
    return None


def targets(plan: list[tuple[str, int, int]], rows: dict[str, list[float] | str]) -> list[str]:
    """The issue's targets, each met or missed, with the figures."""
    out = ["## Targets", ""]
    large = sorted({s for m, s, _ in plan if m == "bw" and s >= 1 << 20})

    def verdict(ok: bool) -> str:
        return "met" if ok else "**missed**"

    pairs = [
        ("tcp:// uvloop", "raw socket (blocking)", 0.9),
        ("tcp:// asyncio", "raw socket (blocking)", 0.9),
        ("ucx:// UCX over TCP", "raw ucxx UCX over TCP", 0.9),
        ("ucx:// UCX default", "raw ucxx UCX default", 0.9),
    ]
    for ours, base, goal in pairs:
        cells = []
        for size in large:
            a, b = _cell(plan, rows, ours, "bw", size), _cell(plan, rows, base, "bw", size)
            if a is not None and b is not None:
                cells.append(f"{fmt_size(size)} {a / b:.0%} {verdict(a >= goal * b)}")
        if cells:
            out.append(f"- {ours} bandwidth >= {goal:.0%} of {base}: " + "; ".join(cells))
    for ours in ("tcp:// uvloop", "tcp:// asyncio"):
        cells = []
        for size in sorted({s for m, s, _ in plan if m == "echo"}):
            a = _cell(plan, rows, ours, "echo", size)
            b = _cell(plan, rows, "raw socket (blocking)", "echo", size)
            if a is not None and b is not None:
                # Round trips: the lower the better.
                cells.append(f"{fmt_size(size)} {b / a:.0%} {verdict(b >= 0.9 * a)}")
        if cells:
            out.append(f"- {ours} echo >= 90% of raw socket (blocking): " + "; ".join(cells))
    for ours, base in (("tcp:// uvloop", "raw socket (blocking)"),
                       ("tcp:// uvloop", "asyncio streams (uvloop)"),
                       ("tcp:// uvloop, one CPU", "asyncio streams (uvloop), one CPU"),
                       ("ucx:// UCX default", "raw ucxx UCX default")):
        a, b = _cell(plan, rows, ours, "lat", 8), _cell(plan, rows, base, "lat", 8)
        if a is not None and b is not None:
            out.append(f"- 8 B round trip of {ours} within 1.5x of {base}: {a * 1e6:.1f} µs vs "
                       f"{b * 1e6:.1f} µs = {a / b:.2f}x {verdict(a <= 1.5 * b)}")
    cells = []
    for size in large:
        a, b = _cell(plan, rows, "ucx:// UCX default", "bw", size), _cell(
            plan, rows, "tcp:// uvloop", "bw", size)
        if a is not None and b is not None:
            cells.append(f"{fmt_size(size)} {a / b:.1f}x")
    if cells:
        out.append("- ucx:// (UCX default) vs tcp:// for large messages: " + "; ".join(cells))
    out.append("")
    return out


def write_results(
    path: Path,
    plan: list[tuple[str, int, int]],
    rows: dict[str, list[float] | str],
    command: str,
    rounds: int,
) -> None:
    names = list(rows)
    out = [
        "# Transport benchmark",
        "",
        f"Command: `{command}`. Each cell: the median of {rounds} rounds; one server and one "
        "client process per variant, one connection; receivers reuse one buffer per size, "
        "and a bandwidth run's first message (which faults it in) is not timed.",
        "",
        environment(),
        "",
    ]
    tables = (("bw", "One-way bandwidth", "GB/s"), ("lat", "Round trip (median)", "µs"),
              ("echo", "Large echo, both ways: 2 x size / median round trip", "GB/s"))
    for mode, title, unit in tables:
        out += [f"## {title} ({unit})", "", "| size | " + " | ".join(names) + " |",
                "|---:|" + "---:|" * len(names)]
        for i, (m, size, _) in enumerate(plan):
            if m != mode:
                continue
            cells = []
            for name in names:
                value = rows[name]
                if isinstance(value, str):
                    cells.append("—")
                elif mode == "bw":
                    cells.append(f"{value[i] / 1e9:.2f}")
                elif mode == "echo":
                    cells.append(f"{2 * size / value[i] / 1e9:.2f}")
                else:
                    cells.append(f"{value[i] * 1e6:.1f}")
            out.append(f"| {fmt_size(size)} | " + " | ".join(cells) + " |")
        out.append("")
    out += targets(plan, rows)
    out += NOTES.splitlines()
    failures = {n: v for n, v in rows.items() if isinstance(v, str)}
    if failures:
        out += ["## Variants that did not run", ""]
        out += [f"- {n}: {v}" for n, v in failures.items()]
        out.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
