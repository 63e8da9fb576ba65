"""Clocks and the shard store, without sockets: consistency rules, idempotent pushes."""

from __future__ import annotations

import numpy as np
import pytest

from tensorwire import ps
from tensorwire.errors import ConfigError, InvalidArgument
from tensorwire.ps._consistency import Clocks, Decision
from tensorwire.ps._store import ShardStore

K = ["a#0"]


def clocks(mode: str, workers: int, staleness: int = 0) -> Clocks:
    result = Clocks(mode, workers, staleness)
    result.add("a#0")
    return result


def take(c: Clocks, worker: int, clock: int, key: str = "a#0") -> bool:
    assert c.accepts(worker, clock, key)
    return c.record(worker, clock, key)


def test_sync_collects_a_step_then_lets_readers_through() -> None:
    c = clocks("sync", 3)
    assert c.ready(0, 0, K)
    for worker in (0, 1):
        assert c.admit(worker, 0, K) == (Decision.APPLY, [])
        assert not take(c, worker, 0)
    assert not c.ready(0, 1, K)
    assert c.behind(1, K) == [2]
    # A second push from worker 0 for step 1 must wait for step 0.
    assert c.admit(0, 1, K)[0] is Decision.WAIT
    assert c.waiting_for(K) == [2]
    assert c.admit(0, 0, K)[0] is Decision.DUPLICATE
    assert c.admit(2, 0, K)[0] is Decision.APPLY
    assert take(c, 2, 0)
    c.advance("a#0")
    assert c.ready(0, 1, K) and c.behind(1, K) == []
    assert c.admit(1, 0, K)[0] is Decision.DUPLICATE
    assert c.admit(0, 1, K)[0] is Decision.APPLY
    assert c.step == 1 and c.clocks == [1, 1, 1]


def test_chunks_keep_their_own_steps() -> None:
    c = clocks("sync", 1)
    c.add("b#0")
    assert take(c, 0, 0, "a#0")
    c.advance("a#0")
    # Chunk a finished step 0, chunk b (pushed in another message) not yet.
    assert c.ready(0, 1, K) and not c.ready(0, 1, ["a#0", "b#0"])
    assert c.step == 0
    with pytest.raises(InvalidArgument):
        c.ready(0, 1, ["nope#0"])


def test_sync_skips_ahead_when_a_restored_shard_lost_steps() -> None:
    c = Clocks("sync", 2)
    c.restore({"a#0": {"taken": [3, 3], "step": 3}})
    # The worker has read step 7: proof that this shard restarted from an older one.
    assert c.admit(1, 7, K, seen=7) == (Decision.APPLY, [])
    assert c.step == 7 and c.lost_steps == 4
    assert c.ready(0, 7, K) and not c.ready(0, 8, K)


def test_sync_push_arriving_before_the_one_it_follows_waits() -> None:
    # A retried push can overtake its predecessor: step 1 of worker 0 comes
    # before its step 0. It must wait, not skip step 0 (losing every worker's
    # gradient of it).
    c = clocks("sync", 2)
    assert c.admit(0, 1, K)[0] is Decision.WAIT
    assert c.lost_steps == 0
    for worker in (0, 1):
        assert c.admit(worker, 0, K)[0] is Decision.APPLY
        take(c, worker, 0)
    c.advance("a#0")
    assert c.admit(0, 1, K)[0] is Decision.APPLY
    assert c.step == 1 and c.lost_steps == 0


def test_ssp_lets_a_worker_run_staleness_steps_ahead() -> None:
    c = clocks("ssp", 2, staleness=2)
    for t in range(3):
        assert c.admit(0, t, K)[0] is Decision.APPLY
        take(c, 0, t)
    assert c.admit(0, 1, K)[0] is Decision.DUPLICATE
    # Worker 0 pushed 3 steps, worker 1 none: reading at clock 3 needs min >= 1.
    assert c.ready(0, 2, K)
    assert not c.ready(0, 3, K)
    assert c.behind(3, K) == [1]
    take(c, 1, 0)
    assert c.ready(0, 3, K)


def test_async_never_waits() -> None:
    c = clocks("async", 4)
    take(c, 0, 0)
    assert c.ready(0, 100, K) and c.behind(100, K) == []


def test_bad_clock_settings() -> None:
    with pytest.raises(ConfigError):
        Clocks("eventual", 2)
    with pytest.raises(ConfigError):
        Clocks("sync", 0)
    with pytest.raises(ConfigError):
        Clocks("ssp", 2, staleness=-1)
    with pytest.raises(InvalidArgument):
        clocks("sync", 2).admit(2, 0, K)
    with pytest.raises(InvalidArgument):
        clocks("sync", 2).admit(0, -1, K)


def payload(values: np.ndarray) -> dict[str, object]:
    return {"codec": "none", "data": values}


def store(mode: str = "sync", workers: int = 2, optimizer: ps.Optimizer | None = None,
          staleness: int = 0) -> ShardStore:
    job = ps.Job(workers, mode, staleness, optimizer or ps.SGD(lr=1.0))  # type: ignore[arg-type]
    shard = ShardStore(job)
    shard.init(["a#0", "b#0"], [np.zeros(3, np.float32), np.ones(2, np.float32)])
    return shard


def push(shard: ShardStore, worker: int, clock: int, a: float, b: float) -> bool:
    assert shard.admit(worker, clock, ["a#0", "b#0"]) is Decision.APPLY
    return shard.push(worker, clock, ["a#0", "b#0"],
                      [payload(np.full(3, a, np.float32)), payload(np.full(2, b, np.float32))])


def test_first_init_wins_and_mismatches_are_refused() -> None:
    shard = store()
    shard.init(["a#0"], [np.full(3, 9, np.float32)])
    np.testing.assert_array_equal(shard.values(["a#0"])[0], 0)
    with pytest.raises(InvalidArgument):
        shard.init(["a#0"], [np.zeros(4, np.float32)])
    with pytest.raises(InvalidArgument):
        shard.init(["c#0"], [np.zeros(4, np.int32)])
    with pytest.raises(InvalidArgument):
        shard.values(["nope#0"])


def test_sync_applies_the_mean_once_every_worker_pushed() -> None:
    shard = store()
    assert push(shard, 0, 0, 1.0, 2.0)
    np.testing.assert_array_equal(shard.values(["a#0"])[0], 0)
    # A retry of the same (worker, clock, chunk) changes nothing.
    assert not shard.push(0, 0, ["a#0"], [payload(np.full(3, 100, np.float32))])
    assert push(shard, 1, 0, 3.0, 4.0)
    a, b = shard.values(["a#0", "b#0"])
    np.testing.assert_array_equal(a, -2.0)   # 0 - 1.0 * mean(1, 3)
    np.testing.assert_array_equal(b, -2.0)   # 1 - 1.0 * mean(2, 4)
    assert shard.admit(0, 0, ["a#0", "b#0"]) is Decision.DUPLICATE


def test_async_applies_each_push_once_scaled_by_the_worker_count() -> None:
    shard = store("async")
    assert push(shard, 0, 0, 2.0, 2.0)
    np.testing.assert_array_equal(shard.values(["a#0"])[0], -1.0)
    assert not shard.push(0, 0, ["a#0"], [payload(np.full(3, 2.0, np.float32))])
    assert push(shard, 0, 1, 2.0, 2.0)
    np.testing.assert_array_equal(shard.values(["a#0"])[0], -2.0)
    assert shard.clocks.clocks == [2, 0]


def test_aggregate_keeps_the_summed_gradient() -> None:
    shard = store(optimizer=ps.Aggregate())
    push(shard, 0, 0, 1.0, 1.0)
    push(shard, 1, 0, 2.0, 5.0)
    np.testing.assert_array_equal(shard.values(["a#0", "b#0"])[1], 6.0)


def test_a_bad_payload_changes_nothing() -> None:
    shard = store("async")
    with pytest.raises(InvalidArgument):
        shard.push(0, 0, ["a#0", "b#0"], [payload(np.ones(3, np.float32)),
                                          payload(np.ones(5, np.float32))])
    np.testing.assert_array_equal(shard.values(["a#0"])[0], 0)
    assert shard.clocks.clocks == [0, 0]


def test_snapshot_restore_round_trip_continues_identically() -> None:
    shard = store("ssp", optimizer=ps.Adam(lr=0.1), staleness=1)
    push(shard, 0, 0, 1.0, -1.0)
    push(shard, 1, 0, 0.5, 0.5)
    meta, arrays = shard.snapshot()
    twin = ShardStore.restore(meta, arrays)
    assert twin.job == shard.job and twin.clocks.clocks == [1, 1]
    assert twin.clocks.snapshot() == shard.clocks.snapshot()
    for copy in (shard, twin):
        push(copy, 0, 1, 0.3, 0.3)
        assert not copy.push(0, 1, ["a#0"], [payload(np.ones(3, np.float32))])
    for key in ("a#0", "b#0"):
        np.testing.assert_array_equal(shard.values([key])[0], twin.values([key])[0])


def test_job_validation() -> None:
    with pytest.raises(ConfigError):
        ps.Job(2, "async", 0, ps.Aggregate())
    with pytest.raises(ConfigError):
        ps.Job(2, "sync", 3, ps.SGD(lr=0.1))
    with pytest.raises(ConfigError):
        ps.Job(0, "sync", 0, ps.SGD(lr=0.1))
    job = ps.Job(3, "ssp", 2, ps.Adam())
    assert ps.Job.from_wire(job.to_wire()) == job


def test_decide_is_a_pure_check_and_admit_acts_on_it() -> None:
    c = Clocks("sync", 2)
    c.restore({"a#0": {"taken": [3, 3], "step": 3}})
    before = c.snapshot()
    # What admit would say, asked any number of times, changes nothing ...
    for _ in range(3):
        assert c.decide(1, 7, K, seen=7) is Decision.APPLY
        assert c.decide(1, 8, K, seen=7) is Decision.WAIT
    assert c.snapshot() == before and c.lost_steps == 0
    # ... and admit does what decide said, then changes the clocks.
    assert c.admit(1, 7, K, seen=7) == (Decision.APPLY, [])
    assert c.step == 7 and c.lost_steps == 4


def test_a_moved_chunk_keeps_its_idempotence_keys_and_partial_step() -> None:
    source = store("sync", workers=3, optimizer=ps.Adam(lr=0.1))
    for worker in range(3):
        push_all(source, worker, 0, 1.0 + worker)
    # Step 1 is half collected when the chunks move.
    push_all(source, 0, 1, 2.0)
    records = source.export(["a#0", "b#0"])
    assert source.values(["a#0"])  # export changes nothing on the source
    target = ShardStore(source.job)
    target.begin({"version": 1, "addresses": ["x"], "shard_of": {"a#0": 0, "b#0": 0},
                  "step": 1}, 0)
    assert target.incoming == {"a#0", "b#0"}
    assert target.adopt(records) == 2 and not target.incoming
    assert target.adopt(records) == 0  # a retried transfer keeps what is there
    twin = ShardStore.restore(*source.snapshot())
    twin.push(0, 1, ["a#0", "b#0"], [payload(np.full(3, 2.0, np.float32)),
                                     payload(np.full(2, 2.0, np.float32))])
    # Worker 0's push of step 1 moved with the chunk: a retry is a duplicate.
    assert target.admit(0, 1, ["a#0", "b#0"]) is Decision.DUPLICATE
    assert not target.push(0, 1, ["a#0"], [payload(np.full(3, 50.0, np.float32))])
    for worker in (1, 2):
        push_all(target, worker, 1, 3.0)
        push_all(twin, worker, 1, 3.0)
    for key in ("a#0", "b#0"):
        np.testing.assert_array_equal(target.values([key])[0], twin.values([key])[0])
    assert target.clocks.snapshot() == twin.clocks.snapshot()
    source.release(["a#0"])
    assert list(source.entries) == ["b#0"] and "a#0" not in source.clocks.chunks


def push_all(shard: ShardStore, worker: int, clock: int, value: float) -> None:
    keys = ["a#0", "b#0"]
    assert shard.admit(worker, clock, keys) is Decision.APPLY
    shard.push(worker, clock, keys, [payload(np.full(3, value, np.float32)),
                                     payload(np.full(2, value, np.float32))])
