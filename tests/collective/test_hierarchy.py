"""The hierarchical schedules, checked by simulating them on sets: no sockets."""

from __future__ import annotations

import itertools

import pytest

from tensorwire.collective import _hierarchy as hierarchy
from tensorwire.collective import _schedule as schedule

#: Hosts as rank lists: even, uneven (3, 1, 2), one host, one rank per
#: host, and ranks placed round robin rather than contiguously.
TOPOLOGIES = [
    [[0, 1], [2, 3]],
    [[0, 1, 2], [3], [4, 5]],
    [[0], [1, 2, 3], [4, 5]],
    [[0, 1, 2, 3]],
    [[0], [1], [2]],
    [[0, 2, 4], [1, 3]],
    [[0, 3], [1, 4], [2, 5]],
    [[5, 0], [4, 1, 2], [3]],
    [[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11]],
]


def chain_order(hier: hierarchy.Hierarchy, host: int) -> list[int]:
    """The order in which a host's chain reduce runs: from the far end to the leader."""
    local = hier.hosts[host]
    plans = {r: hierarchy.allreduce_plan(hier, r) for r in local}
    (tail,) = [r for r in local if plans[r].reduce_from is None]
    order = [tail]
    while plans[order[-1]].reduce_to is not None:
        nxt = plans[order[-1]].reduce_to
        assert plans[nxt].reduce_from == order[-1], "both ends agree on each link"
        order.append(nxt)
    assert sorted(order) == sorted(local) and order[-1] == local[0]
    return order


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_hierarchical_allreduce_reduces_every_rank_once_everywhere(
        topology: list[list[int]]) -> None:
    hier = hierarchy.hierarchy(topology)
    n = hier.size
    leaders = hier.leaders
    # Multisets of contributions, per rank and ring block.
    value: dict[int, list[int]] = {r: [r] for r in range(n)}
    inter_host_messages = 0
    for host in range(len(hier.hosts)):
        order = chain_order(hier, host)
        for sender, receiver in itertools.pairwise(order):
            value[receiver] = value[receiver] + value[sender]
    for leader in leaders:
        assert sorted(value[leader]) == sorted(hier.local(leader))
    # The ring among the leaders, block by block.
    h = len(leaders)
    plans = {r: hierarchy.allreduce_plan(hier, r) for r in range(n)}
    assert all(plans[r].ring == leaders for r in leaders)
    assert all(plans[r].ring == () for r in range(n) if r not in leaders)
    holds = {p: [list(value[leaders[p]]) for _ in range(h)] for p in range(h)}
    for step in range(h - 1):
        sent = {}
        for p in range(h):
            assert plans[leaders[p]].position == p
            plan = schedule.ring_reduce_scatter(p, h)[step]
            sent[(p + 1) % h] = (plan.send, list(holds[p][plan.send]))
            inter_host_messages += 1
        for p in range(h):
            block, contribution = sent[p]
            assert schedule.ring_reduce_scatter(p, h)[step].recv == block
            holds[p][block] = holds[p][block] + contribution
    for p in range(h):
        assert sorted(holds[p][p]) == list(range(n))
    for step in range(h - 1):
        moves = {}
        for p in range(h):
            plan = schedule.ring_allgather(p, h)[step]
            moves[(p + 1) % h] = (plan.send, holds[p][plan.send])
            inter_host_messages += 1
        for p in range(h):
            block, got = moves[p]
            holds[p][block] = got
    assert all(sorted(b) == list(range(n)) for p in range(h) for b in holds[p])
    # The chain broadcast inside each host, from the leader.
    have = {leader: True for leader in leaders}
    for host in range(len(hier.hosts)):
        order = list(reversed(chain_order(hier, host)))
        for sender, receiver in itertools.pairwise(order):
            assert plans[sender].bcast_to == receiver and plans[receiver].bcast_from == sender
            assert have.get(sender)
            have[receiver] = True
    assert sorted(have) == list(range(n))
    # Between hosts only the leaders' ring: 2 (h - 1) messages each, not 2 (n - 1).
    assert inter_host_messages == 2 * h * (h - 1)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_hierarchical_allgather_gives_everyone_every_block(topology: list[list[int]]) -> None:
    hier = hierarchy.hierarchy(topology)
    n = hier.size
    plans = {r: hierarchy.allgather_plan(hier, r) for r in range(n)}
    have: dict[int, set[int]] = {r: {r} for r in range(n)}
    for r in range(n):
        if plans[r].gather_to is not None:
            leader = plans[r].gather_to
            assert r in plans[leader].gather_from
            have[leader].add(r)
    leaders = hier.leaders
    h = len(leaders)
    for p, leader in enumerate(leaders):
        assert set(plans[leader].blocks[p]) == have[leader], "a leader holds its host block"
    hosts_held = {p: {p} for p in range(h)}
    for step in range(h - 1):
        moves = {}
        for p in range(h):
            plan = schedule.ring_allgather(p, h)[step]
            assert plan.send in hosts_held[p]
            moves[(p + 1) % h] = plan.send
        for p in range(h):
            hosts_held[p].add(moves[p])
    for p, leader in enumerate(leaders):
        assert hosts_held[p] == set(range(h))
        have[leader] = {r for q in hosts_held[p] for r in plans[leader].blocks[q]}
    for host in range(h):
        order = list(reversed(chain_order(hier, host)))
        for sender, receiver in itertools.pairwise(order):
            assert plans[receiver].bcast_from == sender
            have[receiver] = set(have[sender])
    assert all(have[r] == set(range(n)) for r in range(n))


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_hierarchical_broadcast_reaches_every_rank_once_crossing_each_host_once(
        topology: list[list[int]]) -> None:
    hier = hierarchy.hierarchy(topology)
    n = hier.size
    for root in range(n):
        plans = {r: hierarchy.broadcast_plan(hier, r, root) for r in range(n)}
        assert plans[root].previous is None
        reached = {root}
        frontier = [root]
        crossings = 0
        while frontier:
            rank = frontier.pop()
            for follower in plans[rank].followers:
                assert plans[follower].previous == rank
                assert follower not in reached
                reached.add(follower)
                frontier.append(follower)
                crossings += hier.host_of[follower] != hier.host_of[rank]
        assert reached == set(range(n))
        # Each host other than the root's receives the data over its link once.
        assert crossings == len(hier.hosts) - 1
        # Nobody sends more than twice: once to the next host, once on its own.
        assert all(len(p.followers) <= 2 for p in plans.values())


def test_the_topology_is_normalised_and_checked() -> None:
    hier = hierarchy.hierarchy({"b": [3, 2], "a": [1, 0]})
    assert hier.hosts == ((0, 1), (2, 3))
    assert hier.leaders == (0, 2)
    assert hier.helps
    assert hierarchy.hierarchy([[0, 1], [2, 3]]) is hier, "cached"
    assert not hierarchy.hierarchy([[0], [1]]).helps
    assert not hierarchy.hierarchy([[0, 1, 2]]).helps
    with pytest.raises(ValueError, match="once each"):
        hierarchy.hierarchy([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="once each"):
        hierarchy.hierarchy([[0], [2]])
