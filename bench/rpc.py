"""RPC benchmark: tensorwire RPC vs its raw transports vs grpc.aio, side by side.

Every variant runs as a server process and a client process (spawn context;
UCX reads its settings once per process, so each variant gets fresh ones):

- tensorwire RPC over tcp:// and ucx:// (``@rpc.method`` echo, called through
  a typed proxy; uvloop in both processes),
- the raw transport echo over tcp:// and ucx:// (``tensorwire.transports``
  ``listen``/``connect`` echoing the frames, no RPC; uvloop),
- grpc.aio unary-unary over TCP with a generic handler on bytes and identity
  serializers (the tensor travels as ``arr.tobytes()``, is rebuilt with
  ``np.frombuffer``; asyncio's default loop, as grpc.aio ships),
- the floor of any asyncio RPC on this host, tiny calls only: a bare
  ``asyncio.Protocol`` on each side exchanging fixed 16-byte records (call
  id, value), each call a future that the client's ``data_received``
  resolves, the server echoing every whole record it has in one write (no
  encoding, deadlines, metrics or dispatch; uvloop).

- RPC against its raw transport, paired: one server process hosts both the
  RPC echo and the raw echo on the same transport, and one client process
  alternates between them call by call and echo by echo, so that both see
  the same process placement and the same moment of this shared host. The
  targets that compare the RPC with its transport use these pairs. The
  same against grpc.aio for the targets that compare the RPC with gRPC,
  except that the RPC and grpc.aio each run in a server and a client
  process of their own (grpc.aio's threads slowed the RPC beside them in
  one process), the RPC's client handing every other turn to the gRPC
  client over a pipe; both on uvloop there, which grpc.aio supports.

- instructions per tiny call, counted by valgrind's callgrind with the
  client and the server in one process (64 calls in flight over tcp://
  loopback): the RPC against the floor above. Times on this shared host
  swing by half or more within an hour; the count moves by a few percent
  from run to run (how many messages one read takes in still depends on
  timing; the floor's small count moves most), so it tracks the cost of a
  call from one commit to the next far better. Skipped without valgrind.

Measurements: a tiny call's latency (p50/p99, one call in flight) and calls
per second with 1 and 64 calls in flight; echo bandwidth of a float32 tensor
of 1, 64 and 256 MiB (GB/s counting both directions, median of a few echoes
after a warm-up). Receivers allocate a fresh buffer per message everywhere
(the transports' default allocator), as an RPC must.

    python bench/rpc.py                  # writes bench/results/rpc.md (3 rounds, ~15 min)
    python bench/rpc.py --quick          # one round of shorter runs (~3 min)
    python bench/rpc.py --profile DIR    # cProfile the 64-in-flight tcp:// case
    python bench/rpc.py --pin            # server and client on fixed, different CPUs
    python bench/rpc.py --instructions   # only the instruction counts (~4 min)

``--pin`` puts every server and client on two fixed, different CPUs (see
``placement``); by default the OS places them, except for the calls/s with
64 in flight, which run again in a pinned pair of their own (see
``write_results``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import multiprocessing as mp
import os
import platform
import queue
import statistics
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "rpc.md"
MiB = 1 << 20
SIZES = [1 * MiB, 64 * MiB, 256 * MiB]
TINY = 7  # the value a tiny RPC echoes
TINY_BYTES = struct.pack("<q", TINY)  # what the raw and gRPC tiny echoes carry
GRPC_METHOD = "/bench.Echo/Echo"
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
]
CONCURRENCY = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much of each measurement a client runs."""

    warmup_calls: int = 500
    latency_calls: int = 5000
    seconds: float = 3.0  # per calls-per-second measurement
    # Echoes per size in SIZES, after one warm-up. A 1 MiB echo takes about
    # a millisecond, and 50 of them left its paired ratio moving by a fifth
    # from round to round.
    reps: tuple[int, ...] = (200, 9, 5)
    sizes: tuple[int, ...] = tuple(SIZES)

    @classmethod
    def quick(cls) -> Plan:
        return cls(warmup_calls=200, latency_calls=2000, seconds=1.0, reps=(40, 3, 2))


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "rpc", "raw", "grpc", "floor", "pair" or "pair-grpc"
    url: str  # the server's listen URL ("" for gRPC)

    @property
    def multiplexed(self) -> bool:
        """Whether it has call ids, so that several calls may be in flight."""
        return self.kind != "raw"


VARIANTS = [
    Variant("tensorwire RPC tcp://", "rpc", "tcp://127.0.0.1:0"),
    Variant("tensorwire RPC ucx://", "rpc", "ucx://127.0.0.1:0"),
    Variant("raw transport tcp://", "raw", "tcp://127.0.0.1:0"),
    Variant("raw transport ucx://", "raw", "ucx://127.0.0.1:0"),
    Variant("grpc.aio", "grpc", ""),
    Variant("asyncio Protocol floor", "floor", ""),
    Variant("paired tcp://", "pair", "tcp://127.0.0.1:0"),
    Variant("paired ucx://", "pair", "ucx://127.0.0.1:0"),
    Variant("paired tcp:// and grpc.aio", "pair-grpc", "tcp://127.0.0.1:0"),
    Variant("paired ucx:// and grpc.aio", "pair-grpc", "ucx://127.0.0.1:0"),
]
#: The variant kinds that take turns between two servers in one process.
PAIRED = {"pair": "raw", "pair-grpc": "grpc"}
#: The kinds whose calls/s with 64 in flight run again in a pair of their own,
#: server and client on two different CPUs (see ``write_results``), unless
#: --pin pins everything anyway.
PINNED_CPS64 = ("rpc", "grpc", "floor")
#: The floor variant's record: call id, value.
FLOOR_RECORD = struct.Struct("<QQ")


# --- shared pieces -----------------------------------------------------------


def _transport_config(url: str) -> Any:
    from tensorwire.transports import TransportConfig, UCXOptions

    if url.startswith("ucx://"):
        return TransportConfig(ucx=UCXOptions())  # UCX's default settings on this host
    return TransportConfig()


def _run_loop(kind: str, main: Callable[[], Awaitable[Any]]) -> Any:
    if kind == "grpc":
        return asyncio.run(main())  # type: ignore[arg-type]
    import uvloop

    return uvloop.run(main())  # type: ignore[arg-type]


class _Profile:
    """cProfile around a process's work when ``path`` is set."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.profiler: Any = None

    def __enter__(self) -> _Profile:
        if self.path:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(self.path)


def _wait_stop(stop: Any) -> Awaitable[Any]:
    """Resolves when the parent puts anything on ``stop``."""
    return asyncio.get_running_loop().run_in_executor(None, stop.get)


# --- servers -----------------------------------------------------------------


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def placement(pin: bool) -> tuple[int | None, int | None]:
    """The CPUs for the server and the client process (None: the OS decides).

    On this 2-vCPU host a process pair left to the scheduler sometimes
    shares one vCPU and sometimes not, and large echoes run about twice as
    fast when it does (cache-hot loopback copies): the same code measured
    about 2 or 4 GB/s at 1 MiB from one process pair to the next. Pinning
    the server and the client to two different CPUs gives every variant
    the same placement.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return cpus[0], cpus[1]


def server_main(ready: Any, stop: Any, variant: Variant, profile: str | None,
                cpu: int | None = None) -> None:
    _pin(cpu)
    serve = {"rpc": _rpc_server, "raw": _raw_server, "grpc": _grpc_server,
             "grpc-peer": _grpc_server, "floor": _floor_server,
             "pair": _pair_server}[variant.kind]
    with _Profile(profile):
        _run_loop(variant.kind, lambda: serve(ready, stop, variant))


async def _start_rpc(url: str) -> Any:
    import tensorwire as tw
    from tensorwire import rpc

    class Echo(rpc.Service):
        @rpc.method
        async def echo(self, value: Any) -> Any:
            return value

    server = tw.Server([Echo()], config=rpc.ServerConfig(transport=_transport_config(url)))
    await server.start(url)
    return server


async def _start_raw(url: str) -> Any:
    from tensorwire.errors import ConnectionClosedError
    from tensorwire.transports import listen

    async def echo(conn: Any) -> None:
        with contextlib.suppress(ConnectionClosedError):
            while True:
                await conn.send(await conn.recv())

    return await listen(url, echo, config=_transport_config(url))


async def _rpc_server(ready: Any, stop: Any, variant: Variant) -> None:
    server = await _start_rpc(variant.url)
    ready.put(server.addresses[0])
    await _wait_stop(stop)
    await server.close(grace=1.0)


async def _raw_server(ready: Any, stop: Any, variant: Variant) -> None:
    listener = await _start_raw(variant.url)
    ready.put(listener.address)
    await _wait_stop(stop)
    await listener.close()


async def _pair_server(ready: Any, stop: Any, variant: Variant) -> None:
    server = await _start_rpc(variant.url)
    listener = await _start_raw(variant.url)
    ready.put((server.addresses[0], listener.address))
    await _wait_stop(stop)
    await listener.close()
    await server.close(grace=1.0)


async def _start_grpc() -> tuple[Any, str]:
    import grpc

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(
        echo, request_deserializer=None, response_serializer=None
    )
    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _grpc_server(ready: Any, stop: Any, variant: Variant) -> None:
    server, address = await _start_grpc()
    ready.put(address)
    await _wait_stop(stop)
    await server.stop(1.0)


class _FloorEcho(asyncio.Protocol):
    """Echoes every whole record it has, in one write."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.rest = b""

    def data_received(self, data: bytes) -> None:
        data = self.rest + data
        whole = len(data) - len(data) % FLOOR_RECORD.size
        if whole:
            self.transport.write(data[:whole])  # type: ignore[attr-defined]
        self.rest = data[whole:]


async def _floor_server(ready: Any, stop: Any, variant: Variant) -> None:
    server = await asyncio.get_running_loop().create_server(_FloorEcho, "127.0.0.1", 0)
    ready.put(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    await _wait_stop(stop)
    server.close()


# --- clients -----------------------------------------------------------------


class _Caller:
    """``tiny()`` and ``tensor(arr)`` echoes over one connection of a variant."""

    tiny: Callable[[], Awaitable[Any]]
    tensor: Callable[[np.ndarray[Any, Any]], Awaitable[np.ndarray[Any, Any]]]

    async def open(self, address: str) -> _Caller:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def time_tiny(self) -> float:
        """Seconds one tiny call takes."""
        start = time.perf_counter()
        await self.tiny()
        return time.perf_counter() - start

    async def time_echo(self, arr: np.ndarray[Any, Any], *, check: bool = False) -> float:
        """Seconds one echo of ``arr`` takes; ``check``: that it came back."""
        start = time.perf_counter()
        back = await self.tensor(arr)
        elapsed = time.perf_counter() - start
        if check:
            _check_echo(arr, back)
        return elapsed


class _TurnTaker(_Caller):
    """A caller in a process of its own (``turn_taker_main``), one turn per
    request over a pipe, timed there: the pair's other client, where sharing
    the RPC client's process would slow the RPC (grpc.aio's threads)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    async def open(self, address: str) -> _TurnTaker:
        """Wait until the turn taker has connected (to ``address``, its own)."""
        await self._answer()
        return self

    async def _answer(self) -> float:
        # A thread waits for the answer, so the RPC client's loop keeps
        # serving its connection (heartbeats) meanwhile.
        status, value = await asyncio.get_running_loop().run_in_executor(None, self.conn.recv)
        if status != "ok":
            raise RuntimeError(value)
        return float(value)

    async def _ask(self, *command: Any) -> float:
        self.conn.send(command)
        return await self._answer()

    async def time_tiny(self) -> float:
        return await self._ask("tiny")

    async def time_echo(self, arr: np.ndarray[Any, Any], *, check: bool = False) -> float:
        return await self._ask("echo", arr.nbytes, check)

    async def close(self) -> None:
        self.conn.send(("stop",))


def turn_taker_main(conn: Any, address: str, cpu: int | None) -> None:
    """The pair's grpc.aio client (uvloop), taking the turns ``_TurnTaker`` asks for."""
    _pin(cpu)

    async def main() -> None:
        try:
            caller = await _GRPCCaller().open(address)
        except Exception as exc:
            conn.send(("error", f"connecting: {type(exc).__name__}: {exc}"))
            return
        conn.send(("ok", 0.0))
        arrays: dict[int, np.ndarray[Any, Any]] = {}
        try:
            while True:
                command = conn.recv()
                try:
                    if command[0] == "tiny":
                        elapsed = await caller.time_tiny()
                    elif command[0] == "echo":
                        _, nbytes, check = command
                        arr = arrays.get(nbytes)
                        if arr is None:
                            arrays.clear()  # one size at a time
                            arr = arrays[nbytes] = np.arange(nbytes // 4, dtype=np.float32)
                        elapsed = await caller.time_echo(arr, check=check)
                    else:
                        return
                except Exception as exc:
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))
                    continue
                conn.send(("ok", elapsed))
        finally:
            await caller.close()

    with contextlib.suppress(EOFError, OSError):
        _run_loop("grpc-peer", main)


class _RPCCaller(_Caller):
    async def open(self, address: str) -> _RPCCaller:
        import tensorwire as tw
        from tensorwire import rpc

        class Echo(rpc.Service):
            @rpc.method
            async def echo(self, value: Any) -> Any:
                return value

        self.client = await tw.connect(address, timeout=600,
                                       transport=_transport_config(address))
        proxy = self.client.proxy(Echo)
        echo = proxy.echo

        # The call itself, no coroutine of the harness's around it (the
        # floor's tiny() is its whole call).
        self.tiny = functools.partial(echo, TINY)
        self.tensor = echo
        return self

    async def close(self) -> None:
        await self.client.close()


class _RawCaller(_Caller):
    async def open(self, address: str) -> _RawCaller:
        from tensorwire.transports import connect

        conn = await connect(address, config=_transport_config(address))
        self.conn = conn

        async def tiny() -> Any:
            await conn.send([TINY_BYTES])
            return await conn.recv()

        async def tensor(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            await conn.send([arr])
            (frame,) = await conn.recv()
            return np.frombuffer(frame, arr.dtype).reshape(arr.shape)

        self.tiny = tiny
        self.tensor = tensor
        return self

    async def close(self) -> None:
        await self.conn.close()


class _FloorProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future[int]] = {}
        self.rest = b""
        self.ids = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        data = self.rest + data
        whole = len(data) - len(data) % FLOOR_RECORD.size
        pending = self.pending
        for offset in range(0, whole, FLOOR_RECORD.size):
            call_id, value = FLOOR_RECORD.unpack_from(data, offset)
            pending.pop(call_id).set_result(value)
        self.rest = data[whole:]


class _FloorCaller(_Caller):
    async def open(self, address: str) -> _FloorCaller:
        host, port = address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_connection(_FloorProtocol, host, int(port))
        self.transport = transport

        async def tiny() -> Any:
            protocol.ids += 1
            call_id = protocol.ids
            future = loop.create_future()
            protocol.pending[call_id] = future
            transport.write(FLOOR_RECORD.pack(call_id, TINY))
            return await future

        async def tensor(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            raise NotImplementedError("the floor variant echoes tiny records only")

        self.tiny = tiny
        self.tensor = tensor
        return self

    async def close(self) -> None:
        self.transport.close()


class _GRPCCaller(_Caller):
    async def open(self, address: str) -> _GRPCCaller:
        import grpc

        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        await self.channel.channel_ready()
        stub = self.channel.unary_unary(
            GRPC_METHOD, request_serializer=None, response_deserializer=None
        )

        async def tensor(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            reply = await stub(arr.tobytes(), timeout=600)
            return np.frombuffer(reply, arr.dtype).reshape(arr.shape)

        self.tiny = functools.partial(stub, TINY_BYTES, timeout=600)
        self.tensor = tensor
        return self

    async def close(self) -> None:
        await self.channel.close()


async def _calls_per_second(tiny: Callable[[], Awaitable[Any]], tasks: int,
                            seconds: float) -> float:
    deadline = time.perf_counter() + seconds
    done = [0] * tasks

    async def worker(index: int) -> None:
        clock = time.perf_counter
        n = 0
        while clock() < deadline:
            await tiny()
            n += 1
        done[index] = n

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(tasks)))
    return sum(done) / (time.perf_counter() - start)


async def _measure(caller: _Caller, variant: Variant, plan: Plan,
                   only_cps64: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": []}

    async def section(name: str, body: Callable[[], Awaitable[None]]) -> None:
        try:
            await body()
        except Exception as exc:  # one broken measurement does not hide the others
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")

    for _ in range(plan.warmup_calls):
        await caller.tiny()

    async def latency() -> None:
        samples = []
        clock = time.perf_counter
        for _ in range(plan.latency_calls):
            start = clock()
            await caller.tiny()
            samples.append(clock() - start)
        samples.sort()
        out["p50"] = samples[len(samples) // 2]
        out["p99"] = samples[min(len(samples) - 1, int(len(samples) * 0.99))]

    async def cps1() -> None:
        out["cps1"] = await _calls_per_second(caller.tiny, 1, plan.seconds)

    async def cps64() -> None:
        out["cps64"] = await _calls_per_second(caller.tiny, CONCURRENCY, plan.seconds)

    if only_cps64:
        await section("64 in flight", cps64)
        return out
    await section("latency", latency)
    await section("1 in flight", cps1)
    if variant.multiplexed:
        await section("64 in flight", cps64)

    bandwidth: dict[int, float] = {}
    if variant.kind == "floor":
        return out
    for size, reps in zip(plan.sizes, plan.reps, strict=True):
        async def echo(size: int = size, reps: int = reps) -> None:
            arr = np.arange(size // 4, dtype=np.float32)
            await caller.time_echo(arr, check=True)  # warm-up
            times = [await caller.time_echo(arr) for _ in range(reps)]
            bandwidth[size] = 2 * size / statistics.median(times)

        await section(f"{size // MiB} MiB echo", echo)
    out["bw"] = bandwidth
    return out


def _check_echo(arr: np.ndarray[Any, Any], back: np.ndarray[Any, Any]) -> None:
    if back.nbytes != arr.nbytes or back[-1] != arr[-1]:
        raise RuntimeError("the echo came back different")


async def _measure_pair(callers: dict[str, _Caller], plan: Plan) -> dict[str, Any]:
    """Tiny-call latency and echo bandwidth of the RPC and of its raw
    transport, taking turns call by call (who goes first alternates too)."""
    out: dict[str, Any] = {"errors": []}
    names = list(callers)

    def turns(i: int) -> list[str]:
        return names if i % 2 == 0 else names[::-1]

    for _ in range(plan.warmup_calls):
        for name in names:
            await callers[name].time_tiny()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(plan.latency_calls):
        for name in turns(i):
            samples[name].append(await callers[name].time_tiny())
    for name in names:
        ordered = sorted(samples[name])
        out[name] = {"p50": ordered[len(ordered) // 2], "bw": {}}
    for size, reps in zip(plan.sizes, plan.reps, strict=True):
        arr = np.arange(size // 4, dtype=np.float32)
        times: dict[str, list[float]] = {name: [] for name in names}
        try:
            for name in names:
                await callers[name].time_echo(arr, check=True)  # warm-up
            for i in range(reps):
                for name in turns(i):
                    times[name].append(await callers[name].time_echo(arr))
        except Exception as exc:  # one broken size does not hide the others
            out["errors"].append(f"{size // MiB} MiB echo: {type(exc).__name__}: {exc}")
            continue
        for name in names:
            out[name]["bw"][size] = 2 * size / statistics.median(times[name])
    return out


def client_main(done: Any, address: Any, variant: Variant, plan: Plan,
                profile: str | None, only_cps64: bool, cpu: int | None = None,
                peer: Any = None) -> None:
    """``peer``: the pipe to the turn taker of a pair with grpc.aio."""
    _pin(cpu)

    async def main() -> dict[str, Any]:
        if variant.kind in PAIRED:
            rpc_address, other_address = address
            other = await (_RawCaller() if variant.kind == "pair"
                           else _TurnTaker(peer)).open(other_address)
            callers: dict[str, _Caller] = {"rpc": await _RPCCaller().open(rpc_address),
                                           PAIRED[variant.kind]: other}
            try:
                return await _measure_pair(callers, plan)
            finally:
                for each in callers.values():
                    await each.close()
        cls = {"rpc": _RPCCaller, "raw": _RawCaller, "grpc": _GRPCCaller,
               "floor": _FloorCaller}[variant.kind]
        caller = await cls().open(address)
        try:
            return await _measure(caller, variant, plan, only_cps64)
        finally:
            await caller.close()

    try:
        with _Profile(profile):
            result = _run_loop(variant.kind, main)
        done.put(("ok", result))
    except BaseException as exc:
        done.put(("error", f"{type(exc).__name__}: {exc}"))


# --- instructions per call -------------------------------------------------------

#: Calls of the two runs whose instruction counts are subtracted: start-up,
#: imports and connecting cancel out, 10,000 calls remain.
COUNT_RUNS = (3_000, 13_000)


async def _calls_in_one_process(kind: str, calls: int) -> None:
    """``calls`` tiny calls, 64 in flight, client and server on this loop."""
    if kind == "rpc":
        server = await _start_rpc("tcp://127.0.0.1:0")
        caller: _Caller = await _RPCCaller().open(server.addresses[0])
    else:
        server = await asyncio.get_running_loop().create_server(_FloorEcho, "127.0.0.1", 0)
        caller = await _FloorCaller().open(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    for _ in range(500):
        await caller.tiny()
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await caller.tiny()

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    await caller.close()
    if kind == "rpc":
        await server.close()
    else:
        server.close()


def instructions_per_call(kind: str) -> float | str:
    """Instructions per tiny call of ``kind`` ("rpc" or "floor"), client and
    server together; or why it could not be counted."""
    import shutil
    import subprocess

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return "valgrind is not installed"
    totals = []
    for calls in COUNT_RUNS:
        run = subprocess.run(
            [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             __file__, "--count-calls", kind, str(calls)],
            capture_output=True, text=True, timeout=900)
        found = [line for line in run.stderr.splitlines() if "Collected :" in line]
        if run.returncode != 0 or not found:
            return f"callgrind failed (exit {run.returncode}): {run.stderr[-300:]}"
        totals.append(int(found[-1].split(":")[-1].replace(",", "").strip()))
    return (totals[1] - totals[0]) / (COUNT_RUNS[1] - COUNT_RUNS[0])


def _count_note(counts: dict[str, float | str]) -> str:
    rpc, floor = counts.get("rpc"), counts.get("floor")
    if not isinstance(rpc, float) or not isinstance(floor, float):
        return ""
    return (f"; a call costs {rpc:,.0f} instructions against the floor's {floor:,.0f} "
            f"({rpc / floor:.0f}x)")


def count_section(counts: dict[str, float | str]) -> list[str]:
    out = ["", "## Instructions per tiny call", "",
           "Counted by valgrind's callgrind: client and server in one process, "
           f"{CONCURRENCY} calls in flight over one tcp:// loopback connection, the "
           f"difference between runs of {COUNT_RUNS[1]:,} and {COUNT_RUNS[0]:,} calls "
           "divided by their difference (start-up, imports and connecting cancel out). "
           "The count moves by a few percent from run to run (how many messages one read "
           "takes in still depends on timing; the floor's small count moves most), where "
           "times on this host swing by half or more.",
           "", "| variant | instructions per call (client + server) |", "|---|---:|"]
    for kind, name in (("rpc", "tensorwire RPC tcp://"), ("floor", "asyncio Protocol floor")):
        value = counts.get(kind)
        out.append(f"| {name} | "
                   + (f"{value:,.0f}" if isinstance(value, float) else f"not counted: {value}")
                   + " |")
    return out


# --- orchestration -----------------------------------------------------------


def run_variant(variant: Variant, plan: Plan, timeout: float, *,
                profile_dir: Path | None = None, only_cps64: bool = False,
                pin: bool = False) -> dict[str, Any] | str:
    """The client's results, or why the variant did not run."""
    ctx = mp.get_context("spawn")
    stop, done = ctx.Queue(), ctx.Queue()
    srv_prof = str(profile_dir / "server.prof") if profile_dir else None
    cli_prof = str(profile_dir / "client.prof") if profile_dir else None
    srv_cpu, cli_cpu = placement(pin)
    procs: list[Any] = []  # in start order; stopped in reverse
    servers = 0

    def start(target: Callable[..., None], *args: Any) -> Any:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    def serve(served: Variant, prof: str | None) -> Any:
        """Start a server process; its address, or None if it did not start."""
        nonlocal servers
        ready = ctx.Queue()
        start(server_main, ready, stop, served, prof, srv_cpu)
        servers += 1
        try:
            return ready.get(timeout=60)
        except queue.Empty:
            return None

    try:
        peer = None
        if variant.kind == "pair-grpc":
            # The RPC and grpc.aio each in processes of their own: grpc.aio's
            # threads beside the RPC in one process slowed the RPC's echo
            # right after a gRPC echo by about a fifth (64 MiB over ucx://).
            rpc_address = serve(dataclasses.replace(variant, kind="rpc"), srv_prof)
            grpc_address = serve(Variant(variant.name, "grpc-peer", ""), None)
            address = None if None in (rpc_address, grpc_address) else (
                rpc_address, grpc_address)
            if address is not None:
                peer, theirs = ctx.Pipe()
                start(turn_taker_main, theirs, grpc_address, cli_cpu)
                theirs.close()  # the child has its own: its recv() ends with the client
        else:
            address = serve(variant, srv_prof)
        if address is None:
            codes = [p.exitcode for p in procs if p.exitcode is not None]
            return "the server did not start within 60 s" + (
                f" (exit code {codes[0]})" if codes else "")
        start(client_main, done, address, variant, plan, cli_prof, only_cps64, cli_cpu, peer)
        if peer is not None:
            peer.close()
        try:
            _status, value = done.get(timeout=timeout)
        except queue.Empty:
            return f"timed out after {timeout:.0f} s"
        return value  # the results, or the error text
    finally:
        for _ in range(servers):
            stop.put("stop")
        for proc in reversed(procs):
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# --- the report ----------------------------------------------------------------


def _errors(results: list[dict[str, Any] | str]) -> list[str]:
    """Every distinct error of the rounds, in order (a round that did not
    run is its error)."""
    errors: list[str] = []
    for r in results:
        errors += [e for e in (r["errors"] if isinstance(r, dict) else [r]) if e not in errors]
    return errors


def combine(results: list[dict[str, Any] | str]) -> dict[str, Any] | str:
    """The median of each number over the rounds that ran; the first error if none did."""
    good = [r for r in results if isinstance(r, dict)]
    if not good:
        return str(results[0])
    out: dict[str, Any] = {"errors": _errors(results)}
    for key in ("p50", "p99", "cps1", "cps64", "cps64_os"):
        values = [r[key] for r in good if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    sizes = {size for r in good for size in r.get("bw", {})}
    out["bw"] = {size: statistics.median([r["bw"][size] for r in good if size in r["bw"]])
                 for size in sizes}
    return out


def combine_pair(results: list[dict[str, Any] | str], other: str) -> dict[str, Any] | str:
    """A paired variant's medians over the rounds, and each round's ratio of
    the RPC to ``other`` ("raw" or "grpc"); the ratio's median is what the
    targets use. Keys ``other_p50``, ``other_bw`` hold the other side's."""
    good = [r for r in results if isinstance(r, dict)]
    if not good:
        return str(results[0])
    out: dict[str, Any] = {"errors": _errors(results)}
    out["p50_ratios"] = [r["rpc"]["p50"] / r[other]["p50"] for r in good]
    out["p50_ratio"] = statistics.median(out["p50_ratios"])
    out["shares"] = {}
    sides = {"rpc": "rpc", other: "other"}
    for side, key in sides.items():
        out[f"{key}_p50"] = statistics.median([r[side]["p50"] for r in good])
        out[f"{key}_bw"] = {}
    for size in sorted({size for r in good for size in r["rpc"]["bw"]}):
        paired = [r for r in good if size in r["rpc"]["bw"] and size in r[other]["bw"]]
        if not paired:
            continue
        for side, key in sides.items():
            out[f"{key}_bw"][size] = statistics.median([r[side]["bw"][size] for r in paired])
        out["shares"][size] = [r["rpc"]["bw"][size] / r[other]["bw"][size] for r in paired]
    return out


def _paired(rows: dict[str, dict[str, Any] | str], name: str) -> dict[str, Any] | None:
    row = rows.get(name)
    return row if isinstance(row, dict) else None


def _share(row: dict[str, Any] | None, size: int) -> float | None:
    shares = None if row is None else row["shares"].get(size)
    return statistics.median(shares) if shares else None


def _spread(results: list[dict[str, Any] | str], key: str, fmt: Callable[[Any], str],
            size: int | None = None) -> str:
    values = []
    for r in results:
        if isinstance(r, dict):
            value = r.get(key)
            if size is not None:
                value = value.get(size) if isinstance(value, dict) else None
            if isinstance(value, int | float):
                values.append(value)
    if not values:
        return "—"
    return f"{fmt(min(values))} to {fmt(max(values))}"


def environment() -> list[str]:
    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import tensorwire

    versions = [f"Python {platform.python_version()}", f"NumPy {np.__version__}",
                f"tensorwire {tensorwire.__version__}"]
    for module in ("grpc", "uvloop", "ucxx"):
        try:
            mod = __import__(module)
            versions.append(f"{'grpcio' if module == 'grpc' else module} "
                            f"{str(mod.__version__).strip()}")
        except ImportError:
            versions.append(f"{module} not installed")
    return [f"- CPU: {cpu}, {os.cpu_count()} cores, loopback only; "
            f"{platform.system()} {platform.release()}",
            "- " + "; ".join(versions)]


def _revision() -> str:
    """The commit, and whether the library had uncommitted changes when this ran."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tensorwire"], cwd=root,
                               text=True, capture_output=True, timeout=10).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [line[3:] for line in dirty if line.strip()]
    if not changed:
        return head
    return f"{head} + uncommitted changes to {', '.join(changed)}"


def _placement_note(pin: bool) -> str:
    server, client = placement(pin)
    if server is None:
        return ("- Process placement: left to the OS. On this 2-vCPU host a pair that shares "
                "one vCPU moves large echoes about twice as fast as a pair on two (1 MiB: "
                "about 4 against 2 GB/s for the raw transport, the same code), so each "
                "bandwidth figure depends on where its pair landed; see the spread table. "
                "`--pin` puts every server and client on fixed, different CPUs.")
    return (f"- Process placement (`--pin`): every server on CPU {server}, every client on "
            f"CPU {client}, so that all variants run alike (left to the OS, a pair sharing "
            "one vCPU moved large echoes about twice as fast as a pair on two). Pinned "
            "processes cannot move away from other work on their CPU.")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e6:.1f}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _gbps(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e9:.2f}"


def _get(rows: dict[str, dict[str, Any] | str], name: str, key: str,
         size: int | None = None) -> float | None:
    row = rows.get(name)
    if not isinstance(row, dict):
        return None
    value = row.get(key)
    if size is not None:
        value = value.get(size) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) else None


def targets(rows: dict[str, dict[str, Any] | str], sizes: tuple[int, ...],
            counts: dict[str, float | str] | None = None) -> list[str]:
    out = []

    def verdict(ok: bool | None) -> str:
        return "**not measured**" if ok is None else ("**met**" if ok else "**missed**")

    for scheme in ("tcp", "ucx"):
        pair = _paired(rows, f"paired {scheme}://")
        line = f"- Tiny-call p50 within 1.5x of the raw {scheme}:// echo: "
        if pair is None:
            out.append(line + verdict(None))
            continue
        ratio = pair["p50_ratio"]
        out.append(line + f"{verdict(ratio <= 1.5)} — {ratio:.2f}x (paired: RPC "
                   f"{_us(pair['rpc_p50'])} µs vs raw {_us(pair['other_p50'])} µs)")
    cps = _get(rows, "tensorwire RPC tcp://", "cps64")
    cps_os = _get(rows, "tensorwire RPC tcp://", "cps64_os")
    grpc_cps = _get(rows, "grpc.aio", "cps64")
    floor_cps = _get(rows, "asyncio Protocol floor", "cps64")
    placed = "" if cps_os is None else (
        f" with the server and the client on two CPUs; left to the OS {_rate(cps_os)}")
    out.append(f"- ≥ 50,000 tiny calls/s with 64 in flight on one tcp:// connection: "
               f"{verdict(None if cps is None else cps >= 50_000)} — {_rate(cps)} calls/s"
               f"{placed} (grpc.aio {_rate(grpc_cps)} calls/s; the bare asyncio Protocol floor "
               f"{_rate(floor_cps)} calls/s)" + _count_note(counts or {}))
    goals = [(f"paired {scheme}://", size, 0.85, f"{size // MiB} MiB echo over {scheme}:// "
              "≥ 85% of the raw transport", "raw")
             for scheme in ("tcp", "ucx") for size in sizes]
    goals += [(f"paired {scheme}:// and grpc.aio", 64 * MiB, factor,
               f"64 MiB echo over {scheme}:// ≥ {factor}x grpc.aio", "grpc.aio")
              for scheme, factor in (("tcp", 5), ("ucx", 20))]
    for name, size, goal, text, other in goals:
        pair = _paired(rows, name)
        share = _share(pair, size)
        line = f"- {text}: {verdict(None if share is None else share >= goal)}"
        if pair is not None and share is not None:
            shown = f"{100 * share:.0f}%" if goal < 1 else f"{share:.1f}x"
            line += (f" — {shown} (paired: RPC {_gbps(pair['rpc_bw'].get(size))} GB/s vs "
                     f"{other} {_gbps(pair['other_bw'].get(size))} GB/s)")
        out.append(line)
    return out


def paired_section(rows: dict[str, dict[str, Any] | str], pairs: list[str],
                   plan: Plan, other: str) -> list[str]:
    """The table of the paired variants against ``other`` (raw or grpc.aio)."""
    against = "its raw transport" if other == "raw" else "grpc.aio"
    if other == "raw":
        how = ("One server process hosts the RPC echo and the raw echo side by side; one "
               "client process takes turns between them, call by call and echo by echo "
               "(who goes first alternates), so that both see the same process placement "
               "and the same moment of this shared host.")
    else:
        how = ("The RPC and grpc.aio each run in a server process and a client process of "
               "their own, and the two clients take turns, call by call and echo by echo "
               "(who goes first alternates; the RPC's client hands the gRPC client its "
               "turns over a pipe, and each client times its own calls), so that both see "
               "the same moment of this shared host. In one process pair, grpc.aio's "
               "threads slowed the RPC's echo right after a gRPC echo by about a fifth "
               "(64 MiB over ucx://). Both on uvloop here, which grpc.aio supports; "
               "grpc.aio runs over TCP whatever the RPC's transport.")
    out = ["", f"## RPC against {against}, paired", "",
           how + f" Latency: the median over {plan.latency_calls:,} turns each; bandwidth: as "
           "above. A ratio is the median over the rounds of each round's ratio (min to max "
           "in brackets); the targets use these ratios.", "",
           f"| variant | tiny p50, RPC / {other} (µs) | RPC ÷ {other} | "
           + " | ".join(f"{s // MiB} MiB, RPC / {other} (GB/s) | RPC ÷ {other}"
                        for s in plan.sizes) + " |",
           "|---|---:|---:|" + "---:|---:|" * len(plan.sizes)]

    def bracket(values: list[float], fmt: Callable[[float], str]) -> str:
        if len(values) < 2:
            return ""
        return f" ({fmt(min(values))} to {fmt(max(values))})"

    def share(value: float) -> str:
        return f"{100 * value:.0f}%" if other == "raw" else f"{value:.1f}x"

    for name in pairs:
        row = rows[name]
        if isinstance(row, str):
            out.append(f"| {name} | did not run | | " + "| |" * len(plan.sizes))
            continue
        ratios = row["p50_ratios"]
        cells = [f"{_us(row['rpc_p50'])} / {_us(row['other_p50'])}",
                 f"{row['p50_ratio']:.2f}x" + bracket(ratios, lambda v: f"{v:.2f}x")]
        for size in plan.sizes:
            shares = row["shares"].get(size)
            if not shares:
                cells += ["—", "—"]
                continue
            cells.append(f"{_gbps(row['rpc_bw'].get(size))} / "
                         f"{_gbps(row['other_bw'].get(size))}")
            cells.append(share(statistics.median(shares)) + bracket(shares, share))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def write_results(path: Path, plan: Plan, rows: dict[str, dict[str, Any] | str],
                  command: str, elapsed: float, load_before: str,
                  runs: dict[str, list[dict[str, Any] | str]] | None = None, *,
                  pin: bool = False, counts: dict[str, float | str] | None = None) -> None:
    kinds = {v.name: v.kind for v in VARIANTS}
    names = [name for name in rows if kinds[name] not in PAIRED]

    def cell(name: str, text: str) -> str:
        return "did not run" if isinstance(rows[name], str) else text

    out = ["# RPC benchmark", "", f"Command: `{command}` (took {elapsed:.0f} s)", "",
           *environment(),
           f"- tensorwire tree: {_revision()}",
           f"- Load average (1/5/15 min) before the run {load_before}, after {_load()}: "
           "other work on this shared 2-core host adds noise, most to the large echoes.",
           "- tensorwire variants run uvloop in both processes; grpc.aio runs asyncio's "
           "default loop. ucx:// uses UCX's default settings (`UCXOptions()`).",
           "- Each variant: one server process, one client process, one connection.",
           _placement_note(pin), ""]
    pinned_cps = "" if pin else (
        f" Calls/s with {CONCURRENCY} in flight run again in a pair of processes of their "
        "own, the server and the client pinned to two different CPUs, and the targets use "
        "that figure: left to the OS, the pair sometimes shares one vCPU (a loopback "
        "socket wakes its reader with a sync wake-up, which invites the scheduler to keep "
        "the two together), and then measures one CPU doing both sides' work instead of "
        "two ends working at once. The last column gives the OS-placed run's figure.")
    out += ["## Tiny unary call", "",
            f"Echo of a small value (RPC: the int {TINY}; raw transport and gRPC: 8 bytes). "
            f"Latency over {plan.latency_calls:,} calls after {plan.warmup_calls} warm-up "
            f"calls, one in flight; calls/s over {plan.seconds:g} s, with 1 and with "
            f"{CONCURRENCY} concurrent tasks on the one connection. The raw transport has no "
            "call ids, so it runs with 1 in flight only." + pinned_cps, "",
            "| variant | p50 (µs) | p99 (µs) | calls/s, 1 in flight | "
            f"calls/s, {CONCURRENCY} in flight |"
            + ("" if pin else f" calls/s, {CONCURRENCY} in flight, OS placement |"),
            "|---|---:|---:|---:|---:|" + ("" if pin else "---:|")]
    for name in names:
        variant = next(v for v in VARIANTS if v.name == name)
        many = (_rate(_get(rows, name, "cps64")) if variant.multiplexed
                else "n/a (no call ids)")
        placed = "" if pin else " " + (
            cell(name, _rate(_get(rows, name, "cps64_os"))) if variant.multiplexed
            else "n/a") + " |"
        out.append(f"| {name} | {cell(name, _us(_get(rows, name, 'p50')))} | "
                   f"{cell(name, _us(_get(rows, name, 'p99')))} | "
                   f"{cell(name, _rate(_get(rows, name, 'cps1')))} | {cell(name, many)} |"
                   + placed)
    out += ["", "## Tensor echo bandwidth (GB/s, both directions)", "",
            "Echo of a float32 tensor: 2 * size / time per echo (1 GB = 1e9 bytes), the "
            "median of " + ", ".join(f"{r} ({s // MiB} MiB)"
                                     for s, r in zip(plan.sizes, plan.reps, strict=True))
            + " echoes after one warm-up echo. gRPC sends `arr.tobytes()` and rebuilds "
            "with `np.frombuffer`.", "",
            "| variant | " + " | ".join(f"{s // MiB} MiB" for s in plan.sizes) + " |",
            "|---|" + "---:|" * len(plan.sizes)]
    for name in names:
        if next(v for v in VARIANTS if v.name == name).kind == "floor":
            continue  # tiny records only
        cells = [cell(name, _gbps(_get(rows, name, "bw", s))) for s in plan.sizes]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    rounds = max((len(r) for r in (runs or {}).values()), default=1)
    if rounds > 1 and runs:
        out += ["", f"## Run-to-run spread (min to max over the {rounds} rounds)", "",
                "The tables above give each number's median over the rounds (every variant "
                "runs once per round, round-robin).", "",
                "| variant | p50 (µs) | calls/s, 64 in flight | "
                + ("" if pin else "calls/s, 64 in flight, OS placement | ")
                + " | ".join(f"{s // MiB} MiB (GB/s)" for s in plan.sizes) + " |",
                "|---|---:|---:|" + ("" if pin else "---:|") + "---:|" * len(plan.sizes)]
        for name, results in runs.items():
            if kinds[name] in PAIRED:
                continue
            cells = [_spread(results, "p50", _us), _spread(results, "cps64", _rate)]
            if not pin:
                cells.append(_spread(results, "cps64_os", _rate))
            cells += [_spread(results, "bw", _gbps, s) for s in plan.sizes]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    for kind, other in PAIRED.items():
        pairs = [name for name in rows if kinds[name] == kind]
        if pairs:
            out += paired_section(rows, pairs, plan, "grpc.aio" if other == "grpc" else other)
    if counts:
        out += count_section(counts)
    out += ["", "## Targets", "", *targets(rows, plan.sizes, counts), ""]
    problems = []
    for name, row in rows.items():
        if isinstance(row, str):
            problems.append(f"- {name}: did not run: {row}")
        else:
            problems += [f"- {name}: {error}" for error in row["errors"]]
    if problems:
        out += ["## What did not run", "", *problems, ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    print(f"wrote {path}", file=sys.stderr)


def profile(directory: Path, plan: Plan, *, cprofile: bool = True, pin: bool = False) -> None:
    """cProfile the 64-in-flight tcp:// RPC case in both processes; print the top."""
    import pstats

    directory.mkdir(parents=True, exist_ok=True)
    variant = VARIANTS[0]
    result = run_variant(variant, plan, timeout=300, profile_dir=directory if cprofile else None,
                         only_cps64=True, pin=pin)
    how = "under cProfile" if cprofile else "unprofiled"
    print(f"{variant.name}, {CONCURRENCY} in flight {how}: {result}", file=sys.stderr)
    if not cprofile:
        return
    for role in ("client", "server"):
        path = directory / f"{role}.prof"
        if not path.exists():
            print(f"no profile from the {role}", file=sys.stderr)
            continue
        print(f"\n===== {role}: top functions by self time =====")
        pstats.Stats(str(path)).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--no-ucx", action="store_true", help="skip the ucx:// variants")
    parser.add_argument("--rounds", type=int, default=None,
                        help="run every variant this many times, round-robin, and report the "
                             "median of each number (default 3, with --quick 1)")
    parser.add_argument("--pin", action="store_true",
                        help="pin every server to the first allowed CPU and every client to "
                             "the second (default: the OS places them)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--instructions", action="store_true",
                        help="only count the instructions per tiny call (needs valgrind)")
    parser.add_argument("--count-calls", nargs=2, metavar=("KIND", "CALLS"),
                        help=argparse.SUPPRESS)  # the process that --instructions counts
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="only cProfile tensorwire RPC over tcp:// with 64 calls in flight, "
                             "writing DIR/client.prof and DIR/server.prof")
    parser.add_argument("--profiler", choices=("cprofile", "none"), default="cprofile",
                        help="with --profile: 'none' runs the case unprofiled, for an outside "
                             "sampler (py-spy record --subprocesses -- python bench/rpc.py ...)")
    args = parser.parse_args()
    if args.count_calls:
        import uvloop

        kind, calls = args.count_calls
        uvloop.run(_calls_in_one_process(kind, int(calls)))
        return
    if args.instructions:
        for kind in ("rpc", "floor"):
            print(f"{kind}: {instructions_per_call(kind)} instructions per call")
        return
    plan = Plan.quick() if args.quick else Plan()
    if args.profile is not None:
        profile(args.profile, plan, cprofile=args.profiler == "cprofile", pin=args.pin)
        return
    rounds = max(1, args.rounds if args.rounds is not None else (1 if args.quick else 3))
    started, load_before = time.perf_counter(), _load()
    runs: dict[str, list[dict[str, Any] | str]] = {}
    for round_ in range(rounds):
        for variant in VARIANTS:
            if args.no_ucx and variant.url.startswith("ucx://"):
                continue
            print(f"round {round_ + 1}/{rounds}: {variant.name} ...", file=sys.stderr)
            result = run_variant(variant, plan, timeout=240, pin=args.pin)
            if not args.pin and variant.kind in PINNED_CPS64 and isinstance(result, dict):
                print(f"round {round_ + 1}/{rounds}: {variant.name}, 64 in flight, pinned ...",
                      file=sys.stderr)
                pinned = run_variant(variant, plan, timeout=240, only_cps64=True, pin=True)
                result["cps64_os"] = result.pop("cps64", None)
                if isinstance(pinned, dict) and "cps64" in pinned:
                    result["cps64"] = pinned["cps64"]
                else:
                    result["errors"].append(f"64 in flight, pinned: {pinned}")
            runs.setdefault(variant.name, []).append(result)
            print(f"  {result}", file=sys.stderr)
    counts: dict[str, float | str] = {}
    if not args.quick:
        for kind in ("rpc", "floor"):
            print(f"counting the instructions of a tiny call: {kind} ...", file=sys.stderr)
            counts[kind] = instructions_per_call(kind)
    kinds = {v.name: v.kind for v in VARIANTS}
    rows = {name: (combine_pair(results, PAIRED[kinds[name]]) if kinds[name] in PAIRED
                   else combine(results))
            for name, results in runs.items()}
    write_results(args.output, plan, rows, " ".join(["python", *sys.argv]),
                  time.perf_counter() - started, load_before, runs, pin=args.pin,
                  counts=counts)


if __name__ == "__main__":
    main()
