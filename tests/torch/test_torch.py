"""tensorwire.torch against torch itself, in real processes on loopback.

Each scenario runs as ranks in processes of their own
(tests/torch/_worker.py); torch.distributed runs beside it on gloo, which
is the oracle (DDP over gloo, one process on the concatenated batch, plain
SGD applied locally).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .. import _ranks as ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed")

ROOT = Path(__file__).resolve().parents[2]


async def run(scenario: str, world: int, tmp_path: Path, env: dict[str, str] | None = None,
              listen: str = "tcp://127.0.0.1:0") -> tuple[list[dict[str, Any]], str, list[int]]:
    """Start ``world`` ranks of ``scenario``: their reports, their output, their exit codes.

    Not through ``launch``, which stops every rank when one fails: the
    scenario with a dying rank needs the others to go on and report.
    """
    async def spawn(rank: int, master: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.torch._worker", scenario, cwd=ROOT,
            env={**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world),
                 "TENSORWIRE_MASTER": master, "TENSORWIRE_MASTER_HOSTED": "1",
                 "TENSORWIRE_LISTEN": listen,
                 "TORCH_STORE": str(tmp_path / "store")},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)

    outputs, codes = await ranks.run_ranks(world, spawn, 110)
    reports = []
    log = ""
    for rank, (stdout, _) in enumerate(outputs):
        for line in stdout.decode(errors="replace").splitlines():
            log += f"[rank {rank}] {line}\n"
            if line.startswith("{"):
                reports.append(json.loads(line))
    return sorted(reports, key=lambda r: r["rank"]), log, codes


async def run_ok(scenario: str, world: int, tmp_path: Path, env: dict[str, str] | None = None,
                 listen: str = "tcp://127.0.0.1:0") -> list[dict[str, Any]]:
    """``run``, with every rank exiting 0 and reporting: their reports."""
    reports, log, codes = await run(scenario, world, tmp_path, env, listen)
    assert codes == [0] * world, log[-4000:]
    assert len(reports) == world, log[-4000:]
    return reports


async def test_ddp_hook_ends_with_gloos_weights(tmp_path: Path) -> None:
    reports = await run_ok("ddp", 3, tmp_path)
    for r in reports:
        assert r["moved"] > 1e-2  # the runs trained: the comparison means something
        assert r["diff"] < 1e-5, r
        assert r["same_bits"], r
        # Every step's first bucket was reduced before DDP handed over the
        # last: the hook's allreduces run during the backward pass. (DDP's
        # first step, before it rebuilds its buckets, may hand all over as
        # one.)
        assert r["buckets"] >= 2, r
        assert len(r["first_back_before_last"]) >= 11 and all(r["first_back_before_last"]), r


async def test_ddp_hook_with_a_hierarchical_group_ends_with_gloos_weights(
        tmp_path: Path) -> None:
    # Four ranks on two emulated hosts (GroupConfig.topology): each bucket
    # reduced within the hosts, between their leaders, and back.
    reports = await run_ok("ddp_hierarchical", 4, tmp_path)
    for r in reports:
        assert r["moved"] > 1e-2, r
        assert r["diff"] < 1e-5, r
        assert r["same_bits"], r
        # Every bucket of the 11 steps after DDP rebuilt its buckets.
        assert r["hierarchical"] >= 11 * r["buckets"], r


@pytest.mark.gpu
async def test_ddp_hook_on_cuda_buckets_over_ucx(tmp_path: Path) -> None:
    # The same oracle with the model on the GPU: DDP's buckets are CUDA
    # tensors, which the hook reduces on the device over ucx://.
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed")
    reports = await run_ok("ddp_cuda", 2, tmp_path, listen="ucx://127.0.0.1:0")
    for r in reports:
        assert r["moved"] > 1e-2
        assert r["diff"] < 1e-5, r
        assert r["same_bits"], r


@pytest.mark.gpu
async def test_compressed_and_ps_hooks_take_cuda_buckets(tmp_path: Path) -> None:
    # Their codecs and the shards' optimizers run in NumPy: the hooks copy a
    # CUDA bucket to host memory and the answer back, and train as on the CPU.
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from tensorwire import ps

    shard = await ps.serve("tcp://127.0.0.1:0")
    try:
        reports = await run_ok("cuda_staged", 2, tmp_path,
                               {"PS_ADDRESSES": shard.addresses[0]})
    finally:
        await shard.close(checkpoint=False)
    for r in reports:
        assert r["moved"] > 1e-2, r
        # The GPU's and the CPU's float sums may round apart, and fp16 can
        # carry that one step of its precision further.
        assert r["fp16"] < 1e-3, r
        assert r["ps"] < 1e-4, r


async def test_distributed_optimizer_matches_one_process(tmp_path: Path) -> None:
    reports = await run_ok("optimizer", 3, tmp_path)
    for r in reports:
        assert r["start_equal"], r
        assert r["diff"] < 1e-5, r
        assert r["state_equal"], r


async def test_distributed_optimizer_accumulates_backward_passes(tmp_path: Path) -> None:
    # Two backward passes a step, reduced once: the same weights as one
    # process on the concatenated batch. A third pass before step() would
    # add into gradients whose reduction is in flight: it raises.
    reports = await run_ok("accumulate", 2, tmp_path)
    for r in reports:
        assert r["moved"] > 1e-2, r
        assert r["diff"] < 1e-5, r
        assert "computed 3 times since the last step()" in r["raised"], r


@pytest.mark.parametrize("passes", [0, -1, 1.5, True, "2"])
def test_distributed_optimizer_refuses_a_bad_number_of_passes(passes: Any) -> None:
    import torch

    import tensorwire.torch as twt
    from tensorwire.errors import InvalidArgument

    sgd = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(InvalidArgument, match="backward_passes_per_step"):
        twt.DistributedOptimizer(sgd, None, backward_passes_per_step=passes)


async def test_ps_hook_matches_local_sgd(tmp_path: Path) -> None:
    from tensorwire import ps

    shards = [await ps.serve("tcp://127.0.0.1:0") for _ in range(2)]
    try:
        addresses = ",".join(s.addresses[0] for s in shards)
        reports = await run_ok("ps", 2, tmp_path, {"PS_ADDRESSES": addresses})
    finally:
        for shard in shards:
            await shard.close(checkpoint=False)
    for r in reports:
        assert r["params"] < 1e-5, r
        assert r["grads"] < 1e-5, r
        for job in ("params", "grads"):
            assert r[f"{job}_buckets"] >= 2, r  # so the first and last differ
            # Every step's first bucket was back from the shards before DDP
            # handed over the last: each bucket goes out during backward.
            # (DDP's first step, before it rebuilds its buckets, may hand
            # all over as one.)
            back = r[f"{job}_first_back_before_last"]
            assert len(back) >= 7 and all(back), r


async def test_allreduce_and_ps_hooks_over_ucx_in_one_process(tmp_path: Path) -> None:
    # ucx:// runs one UCX worker per process on one event loop: the PS
    # client runs on the group's loop thread (loop_of=group).
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed")
    from tensorwire import ps

    shard = await ps.serve("ucx://127.0.0.1:0")
    try:
        reports = await run_ok("ps_ucx", 2, tmp_path, {"PS_ADDRESSES": shard.addresses[0]},
                               listen="ucx://127.0.0.1:0")
    finally:
        await shard.close(checkpoint=False)
    for r in reports:
        assert r["group_listens"].startswith("ucx://"), r
        assert r["shards"] == [shard.addresses[0]], r
        assert r["shards"][0].startswith("ucx://"), r
        assert r["moved"] > 1e-2, r
        assert r["diff"] < 1e-5, r
        assert r["same_bits"], r
        assert r["ps"] < 1e-5, r


@pytest.mark.slow
async def test_compression_converges_with_fewer_bytes(tmp_path: Path) -> None:
    reports = await run_ok("compress", 3, tmp_path)
    for r in reports:
        plain, half, int8 = r["None"], r["fp16"], r["int8"]
        assert plain["accuracy"] > 0.85, r
        assert half["accuracy"] > plain["accuracy"] - 0.02, r
        assert int8["accuracy"] > plain["accuracy"] - 0.02, r
        # fp16 reduces by the same algorithm in half the bytes.
        assert half["bytes"] == plain["bytes"] // 2, r
        # int8 payloads do not add up, so each rank's goes to every other
        # rank (an allgather): one byte per element where float32 takes
        # four, plus a float64 scale per bucket (at most 4 buckets).
        floor = (len(reports) - 1) * r["elements"] * r["steps"]
        assert floor <= int8["bytes"] <= floor + (len(reports) - 1) * 4 * 8 * r["steps"], r


async def test_a_dead_rank_fails_the_others_backward(tmp_path: Path) -> None:
    reports, log, code = await run("kill", 3, tmp_path)
    assert code == [0, 0, 17], log[-4000:]
    assert [r["rank"] for r in reports] == [0, 1], log[-4000:]
    for r in reports:
        assert r["step"] == 3, r
        assert r["state_error"] == "RankFailedError", r
        assert "RankFailedError" in r["raised"] + r["message"], r
        assert r["seconds"] < 30, r  # the group's timeout
