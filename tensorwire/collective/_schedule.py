"""Communication schedules: who sends which block to whom, step by step.

Pure functions of (rank, world size, sizes): no I/O, no arrays, so they are
tested without sockets. The group's asyncio code walks these plans; the
per-rank plans are cached, since a training loop asks for the same ones on
every step. Cached plans are shared: callers must not change them.

References: Thakur, Rabenseifner and Gropp, "Optimization of Collective
Communication Operations in MPICH" (IJHPCA 2005) for recursive doubling with
the non-power-of-two fold, binomial trees and the ring; Bruck et al.,
"Efficient Algorithms for All-to-All Communications in Multiport
Message-Passing Systems" (IEEE TPDS 1997) for the allgather; Patarasuk and
Yuan (JPDC 2009) for the bandwidth-optimal ring allreduce.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence

__all__ = (
    "BruckStep",
    "DoublingPlan",
    "RingStep",
    "binomial_tree",
    "bruck_steps",
    "buckets",
    "chain",
    "dissemination",
    "pairwise",
    "recursive_doubling",
    "ring_allgather",
    "ring_reduce_scatter",
    "segments",
    "split",
)


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` nearly equal blocks of ``count`` items.

    The first ``count % parts`` blocks have one item more (``np.array_split``).
    """
    base, extra = divmod(count, parts)
    bounds = []
    start = 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def segments(start: int, stop: int, per_segment: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into pieces of at most ``per_segment`` items.

    An empty range is one empty segment, so that every step still sends one
    message and both sides agree on the count.
    """
    if stop <= start:
        return [(start, start)]
    per_segment = max(per_segment, 1)
    return [(lo, min(lo + per_segment, stop)) for lo in range(start, stop, per_segment)]


@dataclasses.dataclass(frozen=True, slots=True)
class RingStep:
    """One ring step: send block ``send`` to the right, receive ``recv`` from the left."""

    send: int
    recv: int


@functools.cache
def ring_reduce_scatter(rank: int, size: int) -> tuple[RingStep, ...]:
    """The ``size - 1`` steps after which ``rank`` holds block ``rank`` fully reduced.

    At step ``s`` a rank sends block ``rank - s - 1`` (the one it reduced in
    the step before) and reduces block ``rank - s - 2`` with what arrives.
    """
    return tuple(RingStep((rank - s - 1) % size, (rank - s - 2) % size) for s in range(size - 1))


@functools.cache
def ring_allgather(rank: int, size: int) -> tuple[RingStep, ...]:
    """The ``size - 1`` steps that spread block ``i`` from rank ``i`` to every rank."""
    return tuple(RingStep((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1))


@dataclasses.dataclass(frozen=True, slots=True)
class DoublingPlan:
    """Recursive doubling on any number of ranks.

    With ``p`` the largest power of two not above ``size`` and
    ``rem = size - p``, the first ``2 * rem`` ranks pair up: the odd one of
    each pair hands its data to the even one (``fold_to``) and waits for the
    result from it, the even one absorbs it (``absorb``) and later
    returns the result (``give_back``). The ``p`` remaining ranks exchange
    with ``partners`` in ``log2(p)`` steps.
    """

    fold_to: int | None
    absorb: int | None
    partners: tuple[int, ...]
    give_back: int | None


@functools.cache
def recursive_doubling(rank: int, size: int) -> DoublingPlan:
    """The recursive-doubling plan of ``rank`` in a group of ``size``."""
    p = 1 << (size.bit_length() - 1)
    rem = size - p
    if rank < 2 * rem and rank % 2 == 1:
        return DoublingPlan(fold_to=rank - 1, absorb=None, partners=(), give_back=None)
    if rank < 2 * rem:
        virtual = rank // 2
        extra: int | None = rank + 1
    else:
        virtual = rank - rem
        extra = None

    def real(v: int) -> int:
        return v * 2 if v < rem else v + rem

    partners = []
    mask = 1
    while mask < p:
        partners.append(real(virtual ^ mask))
        mask <<= 1
    return DoublingPlan(fold_to=None, absorb=extra, partners=tuple(partners), give_back=extra)


@functools.cache
def binomial_tree(rank: int, size: int, root: int) -> tuple[int | None, tuple[int, ...]]:
    """``(parent, children)`` of ``rank`` in the binomial tree rooted at ``root``.

    Children are in the order a broadcast sends to them (largest subtree
    first); a reduction receives from them in reverse.
    """
    vrank = (rank - root) % size
    parent = None
    mask = 1
    while mask < size:
        if vrank & mask:
            parent = (vrank - mask + root) % size
            break
        mask <<= 1
    children = []
    mask >>= 1
    while mask > 0:
        if vrank + mask < size:
            children.append((vrank + mask + root) % size)
        mask >>= 1
    return parent, tuple(children)


def chain(rank: int, size: int, root: int) -> tuple[int | None, int | None]:
    """``(previous, next)`` of ``rank`` in the chain ``root, root + 1, ...``."""
    vrank = (rank - root) % size
    previous = None if vrank == 0 else (rank - 1) % size
    following = None if vrank == size - 1 else (rank + 1) % size
    return previous, following


@functools.cache
def dissemination(rank: int, size: int) -> tuple[tuple[int, int], ...]:
    """Barrier rounds ``(send_to, recv_from)``: ``ceil(log2(size))`` of them."""
    rounds = []
    distance = 1
    while distance < size:
        rounds.append(((rank + distance) % size, (rank - distance) % size))
        distance <<= 1
    return tuple(rounds)


@dataclasses.dataclass(frozen=True, slots=True)
class BruckStep:
    """Send blocks ``[0, count)`` (relative to self) to ``send_to``; receive
    blocks ``[offset, offset + count)`` from ``recv_from``."""

    send_to: int
    recv_from: int
    offset: int
    count: int


@functools.cache
def bruck_steps(rank: int, size: int) -> tuple[BruckStep, ...]:
    """Bruck's allgather: ``ceil(log2(size))`` steps for any ``size``.

    Relative block ``i`` of a rank is the block of rank ``(rank + i) % size``;
    after the steps a rank holds all of them.
    """
    steps = []
    distance = 1
    while distance < size:
        steps.append(
            BruckStep(
                send_to=(rank - distance) % size,
                recv_from=(rank + distance) % size,
                offset=distance,
                count=min(distance, size - distance),
            )
        )
        distance <<= 1
    return tuple(steps)


@functools.cache
def pairwise(rank: int, size: int) -> tuple[tuple[int, int], ...]:
    """All-to-all exchange rounds ``(send_to, recv_from)``, ``size - 1`` of them."""
    return tuple(((rank + s) % size, (rank - s) % size) for s in range(1, size))


def buckets(kinds: Sequence[Hashable], sizes: Sequence[int], priorities: Sequence[float],
            limit: int) -> list[list[int]]:
    """Arrays ``0 .. n - 1`` in order of ``priorities`` (ties by index), cut
    into buckets: consecutive arrays of one kind, at most ``limit`` bytes in
    all; an array of ``limit`` bytes or more is a bucket of its own.
    """
    order = sorted(range(len(sizes)), key=lambda i: (priorities[i], i))
    out: list[list[int]] = []
    size, kind = 0, None
    for i in order:
        key, nbytes = kinds[i], sizes[i]
        if (out and key == kind and size < limit and nbytes < limit
                and size + nbytes <= limit):
            out[-1].append(i)
            size += nbytes
        else:
            out.append([i])
            size, kind = nbytes, key
    return out
