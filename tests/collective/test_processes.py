"""Collectives across real processes on loopback, over tcp:// and ucx://.

The test process serves the rendezvous on a port it got from the kernel,
then starts the ranks; each rank checks its results against NumPy and
reports in JSON lines (tests/collective/_worker.py).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from .. import _ranks as ranks

ROOT = Path(__file__).resolve().parents[2]
HAS_UCX = importlib.util.find_spec("ucxx") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None

LISTEN = {
    "tcp": "tcp://127.0.0.1:0",
    "ucx": pytest.param("ucx://127.0.0.1:0", id="ucx",
                        marks=pytest.mark.skipif(not HAS_UCX, reason="ucxx is not installed")),
}


async def run_ranks(scenario: str, world: int, listen: str,
                    timeout: float = 100) -> tuple[list[dict[str, Any]], list[int], list[str]]:
    """Start ``world`` ranks of ``scenario``; their JSON reports and exit codes."""

    async def spawn(rank: int, master: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.collective._worker", scenario, str(rank),
            str(world), master, listen, cwd=ROOT,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )

    outputs, codes = await ranks.run_ranks(world, spawn, timeout)
    reports = []
    for stdout, _ in outputs:
        for line in stdout.decode().splitlines():
            if line.startswith("{"):
                reports.append(json.loads(line))
    return reports, codes, [e.decode() for _, e in outputs]


@pytest.mark.slow
@pytest.mark.parametrize("listen", list(LISTEN.values()), ids=list(LISTEN))
@pytest.mark.parametrize("world", [2, 3, 4, 5])
async def test_every_operation_matches_numpy(world: int, listen: str) -> None:
    reports, codes, errors = await run_ranks("ops", world, listen, timeout=110)
    assert codes == [0] * world, "\n".join(e[-3000:] for e in errors)
    assert sorted(r["rank"] for r in reports if r.get("ok")) == list(range(world))
    assert all(r["checks"] > 100 for r in reports)


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
async def test_torch_tensors() -> None:
    reports, codes, errors = await run_ranks("torch", 3, "tcp://127.0.0.1:0")
    assert codes == [0] * 3, "\n".join(e[-3000:] for e in errors)
    assert len([r for r in reports if r.get("ok")]) == 3


@pytest.mark.parametrize("listen", list(LISTEN.values()), ids=list(LISTEN))
async def test_point_to_point_and_subgroups(listen: str) -> None:
    reports, codes, errors = await run_ranks("p2p", 4, listen)
    assert codes == [0] * 4, "\n".join(e[-3000:] for e in errors)
    by_rank = {r["rank"]: r for r in reports}
    assert sorted(by_rank) == [0, 1, 2, 3]
    assert [by_rank[r]["subgroup_rank"] for r in range(4)] == [0, 0, 1, 1]
    assert all(r["subgroup_size"] == 2 for r in reports)
    # One host: every rank is on it.
    assert [sorted(ranks) for ranks in by_rank[0]["topology"].values()] == [[0, 1, 2, 3]]


async def test_mismatched_operations_name_the_rank() -> None:
    reports, codes, errors = await run_ranks("mismatch", 3, "tcp://127.0.0.1:0")
    assert codes == [0] * 3, "\n".join(e[-3000:] for e in errors)
    failures = [r for r in reports if "error" in r]
    assert len(failures) == 3, reports
    # The rank that hears the odd one out names it; the others learn through rank 0.
    assert all(r["error"] == "MismatchError" for r in failures), failures
    assert all(r["ranks"] == [2] for r in failures), failures
    assert all("rank 2 called #0 broadcast" in r["text"] for r in failures)
    assert sorted(r["again"] for r in reports if "again" in r) == ["MismatchError"] * 3


async def test_deadline_names_the_rank_that_did_not_come() -> None:
    reports, codes, errors = await run_ranks("deadline", 3, "tcp://127.0.0.1:0")
    assert codes == [0] * 3, "\n".join(e[-3000:] for e in errors)
    failures = [r for r in reports if "error" in r]
    assert len(failures) == 2, reports
    for failure in failures:
        assert failure["error"] == "CollectiveTimeout", failure
        assert failure["ranks"] == [2], failure
        assert "rank 2 is at no operation" in failure["text"]
        assert failure["seconds"] < 10


@pytest.mark.parametrize("listen", list(LISTEN.values()), ids=list(LISTEN))
async def test_a_dead_rank_fails_the_others_promptly(listen: str) -> None:
    reports, codes, errors = await run_ranks("dies", 3, listen)
    assert codes[:2] == [0, 0], "\n".join(e[-3000:] for e in errors)
    assert codes[2] == 3
    failures = [r for r in reports if "error" in r]
    assert len(failures) == 2, reports
    for failure in failures:
        assert failure["error"] == "RankFailedError", failure
        assert failure["ranks"] == [2], failure
        # Far inside the 60 s deadline: the failure is detected, not waited out.
        assert failure["seconds"] < 10, failure
    print(f"dead rank over {listen}: the others failed after "
          + ", ".join(f"{f['seconds'] * 1000:.0f} ms" for f in failures))
