"""bench/rpc.py's variants: the plan, the variant table, and the tensorwire
and grpc.aio servers and callers (the bare ceilings are in _rpc_bare.py).

Private names keep their leading underscore: these modules are bench/rpc.py
split by what is inside, not a library.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
from _spin_setting import tcp_spin

RESULTS = Path(__file__).parent / "results" / "rpc.md"
#: The names of the ceilings (the targets look them up).
FLOOR = "bare Protocol echo (coalescing)"
SOCKET = "bare blocking socket"
UCXX = "raw ucxx (blocking mode)"
#: The RPC's calls/s with 64 in flight taking turns with the bare echo's,
#: all four processes on one CPU (its target reads this pair).
PAIRED_ONE_CPU = "paired tcp:// and bare Protocol echo, one CPU"
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
    # Calls/s with 64 in flight taking turns with the bare echo on one CPU
    # ("pair-floor"): slices of this many seconds, this many per side.
    slices: int = 16
    slice_seconds: float = 0.25

    @classmethod
    def quick(cls) -> Plan:
        return cls(warmup_calls=200, latency_calls=2000, seconds=1.0, reps=(40, 3, 2),
                   slices=6, slice_seconds=0.2)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    # "rpc", "raw", "grpc", "floor", "socket", "ucxx", "pair", or "pair-" and the
    # kind of a peer in processes of its own ("pair-grpc", "pair-socket",
    # "pair-ucxx", "pair-floor")
    kind: str
    url: str  # the server's listen URL ("" for the others)
    # A placement of its own (see ``placement``), whatever --pin says.
    placed: str | None = None

    @property
    def multiplexed(self) -> bool:
        """Whether it has call ids, so that several calls may be in flight."""
        return self.kind not in ONE_AT_A_TIME

    @property
    def tiny_only(self) -> bool:
        """Whether it echoes tiny records only (no tensors)."""
        return self.kind == "floor"


VARIANTS = [
    Variant("tensorwire RPC tcp://", "rpc", "tcp://127.0.0.1:0"),
    Variant("tensorwire RPC ucx://", "rpc", "ucx://127.0.0.1:0"),
    Variant("raw transport tcp://", "raw", "tcp://127.0.0.1:0"),
    Variant("raw transport ucx://", "raw", "ucx://127.0.0.1:0"),
    Variant("grpc.aio", "grpc", ""),
    Variant(FLOOR, "floor", ""),
    Variant(SOCKET, "socket", ""),
    Variant(UCXX, "ucxx", ""),
    Variant("paired tcp://", "pair", "tcp://127.0.0.1:0"),
    Variant("paired ucx://", "pair", "ucx://127.0.0.1:0"),
    Variant("paired tcp:// and grpc.aio", "pair-grpc", "tcp://127.0.0.1:0"),
    Variant("paired ucx:// and grpc.aio", "pair-grpc", "ucx://127.0.0.1:0"),
    Variant("paired tcp:// and bare socket", "pair-socket", "tcp://127.0.0.1:0"),
    Variant("paired ucx:// and raw ucxx", "pair-ucxx", "ucx://127.0.0.1:0"),
    Variant(PAIRED_ONE_CPU, "pair-floor", "tcp://127.0.0.1:0", placed="one"),
]
#: The kinds without call ids: one call in flight at a time.
ONE_AT_A_TIME = ("raw", "socket", "ucxx")
#: The paired variant kinds, each with the side its RPC takes turns with: its raw
#: transport (both served from one process), or a peer in a server process
#: and a client process of its own (``PEERS``).
PAIRED = {"pair": "raw", "pair-grpc": "grpc", "pair-socket": "socket", "pair-ucxx": "ucxx",
          "pair-floor": "floor"}
#: The paired kinds whose other side is such a peer.
PEERS = ("pair-grpc", "pair-socket", "pair-ucxx", "pair-floor")
#: The kinds whose calls/s with 64 in flight run again in pairs of their own,
#: server and client on one CPU and on two different CPUs (see
#: ``write_results``); with --pin only on one (everything else is on two).
PINNED_CPS64 = ("rpc", "grpc", "floor")
#: The variants that run again beside one busy-looping process per core
#: (--busy), tiny-call latency only.
BUSY_VARIANTS = ("tensorwire RPC tcp://", "tensorwire RPC ucx://", FLOOR, UCXX)
#: The floor variant's record: call id, value.
FLOOR_RECORD = struct.Struct("<QQ")



# --- shared pieces -----------------------------------------------------------


def _transport_config(url: str) -> Any:
    from tensorwire.transports import TransportConfig, UCXOptions

    if url.startswith("ucx://"):
        return TransportConfig(ucx=UCXOptions())  # UCX's default settings on this host
    return TransportConfig(tcp_spin=tcp_spin())


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



def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def placement(where: str) -> tuple[int | None, int | None]:
    """The CPUs for the server and the client process (None: the OS decides).

    ``where``: "os", "one" (both on the first allowed CPU) or "two" (the
    server on the first, the client on the second). On this 2-vCPU host a
    process pair left to the scheduler sometimes shares one vCPU and
    sometimes not, and large echoes run about twice as fast when it does
    (cache-hot loopback copies): the same code measured about 2 or 4 GB/s
    at 1 MiB from one process pair to the next. Pinning gives every
    variant the same placement.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if where == "one":
        return cpus[0], cpus[0]
    if where != "two" or len(cpus) < 2:
        return None, None
    return cpus[0], cpus[1]


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



def _check_echo(arr: np.ndarray[Any, Any], back: np.ndarray[Any, Any]) -> None:
    if back.nbytes != arr.nbytes or back[-1] != arr[-1]:
        raise RuntimeError("the echo came back different")



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

    async def calls_per_second(self, tasks: int, seconds: float) -> float:
        """Tiny calls per second with ``tasks`` tasks calling for ``seconds``."""
        deadline = time.perf_counter() + seconds
        done = [0] * tasks

        async def worker(index: int) -> None:
            clock = time.perf_counter
            n = 0
            while clock() < deadline:
                await self.tiny()
                n += 1
            done[index] = n

        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(tasks)))
        return sum(done) / (time.perf_counter() - start)



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
