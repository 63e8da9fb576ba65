"""Hierarchical schedules: inside each host first, then one leader per host.

Pure functions of the group's topology (which ranks share a host) and a
rank: no I/O, no arrays, cached, tested by simulation like
:mod:`._schedule`. Cached plans are shared: callers must not change them.

An allreduce reduces inside each host along a chain that ends at the host's
*leader* (its lowest rank), runs the bandwidth-optimal ring among the
leaders (one per host, so each host's link carries one ring's traffic
whatever its number of ranks), and broadcasts the result inside each host
along the same chain. An allgather gathers each host's blocks at its leader,
ring-allgathers host blocks among the leaders, and broadcasts. A broadcast
follows a chain through one rank per host (the root on its own host) that
hands each segment on to the next host and into its own host's chain, so
every host's link carries the data once. This is the intra-node /
inter-node split of NCCL's and Horovod's hierarchical allreduce (Sergeev
and Del Balso, "Horovod", arXiv:1802.05799; Jeaugey, "Massively scale your
deep learning training with NCCL 2.4", 2019).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

__all__ = (
    "AllgatherPlan",
    "AllreducePlan",
    "BroadcastPlan",
    "Hierarchy",
    "allgather_plan",
    "allreduce_plan",
    "broadcast_plan",
    "hierarchy",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Hierarchy:
    """Ranks grouped by host.

    ``hosts[h]`` are the ranks on host ``h`` in increasing order; hosts are
    ordered by their lowest rank, which is the host's leader.
    """

    hosts: tuple[tuple[int, ...], ...]
    #: rank -> index of its host in ``hosts``.
    host_of: Mapping[int, int] = dataclasses.field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "host_of", {
            rank: h for h, ranks in enumerate(self.hosts) for rank in ranks})

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(ranks[0] for ranks in self.hosts)

    @property
    def size(self) -> int:
        return sum(len(ranks) for ranks in self.hosts)

    @property
    def helps(self) -> bool:
        """Several hosts, and more than one rank on some: the only case in
        which the hierarchy moves fewer bytes between hosts than a flat ring."""
        return len(self.hosts) > 1 and any(len(ranks) > 1 for ranks in self.hosts)

    def local(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s host, leader first."""
        return self.hosts[self.host_of[rank]]


@functools.cache
def _hierarchy(hosts: tuple[tuple[int, ...], ...]) -> Hierarchy:
    return Hierarchy(hosts)


def hierarchy(topology: Mapping[str, Sequence[int]] | Sequence[Sequence[int]]) -> Hierarchy:
    """The :class:`Hierarchy` of a topology (host -> ranks, or a list of rank lists).

    Raises:
        ValueError: the ranks are not ``0 .. n - 1``, each exactly once.
    """
    groups = topology.values() if isinstance(topology, Mapping) else topology
    hosts = sorted((tuple(sorted(int(r) for r in ranks)) for ranks in groups if len(ranks)),
                   key=lambda ranks: ranks[0])
    flat = sorted(r for ranks in hosts for r in ranks)
    if flat != list(range(len(flat))):
        raise ValueError(f"a topology must place ranks 0..n-1 once each, got {hosts}")
    return _hierarchy(tuple(hosts))


@dataclasses.dataclass(frozen=True, slots=True)
class AllreducePlan:
    """One rank's part in a hierarchical allreduce.

    1. Chain reduce toward the leader: receive a partial sum from
       ``reduce_from`` (if any) and add it in, then send the sum to
       ``reduce_to`` (if any). The leader ends up with its host's sum.
    2. Leaders only (``ring`` non-empty): ring allreduce among ``ring`` (the
       leaders, in host order), where this rank is ``ring[position]``.
    3. Chain broadcast from the leader: receive from ``bcast_from``, pass
       on to ``bcast_to``.
    """

    reduce_from: int | None
    reduce_to: int | None
    ring: tuple[int, ...]
    position: int
    bcast_from: int | None
    bcast_to: int | None


@functools.cache
def allreduce_plan(hier: Hierarchy, rank: int) -> AllreducePlan:
    """The hierarchical allreduce plan of ``rank``."""
    local = hier.local(rank)
    i = local.index(rank)
    following = local[i + 1] if i + 1 < len(local) else None
    previous = local[i - 1] if i > 0 else None
    leaders = hier.leaders
    leading = i == 0
    return AllreducePlan(
        reduce_from=following,
        reduce_to=previous,
        ring=leaders if leading else (),
        position=leaders.index(rank) if leading else -1,
        bcast_from=previous,
        bcast_to=following,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class AllgatherPlan:
    """One rank's part in a hierarchical allgather.

    1. Non-leaders send their block to ``gather_to``; a leader receives the
       blocks of ``gather_from`` into their places.
    2. Leaders ring-allgather host blocks among ``ring``: host ``h``'s block
       is the blocks of ``blocks[h]`` (its ranks).
    3. Chain broadcast of the whole result from the leader, as in
       :class:`AllreducePlan`.
    """

    gather_to: int | None
    gather_from: tuple[int, ...]
    ring: tuple[int, ...]
    position: int
    blocks: tuple[tuple[int, ...], ...]
    bcast_from: int | None
    bcast_to: int | None


@functools.cache
def allgather_plan(hier: Hierarchy, rank: int) -> AllgatherPlan:
    """The hierarchical allgather plan of ``rank``."""
    reduce = allreduce_plan(hier, rank)
    local = hier.local(rank)
    leading = local[0] == rank
    return AllgatherPlan(
        gather_to=None if leading else local[0],
        gather_from=local[1:] if leading else (),
        ring=reduce.ring,
        position=reduce.position,
        blocks=hier.hosts,
        bcast_from=reduce.bcast_from,
        bcast_to=reduce.bcast_to,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class BroadcastPlan:
    """Receive each segment from ``previous`` (none on the root), then send
    it to each of ``followers`` in order."""

    previous: int | None
    followers: tuple[int, ...]


@functools.cache
def broadcast_plan(hier: Hierarchy, rank: int, root: int) -> BroadcastPlan:
    """``rank``'s place in the hierarchical broadcast from ``root``.

    One rank per host carries the data between hosts: the root on its own
    host, the leader on every other. They form a chain that starts at the
    root's host and visits the others in order; each of them also starts a
    chain through the other ranks of its host. A carrier sends to the next
    host first, so the slow link starts as early as possible.
    """
    root_host = hier.host_of[root]
    count = len(hier.hosts)
    order = [(root_host + k) % count for k in range(count)]
    carriers = [root if h == root_host else hier.hosts[h][0] for h in order]

    def chain_of(h: int, carrier: int) -> list[int]:
        return [carrier, *(r for r in hier.hosts[h] if r != carrier)]

    previous: int | None = None
    followers: list[int] = []
    for k, h in enumerate(order):
        chain = chain_of(h, carriers[k])
        if rank not in chain:
            continue
        i = chain.index(rank)
        if i == 0:
            previous = carriers[k - 1] if k > 0 else None
            if k + 1 < count:
                followers.append(carriers[k + 1])
        else:
            previous = chain[i - 1]
        if i + 1 < len(chain):
            followers.append(chain[i + 1])
    return BroadcastPlan(previous=previous, followers=tuple(followers))
