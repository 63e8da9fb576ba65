"""Where each piece of each tensor lives: chunking and shard placement.

Pure arithmetic, no I/O: every worker computes the same placement from the
same tensor list, so no coordinator is needed.

Tensors are cut into chunks of at most ``chunk_bytes`` (equal pieces, at
element boundaries) and placed greedily, largest first, onto the shard that
carries the fewest bytes so far (Graham's LPT rule, which keeps the largest
shard within 4/3 of the optimum and in practice within a few percent when
chunks are small next to a shard's share). Ties break by name and shard
index, so the result depends on nothing but the input.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError
from ._arrays import array_module, like

__all__ = (
    "Chunk",
    "Placement",
    "TensorSpec",
    "balance",
    "chunk_tensors",
    "join_chunks",
    "place",
    "predicted_times",
    "relocate",
    "resize",
)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of one tensor the parameter server holds."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> TensorSpec:
        """The spec of ``array``."""
        return cls(name, tuple(int(n) for n in array.shape), array.dtype.str)


@dataclasses.dataclass(frozen=True, slots=True)
class Chunk:
    """Elements ``start:stop`` of the flattened tensor ``name``.

    ``key`` names the chunk on the wire and in checkpoints; it is unique
    because ``index`` is an integer after the last ``#``.
    """

    name: str
    index: int
    start: int
    stop: int
    itemsize: int

    @property
    def key(self) -> str:
        return f"{self.name}#{self.index}"

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


def chunk_tensors(specs: Iterable[TensorSpec], chunk_bytes: int) -> list[Chunk]:
    """Cut each tensor into the fewest equal chunks of at most ``chunk_bytes``.

    A tensor smaller than ``chunk_bytes`` stays whole (one chunk); an empty
    tensor is one empty chunk, so it still has a home.

    Raises:
        ConfigError: ``chunk_bytes`` is not positive, or two specs share a name.
    """
    if chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[Chunk] = []
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"two tensors are named {spec.name!r}")
        seen.add(spec.name)
        itemsize = np.dtype(spec.dtype).itemsize
        per_chunk = max(1, chunk_bytes // itemsize)
        count = max(1, -(-spec.size // per_chunk))
        # Equal pieces: the sizes differ by at most one element.
        bounds = [spec.size * i // count for i in range(count + 1)]
        chunks.extend(
            Chunk(spec.name, i, bounds[i], bounds[i + 1], itemsize) for i in range(count)
        )
    return chunks


def join_chunks(spec: TensorSpec, chunks: Sequence[Chunk], values: Mapping[str, Any]) -> Any:
    """Tensor ``spec`` from the values of its ``chunks`` (``chunk_tensors``
    cut it so), by chunk key: a NumPy or CuPy array as the first chunk's
    value is (where the shards keep the tensor), of the spec's shape."""
    first = values[chunks[0].key]
    xp = array_module(first)
    if len(chunks) == 1:
        return xp.asarray(first).reshape(spec.shape)
    whole = xp.empty(spec.size, np.dtype(spec.dtype))
    for chunk in chunks:
        whole[chunk.start:chunk.stop] = like(values[chunk.key], whole)
    return whole.reshape(spec.shape)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Which shard holds each chunk.

    Attributes:
        num_shards: how many shards there are.
        chunks: every chunk, in tensor order.
        shard_of: chunk key -> shard index.
    """

    num_shards: int
    chunks: tuple[Chunk, ...]
    shard_of: Mapping[str, int]

    def loads(self) -> list[int]:
        """Bytes per shard."""
        loads = [0] * self.num_shards
        for chunk in self.chunks:
            loads[self.shard_of[chunk.key]] += chunk.nbytes
        return loads

    @property
    def imbalance(self) -> float:
        """Largest shard's bytes over the mean (1.0 is perfect; 1.0 when empty)."""
        loads = self.loads()
        total = sum(loads)
        return 1.0 if total == 0 else max(loads) * self.num_shards / total

    def on_shard(self, shard: int) -> list[Chunk]:
        """The chunks shard ``shard`` holds, in tensor order."""
        return [c for c in self.chunks if self.shard_of[c.key] == shard]

    def moved_bytes(self, other: Placement) -> int:
        """Bytes whose shard differs between ``self`` and ``other`` (same chunks)."""
        return sum(
            c.nbytes for c in self.chunks if other.shard_of.get(c.key) != self.shard_of[c.key]
        )


def _check_shards(num_shards: int) -> None:
    if num_shards < 1:
        raise ConfigError(f"need at least one shard, got {num_shards}")


def _greedy(chunks: Iterable[Chunk], loads: list[int], shard_of: dict[str, int]) -> None:
    """Largest first onto the least-loaded shard (lowest index on a tie)."""
    heap = [(load, shard) for shard, load in enumerate(loads)]
    heapq.heapify(heap)
    for chunk in sorted(chunks, key=lambda c: (-c.nbytes, c.name, c.index)):
        load, shard = heapq.heappop(heap)
        shard_of[chunk.key] = shard
        loads[shard] = load + chunk.nbytes
        heapq.heappush(heap, (loads[shard], shard))


def place(chunks: Sequence[Chunk], num_shards: int) -> Placement:
    """Place ``chunks`` on ``num_shards`` shards, largest first onto the least loaded.

    Deterministic: the same chunks give the same placement in every process.

    Raises:
        ConfigError: ``num_shards`` is below one.
    """
    _check_shards(num_shards)
    shard_of: dict[str, int] = {}
    _greedy(chunks, [0] * num_shards, shard_of)
    return Placement(num_shards, tuple(chunks), shard_of)


def resize(old: Placement, num_shards: int, *, max_imbalance: float = 1.05) -> Placement:
    """A placement on ``num_shards`` shards that moves as few bytes as it can.

    Chunks go largest first, as in :func:`place`, but each one stays on its
    old shard while that shard holds at most ``(1 + slack)`` times the mean;
    a chunk that does not fit there, or whose shard is gone, goes to the
    least-loaded shard. A tight slack can force a large chunk off a shard
    that only had to shed a little, so slacks from 0 up to
    ``max_imbalance - 1`` are tried in turn, and the first whose moved bytes
    are within 1.2 times the least that must move wins (else the one moving
    the fewest bytes within ``max_imbalance``). Adding a shard to ``k`` thus
    moves about ``1/(k+1)`` of the bytes: what the new shard must hold.
    ``old.moved_bytes(new)`` says how much moved.

    Raises:
        ConfigError: ``num_shards`` is below one, or ``max_imbalance`` below 1.
    """
    _check_shards(num_shards)
    if max_imbalance < 1:
        raise ConfigError(f"max_imbalance must be at least 1, got {max_imbalance}")
    least = _least_moved(old, num_shards)
    slacks = [s for s in (0.0, 0.005, 0.01, 0.02, 0.03, 0.04) if s < max_imbalance - 1]
    tries = [_sticky(old, num_shards, slack) for slack in [*slacks, max_imbalance - 1]]
    fitting = [p for p in tries if p.imbalance <= max_imbalance]
    for placement in fitting:
        if old.moved_bytes(placement) <= 1.2 * least:
            return placement
    if not fitting:
        return min(tries, key=lambda p: p.imbalance)
    return min(fitting, key=lambda p: (old.moved_bytes(p), p.imbalance))


def _least_moved(old: Placement, num_shards: int) -> float:
    """Bytes that must move for a perfect balance on ``num_shards`` shards."""
    loads = old.loads()
    mean = sum(loads) / num_shards
    gone = sum(loads[num_shards:])
    short = sum(max(0.0, mean - (loads[s] if s < len(loads) else 0)) for s in range(num_shards))
    return max(gone, short)


def _sticky(old: Placement, num_shards: int, slack: float) -> Placement:
    total = sum(c.nbytes for c in old.chunks)
    cap = total / num_shards * (1 + slack)
    loads = [0] * num_shards
    heap = [(0, shard) for shard in range(num_shards)]
    shard_of: dict[str, int] = {}
    for chunk in sorted(old.chunks, key=lambda c: (-c.nbytes, c.name, c.index)):
        home = old.shard_of[chunk.key]
        if home < num_shards and loads[home] + chunk.nbytes <= cap:
            shard = home
        else:
            # The heap holds stale entries for shards that grew in place;
            # skip them until the top is current.
            while loads[heap[0][1]] != heap[0][0]:
                _, stale = heapq.heappop(heap)
                heapq.heappush(heap, (loads[stale], stale))
            shard = heap[0][1]
        shard_of[chunk.key] = shard
        loads[shard] += chunk.nbytes
        heapq.heappush(heap, (loads[shard], shard))
    return Placement(num_shards, old.chunks, shard_of)


def relocate(old: Placement, old_shards: Sequence[str], new_shards: Sequence[str], *,
             max_imbalance: float = 1.05) -> Placement:
    """:func:`resize` for shards named by address: a placement on
    ``new_shards`` (in that order) from one on ``old_shards``, moving as
    few bytes as it can. Shards in both lists keep what they can; shards
    only in ``old_shards`` give everything away; shards only in
    ``new_shards`` start empty.

    Raises:
        ConfigError: no new shards, repeated addresses, or lengths that do
            not match the placement.
    """
    if len(old_shards) != old.num_shards:
        raise ConfigError(f"{len(old_shards)} addresses for {old.num_shards} shards")
    if len(set(old_shards)) != len(old_shards) or len(set(new_shards)) != len(new_shards):
        raise ConfigError("a shard address is listed twice")
    _check_shards(len(new_shards))
    # Renumber: surviving shards get their new index, leaving ones an index
    # past the new count, which resize() treats as gone.
    index = {address: i for i, address in enumerate(new_shards)}
    gone = [a for a in old_shards if a not in index]
    for i, address in enumerate(gone):
        index[address] = len(new_shards) + i
    renamed = Placement(len(new_shards) + len(gone), old.chunks,
                        {key: index[old_shards[s]] for key, s in old.shard_of.items()})
    return resize(renamed, len(new_shards), max_imbalance=max_imbalance)


def predicted_times(placement: Placement, bandwidth: Sequence[float]) -> list[float]:
    """Seconds per shard to move its bytes at its ``bandwidth`` (bytes/s)."""
    if len(bandwidth) != placement.num_shards:
        raise ConfigError(f"{len(bandwidth)} bandwidths for {placement.num_shards} shards")
    if not all(b > 0 for b in bandwidth):
        raise ConfigError(f"bandwidths must be positive, got {list(bandwidth)}")
    return [load / bw for load, bw in zip(placement.loads(), bandwidth, strict=True)]


def balance(old: Placement, bandwidth: Sequence[float], *,
            tolerance: float = 1.02) -> Placement:
    """Move chunks from slow shards to fast ones: a placement whose largest
    predicted time (bytes on a shard over its ``bandwidth``) is as small as
    it can make it, moving few bytes.

    Each shard's fair share of the bytes is proportional to its bandwidth.
    Chunks go largest first; one stays on its shard while that shard holds
    at most ``(1 + slack)`` times its share, otherwise it goes where it would
    finish first. Slacks from 0 upwards are tried, and among the placements
    whose largest predicted time is within ``tolerance`` of the best one
    found, the one moving the fewest bytes wins. (The plain LPT rule with
    finish times as the load, Graham 1969, on uniform machines.)

    Raises:
        ConfigError: a bandwidth per shard is missing or not positive.
    """
    predicted_times(old, bandwidth)  # validates
    tries = [old, *(_sticky_weighted(old, bandwidth, slack)
                    for slack in (0.0, 0.01, 0.02, 0.05, 0.1, 0.2))]
    spans = [max(predicted_times(p, bandwidth)) for p in tries]
    best = min(spans)
    fitting = [p for p, span in zip(tries, spans, strict=True) if span <= best * tolerance]
    return min(fitting, key=lambda p: (old.moved_bytes(p), max(predicted_times(p, bandwidth))))


def _sticky_weighted(old: Placement, bandwidth: Sequence[float], slack: float) -> Placement:
    total = sum(c.nbytes for c in old.chunks)
    speed = sum(bandwidth)
    caps = [total * bw / speed * (1 + slack) for bw in bandwidth]
    loads = [0] * old.num_shards
    shard_of: dict[str, int] = {}
    for chunk in sorted(old.chunks, key=lambda c: (-c.nbytes, c.name, c.index)):
        home = old.shard_of[chunk.key]
        if loads[home] + chunk.nbytes <= caps[home]:
            shard = home
        else:
            shard = min(range(old.num_shards),
                        key=lambda s: ((loads[s] + chunk.nbytes) / bandwidth[s], s))
        shard_of[chunk.key] = shard
        loads[shard] += chunk.nbytes
    return Placement(old.num_shards, old.chunks, shard_of)
