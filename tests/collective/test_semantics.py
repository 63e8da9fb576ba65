"""What a torch.distributed user relies on: the same bits on every rank (NaN
signs and signed zeros too), bitwise reductions of integers, no silent switch
of a forced algorithm, and point-to-point messages delivered by tag."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorwire.collective import GroupConfig, ReduceOp, SyncGroup
from tensorwire.errors import InvalidArgument

from ._threaded import each, thread_ranks

#: Small enough thresholds that 64 floats go by the ring when asked.
CONFIG = GroupConfig(timeout=20, rendezvous_timeout=20, small_bytes=128,
                     hierarchical_bytes=None)


def awkward(rank: int, count: int) -> np.ndarray[Any, Any]:
    """Floats where the order of operands shows: NaNs of both signs and
    payloads, zeros of both signs, and values whose sums round."""
    rng = np.random.default_rng(rank)
    x = rng.standard_normal(count).astype(np.float32) * np.float32(1e3)
    bits = x.view(np.uint32)
    bits[0::7] = np.where(rng.random(len(bits[0::7])) < 0.5, 0x7FC0_0001 + rank,
                          0xFFC0_0002 + rank)
    x[3::7] = np.float32(0.0) if rank % 2 else np.float32(-0.0)
    return x


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("algorithm", ["tree", "ring"])
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
async def test_every_rank_gets_the_same_bits(world: int, algorithm: str, op: str) -> None:
    async with thread_ranks(world, CONFIG) as groups:
        results = each(groups, lambda g: g.allreduce(awkward(g.rank, 64), op,
                                                     algorithm=algorithm).view(np.uint32))
    for rank, got in enumerate(results[1:], start=1):
        differ = np.flatnonzero(got != results[0])
        assert differ.size == 0, (rank, differ[:5])


@pytest.mark.parametrize(("op", "want"), [("band", np.bitwise_and.reduce),
                                          ("bor", np.bitwise_or.reduce),
                                          ("bxor", np.bitwise_xor.reduce)])
@pytest.mark.parametrize("algorithm", ["tree", "ring"])
async def test_bitwise_reductions_of_integers(op: str, want: Any, algorithm: str) -> None:
    def data(rank: int) -> np.ndarray[Any, Any]:
        return np.random.default_rng(rank).integers(0, 1 << 30, 64).astype(np.int32)

    async with thread_ranks(3, CONFIG) as groups:
        results = each(groups, lambda g: g.allreduce(data(g.rank), ReduceOp(op),
                                                     algorithm=algorithm))
    expected = want(np.stack([data(r) for r in range(3)]), axis=0)
    for got in results:
        np.testing.assert_array_equal(got, expected)
    async with thread_ranks(2, CONFIG) as groups:
        with pytest.raises(InvalidArgument, match="integer"):
            groups[0].allreduce(np.zeros(3, np.float32), "bxor")


async def test_forcing_the_ring_on_too_few_elements_raises() -> None:
    async with thread_ranks(3, CONFIG) as groups:
        g = groups[0]
        with pytest.raises(InvalidArgument, match="ring"):
            g.allreduce(np.zeros(2), algorithm="ring")
        with pytest.raises(InvalidArgument, match="ring"):
            g.reduce(np.zeros(2), 0, algorithm="ring")
        # Still usable: the check comes before anything is queued.
        results = each(groups, lambda g: g.allreduce(np.ones(3), algorithm="ring"))
        np.testing.assert_array_equal(results[0], np.full(3, 3.0))


async def test_receives_are_matched_by_tag() -> None:
    def work(g: SyncGroup) -> Any:
        if g.rank == 0:
            g.send(np.full(4, 1.0), 1, tag=1)
            g.send(np.full(4, 2.0), 1, tag=2)
            g.send(np.full(2, 3.0), 1, tag=3)
            return None
        two = g.recv(np.empty(4), 0, tag=2).copy()
        three = g.recv(np.empty(2), 0, tag=3).copy()
        one = g.recv(np.empty(4), 0, tag=1).copy()
        return one, two, three

    async with thread_ranks(2, CONFIG) as groups:
        _, (one, two, three) = each(groups, work)
    np.testing.assert_array_equal(one, np.full(4, 1.0))
    np.testing.assert_array_equal(two, np.full(4, 2.0))
    np.testing.assert_array_equal(three, np.full(2, 3.0))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("algorithm", ["tree", "ring"])
async def test_16_bit_torch_tensors_reduce_with_torch(dtype: str, algorithm: str) -> None:
    torch = pytest.importorskip("torch")
    kind = getattr(torch, dtype)

    def data(rank: int) -> Any:
        return torch.arange(64, dtype=torch.float32).mul(0.25 * (rank + 1)).to(kind)

    async with thread_ranks(3, CONFIG) as groups:
        results = each(groups, lambda g: g.allreduce(data(g.rank), algorithm=algorithm))
        maxima = each(groups, lambda g: g.allreduce(data(2 - g.rank), "max",
                                                    algorithm=algorithm))
    want = data(0).float() + data(1).float() + data(2).float()
    for got, top in zip(results, maxima, strict=True):
        assert got.dtype == kind
        # Each partial sum rounds to the 16-bit type: within its precision.
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=0.1)
        assert torch.equal(got, results[0])
        assert torch.equal(top, data(2))
