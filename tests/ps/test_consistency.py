"""Clocks and the shard store, without sockets: consistency rules, idempotent pushes."""

from __future__ import annotations

import numpy as np
import pytest

from tensorwire import ps
from tensorwire.errors import ConfigError, InvalidArgument
from tensorwire.ps._consistency import Clocks, Decision
from tensorwire.ps._store import ShardStore


def test_sync_collects_a_step_then_lets_readers_through() -> None:
    clocks = Clocks("sync", 3)
    assert clocks.ready(0, 0)
    for worker in (0, 1):
        assert clocks.admit(worker, 0) is Decision.APPLY
        assert not clocks.record(worker, 0)
    assert not clocks.ready(0, 1)
    assert clocks.behind(1) == [2]
    # A second push from worker 0 for step 1 must wait for step 0.
    assert clocks.admit(0, 1) is Decision.WAIT
    assert clocks.admit(0, 0) is Decision.DUPLICATE
    assert clocks.admit(2, 0) is Decision.APPLY
    assert clocks.record(2, 0)
    clocks.advance()
    assert clocks.ready(0, 1) and clocks.behind(1) == []
    assert clocks.admit(1, 0) is Decision.DUPLICATE
    assert clocks.admit(0, 1) is Decision.APPLY


def test_sync_skips_ahead_when_a_restored_shard_lost_steps() -> None:
    clocks = Clocks("sync", 2)
    clocks.restore({"clocks": [3, 3], "step": 3})
    assert clocks.admit(1, 7) is Decision.APPLY
    assert clocks.step == 7 and clocks.lost_steps == 4
    assert clocks.ready(0, 7) and not clocks.ready(0, 8)


def test_sync_catches_up_to_a_step_a_worker_saw_complete() -> None:
    # Restored at step 3; worker 0 re-sent its push for step 5, which this
    # shard had completed before it died, and worker 1 already read step 6.
    shard = store()
    shard.clocks.restore({"clocks": [3, 3], "step": 3})
    assert push(shard, 0, 5, 1.0, 1.0)
    assert shard.clocks.step == 5
    assert shard.admit(1, 6, seen=6) is Decision.APPLY
    assert shard.clocks.step == 6 and shard.clocks.lost_steps == 3
    # Worker 0's contribution to the lost step 5 was dropped, not applied.
    assert all(entry.acc is None for entry in shard.entries.values())
    assert shard.clocks.ready(0, 6)


def test_ssp_lets_a_worker_run_staleness_steps_ahead() -> None:
    clocks = Clocks("ssp", 2, staleness=2)
    for t in range(3):
        assert clocks.admit(0, t) is Decision.APPLY
        clocks.record(0, t)
    # Worker 0 pushed 3 steps, worker 1 none: reading at clock 3 needs min >= 1.
    assert clocks.ready(0, 2)
    assert not clocks.ready(0, 3)
    assert clocks.behind(3) == [1]
    clocks.record(1, 0)
    assert clocks.ready(0, 3)


def test_async_never_waits() -> None:
    clocks = Clocks("async", 4)
    clocks.record(0, 0)
    assert clocks.ready(0, 100) and clocks.behind(100) == []


def test_bad_clock_settings() -> None:
    with pytest.raises(ConfigError):
        Clocks("eventual", 2)
    with pytest.raises(ConfigError):
        Clocks("sync", 0)
    with pytest.raises(ConfigError):
        Clocks("ssp", 2, staleness=-1)
    with pytest.raises(InvalidArgument):
        Clocks("sync", 2).admit(2, 0)
    with pytest.raises(InvalidArgument):
        Clocks("sync", 2).admit(0, -1)


def payload(values: np.ndarray) -> dict[str, object]:
    return {"codec": "none", "data": values}


def store(mode: str = "sync", workers: int = 2, optimizer: ps.Optimizer | None = None,
          staleness: int = 0) -> ShardStore:
    job = ps.Job(workers, mode, staleness, optimizer or ps.SGD(lr=1.0))  # type: ignore[arg-type]
    shard = ShardStore(job)
    shard.init(["a#0", "b#0"], [np.zeros(3, np.float32), np.ones(2, np.float32)])
    return shard


def push(shard: ShardStore, worker: int, clock: int, a: float, b: float) -> bool:
    assert shard.admit(worker, clock) is Decision.APPLY
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
    assert shard.admit(0, 0) is Decision.DUPLICATE


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
