"""bench/rpc.py --instructions: instructions per tiny call, counted by
valgrind's callgrind with the client and the server in one process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from _rpc_bare import _FloorCaller, _FloorEcho
from _rpc_variants import CONCURRENCY, FLOOR, _Caller, _RPCCaller, _start_rpc

#: The script that runs the counted calls (``--count-calls KIND CALLS``).
_SCRIPT = Path(__file__).with_name("rpc.py")

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
    import os
    import shutil
    import subprocess

    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return "valgrind is not installed"
    # numpy's BLAS and OpenMP thread pools would start threads of their own,
    # whose spinning adds to the count a varying amount: one thread each.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    totals = []
    for calls in COUNT_RUNS:
        run = subprocess.run(
            [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             str(_SCRIPT), "--count-calls", kind, str(calls)],
            capture_output=True, text=True, timeout=900, env=env)
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
    for kind, name in (("rpc", "tensorwire RPC tcp://"), ("floor", FLOOR)):
        value = counts.get(kind)
        out.append(f"| {name} | "
                   + (f"{value:,.0f}" if isinstance(value, float) else f"not counted: {value}")
                   + " |")
    return out


# --- orchestration -----------------------------------------------------------

