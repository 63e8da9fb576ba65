"""The communication schedules, checked by simulating them on sets: no sockets."""

from __future__ import annotations

import itertools

import pytest

from tensorwire.collective import _schedule as schedule

SIZES = list(range(1, 18))


@pytest.mark.parametrize("count", [0, 1, 5, 16, 17, 1009])
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_covers_the_range_in_nearly_equal_blocks(count: int, parts: int) -> None:
    bounds = schedule.split(count, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)


def test_segments() -> None:
    assert schedule.segments(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert schedule.segments(5, 5, 4) == [(5, 5)]  # still one (empty) message
    assert schedule.segments(3, 4, 100) == [(3, 4)]


@pytest.mark.parametrize("n", SIZES)
def test_ring_reduce_scatter_then_allgather_gives_everyone_everything(n: int) -> None:
    # holds[r][b]: whose contributions rank r's copy of block b contains.
    holds = [[{r} for _ in range(n)] for r in range(n)]
    for step in range(n - 1):
        sends = [(r, schedule.ring_reduce_scatter(r, n)[step]) for r in range(n)]
        incoming = {(r + 1) % n: set(holds[r][plan.send]) for r, plan in sends}
        for r, plan in sends:
            # The right neighbour reduces exactly the block we send it.
            assert schedule.ring_reduce_scatter((r + 1) % n, n)[step].recv == plan.send
        for r in range(n):
            holds[r][schedule.ring_reduce_scatter(r, n)[step].recv] |= incoming[r]
    for r in range(n):
        assert holds[r][r] == set(range(n)), (r, holds[r])
    # The allgather starts from each rank owning its own reduced block.
    have = [{r: holds[r][r]} for r in range(n)]
    for step in range(n - 1):
        moves = [(r, schedule.ring_allgather(r, n)[step]) for r in range(n)]
        for r, plan in moves:
            assert plan.send in have[r], "a rank sends only what it has"
            right = (r + 1) % n
            assert schedule.ring_allgather(right, n)[step].recv == plan.send
            have[right][plan.send] = have[r][plan.send]
    assert all(sorted(h) == list(range(n)) for h in have)
    assert all(v == set(range(n)) for h in have for v in h.values())


@pytest.mark.parametrize("n", SIZES)
def test_recursive_doubling_reduces_over_every_rank_once(n: int) -> None:
    plans = [schedule.recursive_doubling(r, n) for r in range(n)]
    value: list[list[int]] = [[r] for r in range(n)]  # multiset of contributions
    for r, plan in enumerate(plans):
        if plan.fold_to is not None:
            assert plans[plan.fold_to].absorb == r
            value[plan.fold_to] = value[plan.fold_to] + value[r]
    steps = max(len(p.partners) for p in plans)
    for step in range(steps):
        new = list(value)
        for r, plan in enumerate(plans):
            if plan.fold_to is None:
                partner = plan.partners[step]
                assert plans[partner].partners[step] == r, "partners agree"
                new[r] = value[r] + value[partner]
        value = new
    for r, plan in enumerate(plans):
        if plan.give_back is not None:
            value[plan.give_back] = value[r]
    assert all(sorted(v) == list(range(n)) for v in value)
    assert steps == (n.bit_length() - 1)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("root_of", [lambda n: 0, lambda n: n - 1, lambda n: n // 2])
def test_binomial_tree_reaches_every_rank_once(n: int, root_of: object) -> None:
    root = root_of(n)  # type: ignore[operator]
    reached = {root}
    frontier = [root]
    while frontier:
        rank = frontier.pop()
        _, children = schedule.binomial_tree(rank, n, root)
        for child in children:
            assert schedule.binomial_tree(child, n, root)[0] == rank
            assert child not in reached
            reached.add(child)
            frontier.append(child)
    assert reached == set(range(n))
    assert schedule.binomial_tree(root, n, root)[0] is None
    depth = max(bin((r - root) % n).count("1") for r in range(n))
    assert depth <= max(1, (n - 1).bit_length())


@pytest.mark.parametrize("n", SIZES)
def test_chain_visits_every_rank_from_the_root(n: int) -> None:
    root = n // 3
    order = [root]
    while True:
        _, following = schedule.chain(order[-1], n, root)
        if following is None:
            break
        assert schedule.chain(following, n, root)[0] == order[-1]
        order.append(following)
    assert sorted(order) == list(range(n))


@pytest.mark.parametrize("n", SIZES)
def test_bruck_allgather_collects_every_block(n: int) -> None:
    have = [[r] for r in range(n)]  # relative block i of rank r = block of rank r + i
    for step in range(len(schedule.bruck_steps(0, n))):
        new = [list(h) for h in have]
        for r in range(n):
            plan = schedule.bruck_steps(r, n)[step]
            sender = plan.recv_from
            assert schedule.bruck_steps(sender, n)[step].send_to == r
            assert len(new[r]) == plan.offset
            new[r].extend(have[sender][: plan.count])
        have = new
    for r in range(n):
        assert have[r] == [(r + i) % n for i in range(n)]
    assert len(schedule.bruck_steps(0, n)) == (n - 1).bit_length()


@pytest.mark.parametrize("n", SIZES)
def test_dissemination_and_pairwise(n: int) -> None:
    rounds = [schedule.dissemination(r, n) for r in range(n)]
    # After the rounds each rank has heard, directly or not, from every rank.
    heard = [{r} for r in range(n)]
    for k in range(len(rounds[0])):
        heard = [heard[r] | heard[rounds[r][k][1]] for r in range(n)]
        assert all(rounds[rounds[r][k][1]][k][0] == r for r in range(n))
    assert all(h == set(range(n)) for h in heard)
    pairs = {(r, to) for r in range(n) for to, _ in schedule.pairwise(r, n)}
    assert pairs == {(a, b) for a in range(n) for b in range(n) if a != b}
    for r in range(n):
        for step, (to, frm) in enumerate(schedule.pairwise(r, n)):
            assert schedule.pairwise(to, n)[step][1] == r
            assert schedule.pairwise(frm, n)[step][0] == r


def test_buckets_follow_priority_kind_and_size() -> None:
    kinds = ["f4", "f4", "f8", "f4", "f4"]
    sizes = [10, 10, 10, 30, 10]
    # Priority order 4, 0, 1, 2, 3: same-kind neighbours share a bucket up to
    # 25 bytes; the f8 array and the 30-byte one stand alone.
    assert schedule.buckets(kinds, sizes, [1, 2, 3, 4, 0], 25) == [[4, 0], [1], [2], [3]]
    assert schedule.buckets(kinds, sizes, [0, 0, 0, 0, 0], 100) == [[0, 1], [2], [3, 4]]
    assert schedule.buckets([], [], [], 8) == []
