"""bench/rpc.py's measuring: the server and client processes, what a client
measures, and one variant's run (with its placement and busy neighbours)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from _rpc_bare import CALLERS, SERVERS
from _rpc_variants import (
    CONCURRENCY,
    PAIRED,
    PEERS,
    MiB,
    Plan,
    Variant,
    _Caller,
    _grpc_server,
    _GRPCCaller,
    _pair_server,
    _pin,
    _Profile,
    _raw_server,
    _RawCaller,
    _rpc_server,
    _RPCCaller,
    _run_loop,
    placement,
)


def server_main(ready: Any, stop: Any, variant: Variant, profile: str | None,
                cpu: int | None = None) -> None:
    _pin(cpu)
    serve = {"rpc": _rpc_server, "raw": _raw_server, "grpc": _grpc_server,
             "grpc-peer": _grpc_server, "pair": _pair_server, **SERVERS}[variant.kind]
    with _Profile(profile):
        _run_loop(variant.kind, lambda: serve(ready, stop, variant))



class _TurnTaker(_Caller):
    """A caller in a process of its own (``turn_taker_main``), one turn per
    request over a pipe, timed there: the pair's other client, in a process
    of its own as its users run it (grpc.aio's threads in the RPC client's
    process slowed the RPC)."""

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

    async def calls_per_second(self, tasks: int, seconds: float) -> float:
        return await self._ask("cps", tasks, seconds)

    async def close(self) -> None:
        self.conn.send(("stop",))


def turn_taker_main(conn: Any, address: str, cpu: int | None, kind: str) -> None:
    """The pair's other client (uvloop): a grpc.aio client, or the ceiling
    of ``kind`` ("socket", "ucxx"), taking the turns ``_TurnTaker`` asks for."""
    _pin(cpu)
    cls = {"grpc": _GRPCCaller, **CALLERS}[kind]

    async def main() -> None:
        try:
            caller = await cls().open(address)
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
                    elif command[0] == "cps":
                        _, tasks, seconds = command
                        elapsed = await caller.calls_per_second(tasks, seconds)  # a rate
                    else:
                        return
                except Exception as exc:
                    conn.send(("error", f"{type(exc).__name__}: {exc}"))
                    continue
                conn.send(("ok", elapsed))
        finally:
            await caller.close()

    with contextlib.suppress(EOFError, OSError):
        _run_loop(_peer_kind(kind), main)


def _peer_kind(other: str) -> str:
    """The server kind of a pair's peer: grpc.aio on uvloop ("grpc-peer", as
    the RPC), or the ceiling's own server."""
    return "grpc-peer" if other == "grpc" else other



async def _measure(caller: _Caller, variant: Variant, plan: Plan,
                   only: str | None) -> dict[str, Any]:
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
        out["cps1"] = await caller.calls_per_second(1, plan.seconds)

    async def cps64() -> None:
        out["cps64"] = await caller.calls_per_second(CONCURRENCY, plan.seconds)

    if only == "cps64":
        await section("64 in flight", cps64)
        return out
    if only == "tiny":
        await section("latency", latency)
        return out
    await section("latency", latency)
    await section("1 in flight", cps1)
    if variant.multiplexed:
        await section("64 in flight", cps64)

    bandwidth: dict[int, float] = {}
    if variant.tiny_only:
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


class _Servers:
    """The servers of a pair's two sides (``{side: pid}``), of which only
    the one whose side takes the turn runs: the other is stopped
    (``SIGSTOP``) until its side's turn comes. raw ucxx's blocking mode
    polls while it waits for the next message (its idle server took 2.00 s
    of CPU in 2 s), and beside the RPC's turns that took a CPU of this
    2-core host from the RPC: its paired tiny-call latency read 2.97x raw
    ucxx's with the ceiling's server polling, 2.51x with it stopped (five
    rounds each)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.running: str | None = None

    def turn(self, side: str) -> None:
        """Let ``side``'s server run and stop the others (from the next
        turn on: the signals go before the turn is timed)."""
        if side == self.running or side not in self.pids:
            return
        os.kill(self.pids[side], signal.SIGCONT)
        for other, pid in self.pids.items():
            if other != side:
                os.kill(pid, signal.SIGSTOP)
        self.running = side


def continue_all(pids: Iterable[int]) -> None:
    """Every one of ``pids`` running again (stopped or not; gone is fine)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def _measure_pair(callers: dict[str, _Caller], plan: Plan,
                        servers: _Servers) -> dict[str, Any]:
    """Tiny-call latency and echo bandwidth of the RPC and of its raw
    transport, taking turns call by call (who goes first alternates too);
    the server of the side whose turn it is not is stopped (``_Servers``)."""
    out: dict[str, Any] = {"errors": []}
    names = list(callers)

    def turns(i: int) -> list[str]:
        return names if i % 2 == 0 else names[::-1]

    async def tiny(name: str) -> float:
        servers.turn(name)
        return await callers[name].time_tiny()

    async def echo(name: str, arr: np.ndarray[Any, Any], check: bool = False) -> float:
        servers.turn(name)
        return await callers[name].time_echo(arr, check=check)

    for _ in range(plan.warmup_calls):
        for name in names:
            await tiny(name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(plan.latency_calls):
        for name in turns(i):
            samples[name].append(await tiny(name))
    for name in names:
        ordered = sorted(samples[name])
        out[name] = {"p50": ordered[len(ordered) // 2], "bw": {}}
    for size, reps in zip(plan.sizes, plan.reps, strict=True):
        arr = np.arange(size // 4, dtype=np.float32)
        times: dict[str, list[float]] = {name: [] for name in names}
        try:
            for name in names:
                await echo(name, arr, check=True)  # warm-up
            for i in range(reps):
                for name in turns(i):
                    times[name].append(await echo(name, arr))
        except Exception as exc:  # one broken size does not hide the others
            out["errors"].append(f"{size // MiB} MiB echo: {type(exc).__name__}: {exc}")
            continue
        for name in names:
            out[name]["bw"][size] = 2 * size / statistics.median(times[name])
    return out


async def _measure_pair_cps(callers: dict[str, _Caller], plan: Plan,
                            servers: _Servers) -> dict[str, Any]:
    """Calls/s with 64 in flight of the RPC and of the bare echo, taking
    turns slice by slice (who goes first alternates), the idle side's server
    stopped (``_Servers``); ``ratios``: each pair of slices' RPC over echo."""
    names = list(callers)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # a slice each to warm up, not counted
        servers.turn(name)
        await callers[name].calls_per_second(CONCURRENCY, plan.slice_seconds)
    for i in range(plan.slices):
        for name in (names if i % 2 == 0 else names[::-1]):
            servers.turn(name)
            rates[name].append(
                await callers[name].calls_per_second(CONCURRENCY, plan.slice_seconds))
    rpc, other = names
    out: dict[str, Any] = {name: {"cps64": statistics.median(rates[name])} for name in names}
    out["ratios"] = [a / b for a, b in zip(rates[rpc], rates[other], strict=True)]
    out["errors"] = []
    return out


def client_main(done: Any, address: Any, variant: Variant, plan: Plan,
                profile: str | None, only: str | None, cpu: int | None = None,
                peer: Any = None, server_pids: dict[str, int] | None = None) -> None:
    """``peer``: the pipe to the turn taker of a pair with a peer (``PEERS``);
    ``server_pids``: that pair's servers by side (``_Servers``)."""
    _pin(cpu)

    async def main() -> dict[str, Any]:
        if variant.kind in PAIRED:
            rpc_address, other_address = address
            other = await (_RawCaller() if variant.kind == "pair"
                           else _TurnTaker(peer)).open(other_address)
            callers: dict[str, _Caller] = {"rpc": await _RPCCaller().open(rpc_address),
                                           PAIRED[variant.kind]: other}
            servers = _Servers(server_pids or {})
            measure = _measure_pair_cps if variant.kind == "pair-floor" else _measure_pair
            try:
                return await measure(callers, plan, servers)
            finally:
                continue_all(servers.pids.values())
                for each in callers.values():
                    await each.close()
        cls = {"rpc": _RPCCaller, "raw": _RawCaller, "grpc": _GRPCCaller,
               **CALLERS}[variant.kind]
        caller = await cls().open(address)
        try:
            return await _measure(caller, variant, plan, only)
        finally:
            await caller.close()

    try:
        with _Profile(profile):
            result = _run_loop(variant.kind, main)
        done.put(("ok", result))
    except BaseException as exc:
        done.put(("error", f"{type(exc).__name__}: {exc}"))


# --- instructions per call -------------------------------------------------------



def run_variant(variant: Variant, plan: Plan, timeout: float, *,
                profile_dir: Path | None = None, only: str | None = None,
                where: str = "os", busy: bool = False) -> dict[str, Any] | str:
    """The client's results, or why the variant did not run.

    ``only``: "cps64" or "tiny" to measure just that; ``where``: the
    placement (see ``placement``); ``busy``: with one busy-looping process
    per allowed CPU beside the pair, for at most ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    stop, done = ctx.Queue(), ctx.Queue()
    srv_prof = str(profile_dir / "server.prof") if profile_dir else None
    cli_prof = str(profile_dir / "client.prof") if profile_dir else None
    srv_cpu, cli_cpu = placement(where)
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

    loopers = busy_loopers(ctx, timeout) if busy else []
    try:
        peer = None
        server_pids: dict[str, int] = {}
        if variant.kind in PEERS:
            # The RPC and its peer each in processes of their own: grpc.aio's
            # threads beside the RPC in one process slowed the RPC's echo
            # right after a gRPC echo by about a fifth (64 MiB over ucx://).
            other = PAIRED[variant.kind]
            rpc_address = serve(dataclasses.replace(variant, kind="rpc"), srv_prof)
            server_pids["rpc"] = procs[-1].pid
            other_address = serve(Variant(variant.name, _peer_kind(other), ""), None)
            server_pids[other] = procs[-1].pid
            address = None if None in (rpc_address, other_address) else (
                rpc_address, other_address)
            if address is not None:
                peer, theirs = ctx.Pipe()
                start(turn_taker_main, theirs, other_address, cli_cpu, other)
                theirs.close()  # the child has its own: its recv() ends with the client
        else:
            address = serve(variant, srv_prof)
        if address is None:
            codes = [p.exitcode for p in procs if p.exitcode is not None]
            return "the server did not start within 60 s" + (
                f" (exit code {codes[0]})" if codes else "")
        start(client_main, done, address, variant, plan, cli_prof, only, cli_cpu, peer,
              server_pids)
        if peer is not None:
            peer.close()
        try:
            _status, value = done.get(timeout=timeout)
        except queue.Empty:
            return f"timed out after {timeout:.0f} s"
        return value  # the results, or the error text
    finally:
        # A pair's client stops the server whose side waits; a client that
        # died may have left one stopped.
        continue_all(proc.pid for proc in procs)
        for _ in range(servers):
            stop.put("stop")
        for proc in reversed(procs):
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for looper in loopers:
            looper.kill()
            looper.join(5)


# --- the report ----------------------------------------------------------------


# --- busy neighbours -------------------------------------------------------------


def _busy_loop(cpu: int, seconds: float) -> None:
    """Spin on ``cpu`` for at most ``seconds`` (the parent kills it sooner)."""
    _pin(cpu)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def busy_loopers(ctx: Any, seconds: float) -> list[Any]:
    """One busy-looping process per CPU this process may use, each pinned to
    its CPU and bounded to ``seconds``: a host whose cores are all busy."""
    loopers = []
    for cpu in sorted(os.sched_getaffinity(0)):
        proc = ctx.Process(target=_busy_loop, args=(cpu, seconds), daemon=True)
        proc.start()
        loopers.append(proc)
    return loopers

