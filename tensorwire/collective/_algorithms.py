"""The collective algorithms: free functions over a group's links.

Each function runs one algorithm for one operation on this rank: it takes
the :class:`~._links.Links` (this rank, the group's size, send, receive,
exchange), the operation (whose messages it sends) and the array, and
follows a plan of :mod:`._schedule` (or :mod:`._hierarchy`) step by step.
Which algorithm an operation uses is chosen in :mod:`.group`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..errors import InvalidArgument
from . import _hierarchy as hierarchy
from . import _schedule as schedule
from ._arrays import Flat, ReduceOp, same_memory
from ._links import Links, run_all
from ._oplog import Op
from .config import GroupConfig

__all__ = (
    "Algorithm",
    "choose",
    "RETURN_STEP",
    "allreduce_flat",
    "bruck_allgather",
    "chain_broadcast",
    "chain_reduce",
    "doubling_allreduce",
    "fan_chain",
    "gather_blocks",
    "hierarchical_allgather",
    "hierarchical_allreduce",
    "ring_allgather",
    "ring_allreduce",
    "ring_of",
    "ring_reduce_scatter",
    "run_allgather",
    "run_allreduce_bucket",
    "run_alltoall",
    "run_barrier",
    "run_broadcast",
    "run_gather",
    "run_reduce",
    "run_reduce_scatter",
    "run_scatter",
    "runs",
    "tree_broadcast",
    "tree_reduce",
)

#: Step number of the message that returns a folded rank's result.
RETURN_STEP = 0xFFFF_FFFF

Algorithm = Literal["auto", "ring", "tree", "hierarchical"]


def choose(config: GroupConfig, nbytes: int, algorithm: Algorithm,
           hier: Callable[[], hierarchy.Hierarchy], *, hierarchical: bool = True
           ) -> tuple[bool, hierarchy.Hierarchy | None]:
    """How to move ``nbytes``: ``(large, hierarchy)``.

    ``large`` picks the bandwidth-optimal algorithm (ring, chain) over the
    latency-optimal one (tree, recursive doubling, Bruck); ``"auto"`` takes
    it above ``GroupConfig.small_bytes``. ``hierarchy`` is the one ``hier()``
    gives to run the operation by, or ``None`` for a flat one (always for an
    operation that has no ``hierarchical`` variant): ``"auto"`` takes it when
    it moves fewer bytes between hosts (several hosts, more than one rank on
    some) and the message is larger than ``GroupConfig.hierarchical_bytes``.

    Raises:
        InvalidArgument: an unknown algorithm, or ``"hierarchical"`` for an
            operation that has no such variant.
    """
    allowed = ("auto", "ring", "tree", "hierarchical") if hierarchical else (
        "auto", "ring", "tree")
    if algorithm not in allowed:
        raise InvalidArgument(
            f"algorithm must be one of {', '.join(map(repr, allowed))}, got {algorithm!r}")
    large = nbytes > config.small_bytes if algorithm == "auto" else algorithm == "ring"
    if not hierarchical:
        return large, None
    if algorithm == "hierarchical":
        return large, hier()
    limit = config.hierarchical_bytes
    if algorithm != "auto" or limit is None or nbytes <= limit:
        return large, None
    found = hier()
    return large, found if found.helps else None


def ring_of(links: Links, ring: Sequence[int] | None) -> tuple[int, int, int, int]:
    """``(position, size, right, left)`` of this rank in ``ring`` (default: all ranks)."""
    if ring is None:
        n = links.world_size
        return links.rank, n, (links.rank + 1) % n, (links.rank - 1) % n
    n, position = len(ring), ring.index(links.rank)
    return position, n, ring[(position + 1) % n], ring[(position - 1) % n]


async def ring_reduce_scatter(links: Links, op: Op, flat: Flat, a: Any,
                               bounds: list[tuple[int, int]], reduce: ReduceOp,
                               ring: Sequence[int] | None = None,
                               first_step: int = 0) -> None:
    """Leave block ``position`` of ``a`` (by ``bounds``) reduced over the
    ranks of ``ring`` (default: all, and position = rank)."""
    position, n, right, left = ring_of(links, ring)
    per = links.per_segment(flat)
    with links.scratch.take(flat, min(per, max(hi - lo for lo, hi in bounds))) as scratch:
        for index, plan in enumerate(schedule.ring_reduce_scatter(position, n)):
            step = first_step + index

            async def send(lo: int, hi: int, step: int = step) -> None:
                for s_lo, s_hi in schedule.segments(lo, hi, per):
                    await links.send(right, op, step, [flat.frame(a[s_lo:s_hi])])

            async def receive(lo: int, hi: int, step: int = step) -> None:
                for s_lo, s_hi in schedule.segments(lo, hi, per):
                    part = scratch[: s_hi - s_lo]
                    await links.recv(left, op, step, [flat.frame(part)])
                    flat.reduce_into(reduce, a[s_lo:s_hi], part)
                    # Before the next segment lands in the same scratch.
                    flat.sync()

            await run_all(send(*bounds[plan.send]), receive(*bounds[plan.recv]))


async def ring_allreduce(links: Links, op: Op, flat: Flat, a: Any,
                         bounds: list[tuple[int, int]], reduce: ReduceOp,
                         ring: Sequence[int] | None = None, first_step: int = 0) -> None:
    """Allreduce ``a`` over the ranks of ``ring`` (default: all): the ring's
    reduce-scatter and allgather as one pipeline of ``2 (n - 1)`` steps.

    Each step forwards the block the step before received (Patarasuk and
    Yuan's ring), so a segment goes on to the right as soon as it has landed
    (and, in the reduce-scatter half, been reduced), while the next segment
    arrives: the sender and the receiver never wait for a whole step, and
    the allgather starts with the first reduced segment, not the last
    (issue 25). ``ReduceOp.AVG`` divides each segment of this rank's block
    by the group's size as the last reduce-scatter step reduces it, while it
    is still in cache, rather than in a pass of its own.
    """
    position, n, right, left = ring_of(links, ring)
    per = links.per_segment(flat)
    steps = (*schedule.ring_reduce_scatter(position, n), *schedule.ring_allgather(position, n))
    pieces = [schedule.segments(lo, hi, per) for lo, hi in bounds]
    loop = asyncio.get_running_loop()
    # landed[i][k]: segment k of the block received at step i is in ``a``,
    # reduced; step i + 1 sends that block.
    landed: list[list[asyncio.Future[None]]] = [
        [loop.create_future() for _ in pieces[plan.recv]] for plan in steps]

    async def sending() -> None:
        for index, plan in enumerate(steps):
            for k, (lo, hi) in enumerate(pieces[plan.send]):
                if index:
                    await landed[index - 1][k]
                await links.send(right, op, first_step + index, [flat.frame(a[lo:hi])])

    async def receiving(scratch: Any) -> None:
        for index, plan in enumerate(steps):
            reducing = index < n - 1
            for k, (lo, hi) in enumerate(pieces[plan.recv]):
                if reducing:
                    part = scratch[: hi - lo]
                    await links.recv(left, op, first_step + index, [flat.frame(part)])
                    flat.reduce_into(reduce, a[lo:hi], part)
                    if reduce is ReduceOp.AVG and index == n - 2:
                        flat.divide(a[lo:hi], links.world_size)
                    # Before the next segment lands in the same scratch,
                    # and before this one is sent on (device data).
                    flat.sync()
                else:
                    await links.recv(left, op, first_step + index, [flat.frame(a[lo:hi])])
                landed[index][k].set_result(None)

    with links.scratch.take(flat, min(per, max(hi - lo for lo, hi in bounds))) as scratch:
        await run_all(sending(), receiving(scratch))


async def ring_allgather(links: Links, op: Op, flat: Flat, a: Any,
                          blocks: Sequence[Sequence[tuple[int, int]]], first_step: int,
                          ring: Sequence[int] | None = None) -> None:
    """Spread block ``i`` of ``a`` from the ``i``-th rank of ``ring``
    (default: rank ``i``) to all of them; receives land in ``a``.

    A block is a list of ``[lo, hi)`` ranges (a host's ranks need not be
    adjacent); each range moves in segments.
    """
    position, n, right, left = ring_of(links, ring)
    per = links.per_segment(flat)
    for index, plan in enumerate(schedule.ring_allgather(position, n)):
        step = first_step + index

        async def send(ranges: Sequence[tuple[int, int]], step: int = step) -> None:
            for lo, hi in ranges:
                for s_lo, s_hi in schedule.segments(lo, hi, per):
                    await links.send(right, op, step, [flat.frame(a[s_lo:s_hi])])

        async def receive(ranges: Sequence[tuple[int, int]], step: int = step) -> None:
            for lo, hi in ranges:
                for s_lo, s_hi in schedule.segments(lo, hi, per):
                    await links.recv(left, op, step, [flat.frame(a[s_lo:s_hi])])

        await run_all(send(blocks[plan.send]), receive(blocks[plan.recv]))


async def doubling_allreduce(links: Links, op: Op, flat: Flat, a: Any, reduce: ReduceOp) -> None:
    """Recursive doubling over all of ``a``, ranks beyond a power of two folded in."""
    plan = schedule.recursive_doubling(links.rank, links.world_size)
    whole = [flat.frame(a)]
    if plan.fold_to is not None:
        await links.send(plan.fold_to, op, 0, whole)
        await links.recv(plan.fold_to, op, RETURN_STEP, whole)
        return
    with links.scratch.take(flat, flat.size) as scratch:
        if plan.absorb is not None:
            await links.recv(plan.absorb, op, 0, [flat.frame(scratch)])
            flat.reduce_into(reduce, a, scratch)
            flat.sync()
        for step, partner in enumerate(plan.partners, start=1):
            await links.exchange(op, step, partner, whole, partner, [flat.frame(scratch)])
            # The lower rank's partial result first on both sides, so that
            # both get the same bits (NaN signs, signed zeros), as promised.
            flat.reduce_into(reduce, a, scratch, src_first=partner < links.rank)
            flat.sync()
    if reduce is ReduceOp.AVG:
        flat.divide(a, links.world_size)
        flat.sync()
    if plan.give_back is not None:
        await links.send(plan.give_back, op, RETURN_STEP, whole)


async def tree_reduce(links: Links, op: Op, flat: Flat, a: Any, reduce: ReduceOp,
                       root: int) -> None:
    """Binomial-tree reduction of ``a`` into ``root``'s ``a``."""
    parent, children = schedule.binomial_tree(links.rank, links.world_size, root)
    if children:
        with links.scratch.take(flat, flat.size) as scratch:
            for child in reversed(children):
                await links.recv(child, op, 0, [flat.frame(scratch)])
                flat.reduce_into(reduce, a, scratch)
            flat.sync()
    if parent is not None:
        await links.send(parent, op, 0, [flat.frame(a)])


async def tree_broadcast(links: Links, op: Op, flat: Flat, a: Any, root: int) -> None:
    """Binomial-tree broadcast of ``root``'s ``a``."""
    parent, children = schedule.binomial_tree(links.rank, links.world_size, root)
    if parent is not None:
        await links.recv(parent, op, 0, [flat.frame(a)])
    await links.send_each(op, 0, [(c, [flat.frame(a)]) for c in children])


async def chain_broadcast(links: Links, op: Op, flat: Flat, a: Any, root: int) -> None:
    """Pipelined chain: segment ``k`` moves on while segment ``k + 1`` arrives."""
    previous, following = schedule.chain(links.rank, links.world_size, root)
    await fan_chain(links, op, flat, a, previous, [] if following is None else [following],
                          0, 0, flat.size)


async def chain_reduce(links: Links, op: Op, flat: Flat, a: Any, reduce: ReduceOp,
                        source: int | None, dest: int | None, step: int,
                        lo: int, hi: int) -> None:
    """Pipelined chain reduction of ``a[lo:hi]``: segment by segment, add
    what ``source`` sends into ``a`` (through one segment of scratch) and
    pass the sum on to ``dest``."""
    per = links.per_segment(flat)
    sending: asyncio.Future[None] | None = None
    with links.scratch.take(flat, min(per, hi - lo) if source is not None else 0) as scratch:
        try:
            for s_lo, s_hi in schedule.segments(lo, hi, per):
                if source is not None:
                    part = scratch[: s_hi - s_lo]
                    await links.recv(source, op, step, [flat.frame(part)])
                    flat.reduce_into(reduce, a[s_lo:s_hi], part)
                    flat.sync()
                if dest is not None:
                    if sending is not None:
                        await sending
                    sending = asyncio.ensure_future(
                        links.send(dest, op, step, [flat.frame(a[s_lo:s_hi])]))
            if sending is not None:
                await sending
        finally:
            if sending is not None and not sending.done():
                sending.cancel()


async def fan_chain(links: Links, op: Op, flat: Flat, a: Any, previous: int | None,
                     followers: Sequence[int], step: int, lo: int, hi: int) -> None:
    """Pipelined broadcast of ``a[lo:hi]`` along a tree of chains: each
    segment arrives from ``previous`` straight into ``a``, then goes on
    to every follower while the next segment arrives."""
    if previous is None and not followers:
        return
    sending: asyncio.Future[None] | None = None
    try:
        for s_lo, s_hi in schedule.segments(lo, hi, links.per_segment(flat)):
            part = [flat.frame(a[s_lo:s_hi])]
            if previous is not None:
                await links.recv(previous, op, step, part)
            if followers:
                if sending is not None:
                    await sending
                sending = asyncio.ensure_future(
                    run_all(*(links.send(f, op, step, part) for f in followers)))
        if sending is not None:
            await sending
    finally:
        if sending is not None and not sending.done():
            sending.cancel()


async def hierarchical_allreduce(links: Links, op: Op, flat: Flat, a: Any, reduce: ReduceOp,
                                  hier: hierarchy.Hierarchy) -> None:
    """Chain reduce to each host's leader, ring allreduce among the
    leaders, chain broadcast from each leader (see :mod:`._hierarchy`).

    The array moves in chunks of at most ``h`` segments (``h`` hosts: a
    segment per ring block; a quarter of the array when that is less),
    and the three phases overlap chunk by chunk: while
    the leaders' ring runs on chunk ``c``, chunk ``c + 1`` is reduced
    inside the host and chunk ``c - 1`` broadcast. Each phase uses its
    own connections (or its own direction of one), so every connection
    still carries one phase's messages, in chunk order.
    """
    plan = hierarchy.allreduce_plan(hier, links.rank)
    h = len(hier.hosts)
    # At least four chunks where the segments allow, so that the phases
    # overlap for mid-sized messages too.
    per_chunk = min(links.per_segment(flat) * h, max(-(-flat.size // 4), 1024 * h))
    chunks = schedule.segments(0, flat.size, per_chunk)
    stride = 2 * h + 1  # steps per chunk: reduce, ring, broadcast
    reduced: asyncio.Queue[None] = asyncio.Queue()
    finished: asyncio.Queue[None] = asyncio.Queue()
    bcast = (plan.bcast_to,) if plan.bcast_to is not None else ()

    async def reducing() -> None:
        for c, (lo, hi) in enumerate(chunks):
            await chain_reduce(links, op, flat, a, reduce, plan.reduce_from, plan.reduce_to,
                                     c * stride, lo, hi)
            reduced.put_nowait(None)

    async def ringing() -> None:
        for c, (lo, hi) in enumerate(chunks):
            await reduced.get()
            bounds = [(lo + b_lo, lo + b_hi) for b_lo, b_hi in schedule.split(hi - lo, h)]
            if h > 1:
                # Steps c * stride + 1 .. c * stride + 2 (h - 1): the ring's
                # reduce-scatter, then its allgather.
                await ring_allreduce(links, op, flat, a, bounds, reduce, plan.ring,
                                     c * stride + 1)
            elif reduce is ReduceOp.AVG:
                flat.divide(a[lo:hi], links.world_size)
            finished.put_nowait(None)

    async def broadcasting() -> None:
        for c, (lo, hi) in enumerate(chunks):
            if plan.ring:
                await finished.get()
            await fan_chain(links, op, flat, a, plan.bcast_from, bcast, c * stride + 2 * h,
                                  lo, hi)

    if plan.ring:
        await run_all(reducing(), ringing(), broadcasting())
    else:
        await run_all(reducing(), broadcasting())


async def hierarchical_allgather(links: Links, op: Op, flat: Flat, a: Any, count: int,
                                  hier: hierarchy.Hierarchy) -> None:
    """Gather each host's blocks at its leader, ring allgather of host
    blocks among the leaders, chain broadcast of everything from each leader."""
    plan = hierarchy.allgather_plan(hier, links.rank)
    h = len(hier.hosts)

    def block(rank: int) -> Any:
        return flat.frame(a[rank * count:(rank + 1) * count])

    if plan.gather_to is not None:
        await links.send(plan.gather_to, op, 0, [block(links.rank)])
    elif plan.gather_from:
        await run_all(*(links.recv(peer, op, 0, [block(peer)]) for peer in plan.gather_from))
    if plan.ring and h > 1:
        blocks = [runs([(r * count, (r + 1) * count) for r in ranks])
                  for ranks in plan.blocks]
        await ring_allgather(links, op, flat, a, blocks, 1, plan.ring)
    bcast = (plan.bcast_to,) if plan.bcast_to is not None else ()
    await fan_chain(links, op, flat, a, plan.bcast_from, bcast, h, 0, flat.size)


async def allreduce_flat(links: Links, o: Op, flat: Flat, reduce: ReduceOp, large: bool,
                          hier: hierarchy.Hierarchy | None) -> None:
    """Allreduce ``flat`` in place: by ``hier``, else the ring when ``large``
    (and there is an item per rank), else recursive doubling."""
    n, a = links.world_size, flat.array
    if n == 1 or flat.size == 0:
        return
    if hier is not None:
        await hierarchical_allreduce(links, o, flat, a, reduce, hier)
    elif large and flat.size >= n:
        await ring_allreduce(links, o, flat, a, schedule.split(flat.size, n), reduce)
    else:
        await doubling_allreduce(links, o, flat, a, reduce)


async def gather_blocks(links: Links, op: Op, flat: Flat, a: Any,
                         bounds: list[tuple[int, int]], root: int, step: int) -> None:
    """Every rank's block ``rank`` of ``a`` to ``root``, straight into root's ``a``."""
    if links.rank == root:
        await run_all(*(
            links.recv(peer, op, step, [flat.frame(a[bounds[peer][0]:bounds[peer][1]])])
            for peer in range(links.world_size) if peer != root
        ))
    else:
        lo, hi = bounds[links.rank]
        await links.send(root, op, step, [flat.frame(a[lo:hi])])


async def bruck_allgather(links: Links, op: Op, flat: Flat, a: Any, count: int) -> None:
    """Bruck's allgather of ``count``-item blocks in ``a``: log2 rounds."""
    n = links.world_size

    def blocks(first: int, number: int) -> list[Any]:
        # Blocks first .. first + number - 1 (mod n): one frame, or two
        # when the run wraps past the last rank.
        first %= n
        head = min(number, n - first)
        frames = [flat.frame(a[first * count:(first + head) * count])]
        if number > head:
            frames.append(flat.frame(a[: (number - head) * count]))
        return frames

    for step, plan in enumerate(schedule.bruck_steps(links.rank, n)):
        await links.exchange(op, step, plan.send_to, blocks(links.rank, plan.count),
                             plan.recv_from, blocks(links.rank + plan.offset, plan.count))


def runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` with adjacent ones merged: fewer, larger messages."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


async def run_reduce(links: Links, o: Op, flat: Flat, reduce: ReduceOp, large: bool,
                     root: int) -> Any:
    """``Group.reduce``: ring reduce-scatter and a gather when ``large``, else a tree."""
    n, a = links.world_size, flat.array
    if n > 1 and flat.size > 0:
        if large and flat.size >= n:
            bounds = schedule.split(flat.size, n)
            await ring_reduce_scatter(links, o, flat, a, bounds, reduce)
            await gather_blocks(links, o, flat, a, bounds, root, step=n)
        else:
            await tree_reduce(links, o, flat, a, reduce, root)
    if reduce is ReduceOp.AVG and links.rank == root:
        flat.divide(a, n)
    return flat.result()


async def run_broadcast(links: Links, o: Op, flat: Flat, large: bool,
                        hier: hierarchy.Hierarchy | None, root: int) -> Any:
    """``Group.broadcast``: by ``hier``, else a chain when ``large``, else a tree."""
    if links.world_size > 1 and flat.size > 0:
        if hier is not None:
            plan = hierarchy.broadcast_plan(hier, links.rank, root)
            await fan_chain(links, o, flat, flat.array, plan.previous, plan.followers, 0,
                            0, flat.size)
        elif large:
            await chain_broadcast(links, o, flat, flat.array, root)
        else:
            await tree_broadcast(links, o, flat, flat.array, root)
    return flat.result()


async def run_allgather(links: Links, o: Op, flat: Flat, target: Flat, large: bool,
                        hier: hierarchy.Hierarchy | None) -> Any:
    """``Group.allgather`` into ``target``: by ``hier``, else the ring when
    ``large``, else Bruck's algorithm."""
    n = links.world_size
    count, a, result = flat.size, target.array, target.array
    own = result[links.rank * count:(links.rank + 1) * count]
    if not same_memory(own, flat.array):
        own[...] = flat.array
        target.sync()
    if n == 1 or count == 0:
        return target.result()
    bounds = [(i * count, (i + 1) * count) for i in range(n)]
    if hier is not None:
        await hierarchical_allgather(links, o, target, a, count, hier)
    elif large:
        await ring_allgather(links, o, target, a, [[b] for b in bounds], 0)
    else:
        await bruck_allgather(links, o, target, a, count)
    return target.result()


async def run_reduce_scatter(links: Links, o: Op, flat: Flat, reduce: ReduceOp,
                             bounds: list[tuple[int, int]], large: bool,
                             rows: tuple[int, int]) -> Any:
    """``Group.reduce_scatter``: this rank's ``rows`` of the result, by the
    ring when ``large``, else by recursive doubling over the whole array."""
    n = links.world_size
    lo_row, hi_row = rows
    a = flat.array
    lo, hi = bounds[links.rank]
    if n > 1 and flat.size > 0:
        if large:
            await ring_reduce_scatter(links, o, flat, a, bounds, reduce)
        else:
            await doubling_allreduce(
                links, o, flat, a, ReduceOp.SUM if reduce is ReduceOp.AVG else reduce)
    if reduce is ReduceOp.AVG:
        flat.divide(a[lo:hi], n)
    return flat.original[lo_row:hi_row]


async def run_gather(links: Links, o: Op, flat: Flat, target: Flat | None, root: int) -> Any:
    """``Group.gather``: every rank sends to ``root``, which receives into ``target``."""
    n = links.world_size
    count = flat.size
    if target is None:
        await links.send(root, o, 0, [flat.frame(flat.array)])
        return None
    a = target.array
    a[root * count:(root + 1) * count] = flat.array
    await run_all(*(
        links.recv(peer, o, 0, [target.frame(a[peer * count:(peer + 1) * count])])
        for peer in range(n) if peer != root
    ))
    return target.result()


async def run_scatter(links: Links, o: Op, flat: Flat, source: Flat | None, root: int) -> Any:
    """``Group.scatter``: ``root`` sends each rank its part of ``source``."""
    n = links.world_size
    count = flat.size
    if source is None:
        await links.recv(root, o, 0, [flat.frame(flat.array)])
        return flat.result()
    s = source.array
    flat.array[...] = s[root * count:(root + 1) * count]
    await links.send_each(o, 0, [(peer, [source.frame(s[peer * count:(peer + 1) * count])])
                                 for peer in range(n) if peer != root])
    return flat.result()


async def run_alltoall(links: Links, o: Op, flat: Flat, target: Flat) -> Any:
    """``Group.alltoall`` into ``target``: pairwise exchanges, one peer per step."""
    n = links.world_size
    count = flat.size // n
    src, dst = flat.array, target.array

    def block(array: Any, i: int) -> Any:
        return array[i * count:(i + 1) * count]

    block(dst, links.rank)[...] = block(src, links.rank)
    for step, (to, frm) in enumerate(schedule.pairwise(links.rank, n)):
        await links.exchange(o, step, to, [flat.frame(block(src, to))],
                             frm, [target.frame(block(dst, frm))])
    return target.result()


async def run_barrier(links: Links, o: Op) -> None:
    """``Group.barrier``: empty messages by dissemination, log2 rounds."""
    for step, (to, frm) in enumerate(schedule.dissemination(links.rank, links.world_size)):
        await links.exchange(o, step, to, [], frm, [])


async def run_allreduce_bucket(links: Links, o: Op, parts: list[Flat], reduce: ReduceOp,
                               large: bool, hier: hierarchy.Hierarchy | None) -> None:
    """One allreduce of ``parts`` copied into one scratch array, and back."""
    first = parts[0]
    total = sum(p.size for p in parts)
    buffer = first.empty(total)
    offset = 0
    for p in parts:
        buffer[offset:offset + p.size] = p.array
        offset += p.size
    fused = Flat(buffer, first.xp, buffer, (total,), "C", first.device)
    fused.sync()
    await allreduce_flat(links, o, fused, reduce, large, hier)
    offset = 0
    for p in parts:
        p.array[...] = buffer[offset:offset + p.size]
        offset += p.size
    fused.sync()
