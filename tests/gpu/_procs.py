"""Processes of the GPU tests, and what UCX says about them.

Each test starts its peers as separate processes (tests/gpu/_peer.py), so
device memory crosses a process boundary as it does between a trainer and
its servers. UCX_PROTO_INFO makes UCX print which protocol and transport
it chose for each kind of memory; the tests read those tables from the
peers' output.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_UCX = importlib.util.find_spec("ucxx") is not None

#: A file to append the peers' UCX tables to, for a person to read (gpu-check sets it).
EVIDENCE = os.environ.get("TENSORWIRE_GPU_EVIDENCE")

_RANGE = re.compile(r"^\s*\d+(\.\d+)?[KMGT]?\s*\.\.\s*(inf|\d+(\.\d+)?[KMGT]?)\s*$")


def peer_env() -> dict[str, str]:
    """The peers' environment: UCX prints its protocol tables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_PROTO_INFO"] = "y"
    env["UCX_LOG_LEVEL"] = "info"  # where UCX prints those tables
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gpu_or_skip(torch_only: bool = False) -> None:
    """Skip unless this machine has a CUDA device (and ucxx where needed)."""
    if torch_only:
        torch = pytest.importorskip("torch", reason="torch is not installed")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA device")
        return
    from .._cuda import cupy_or_skip

    cupy_or_skip()


async def start(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.gpu._peer", *args, cwd=ROOT, env=peer_env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


async def first_json(child: asyncio.subprocess.Process, timeout: float = 60) -> dict[str, Any]:
    """The first JSON line the child prints; the lines before it are kept."""
    assert child.stdout is not None
    seen: list[str] = []
    async with asyncio.timeout(timeout):
        while True:
            line = (await child.stdout.readline()).decode(errors="replace")
            if not line:
                raise AssertionError("peer ended before it was ready:\n" + "".join(seen)[-4000:])
            if line.startswith("{"):
                found: dict[str, Any] = json.loads(line)
                found["_before"] = "".join(seen)
                return found
            seen.append(line)


async def serve_and_run(server: Sequence[str], client: Callable[[str], Sequence[str]]
                        ) -> tuple[str, str]:
    """Start the peer ``server``, then ``client(its address)``; once the client
    is done, stop the server (SIGTERM) and return the output of each."""
    child = await start(*server)
    try:
        ready = await first_json(child)
        peer = await start(*client(ready["address"]))
        client_out, _ = await asyncio.wait_for(peer.communicate(), 100)
        assert peer.returncode == 0, client_out.decode(errors="replace")[-4000:]
        child.send_signal(signal.SIGTERM)
        server_out, _ = await asyncio.wait_for(child.communicate(), 30)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    return (ready["_before"] + server_out.decode(errors="replace"),
            client_out.decode(errors="replace"))


def reports(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def failed(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in found if "check" in r and not r["ok"]]


def proto_tables(output: str) -> list[tuple[str, list[list[str]]]]:
    """UCX's protocol tables in ``output``: (header, rows of [range, protocol, transport])."""
    tables: list[tuple[str, list[list[str]]]] = []
    for line in output.splitlines():
        if "|" not in line:
            continue
        cells = [c.strip() for c in line[line.index("|"):].strip().strip("|").split("|")]
        if cells and _RANGE.match(cells[0]):
            if tables:
                tables[-1][1].append(cells)
        elif len(cells) >= 2:
            tables.append((" | ".join(cells), []))
    return tables


def cuda_transports(output: str) -> set[str]:
    """The transports UCX chose for messages from or into CUDA memory."""
    chosen: set[str] = set()
    for header, rows in proto_tables(output):
        if "cuda" not in header.lower():
            continue
        for row in rows:
            chosen.update(re.findall(r"\b(cuda_ipc|cuda_copy|gdr_copy|rc_\w+|tcp|posix|sysv|cma)"
                                     r"\b", " ".join(row[1:])))
    return chosen


def keep_evidence(name: str, output: str) -> None:
    """Append the UCX tables of ``output`` to the evidence file, if one is asked for."""
    if EVIDENCE:
        tables = [line for line in output.splitlines() if "|" in line or "+--" in line]
        with Path(EVIDENCE).open("a") as file:
            file.write(f"== {name}\n" + "\n".join(tables) + "\n")
