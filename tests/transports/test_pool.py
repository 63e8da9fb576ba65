"""The receive buffer pool: reuse of freed blocks, never of held ones, and its limits."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np
import pytest

from tensorwire.errors import ConfigError
from tensorwire.transports import BufferPool, buffer_pool
from tensorwire.transports._frames import host_empty
from tensorwire.transports._pool import POOL_MIN_BYTES

MiB = 1 << 20


def address(array: Any) -> int:
    return int(np.asarray(array).ctypes.data)


def test_empty_is_an_aligned_writable_uint8_array_of_the_size_asked() -> None:
    pool = BufferPool()
    for nbytes, align in ((MiB, 64), (3 * MiB + 5, 64), (2 * MiB, 4096)):
        array = pool.empty(nbytes, align=align)
        assert array.dtype == np.uint8
        assert array.shape == (nbytes,)
        assert array.flags.writeable and array.flags.c_contiguous
        assert address(array) % align == 0
        array[:] = 7
        assert int(array.sum()) == 7 * nbytes


def test_a_freed_block_is_handed_out_again() -> None:
    pool = BufferPool()
    first = pool.empty(4 * MiB)
    where = address(first)
    del first
    assert pool.stats().cached_blocks == 1
    second = pool.empty(4 * MiB)
    assert address(second) == where
    stats = pool.stats()
    assert (stats.hits, stats.misses, stats.cached_blocks, stats.cached_bytes) == (1, 1, 0, 0)


@pytest.mark.parametrize(
    "keep",
    [
        lambda a: a[1:],
        lambda a: memoryview(a),
        lambda a: np.frombuffer(a, np.float32),
        lambda a: a.view(np.float64).reshape(2, -1),
        lambda a: memoryview(a).cast("B")[10:],
    ],
    ids=["slice", "memoryview", "frombuffer", "reshaped view", "memoryview slice"],
)
def test_a_block_is_not_reused_while_anything_can_reach_its_memory(keep: Any) -> None:
    pool = BufferPool()
    array = pool.empty(2 * MiB)
    array[:] = 1
    where = address(array)
    kept = keep(array)
    del array
    other = pool.empty(2 * MiB)
    assert address(other) != where
    other[:] = 2
    assert bytes(memoryview(kept).cast("B")[:4]) == b"\x01" * 4
    del kept
    assert address(pool.empty(2 * MiB)) == where


def test_a_torch_tensor_keeps_its_block() -> None:
    torch = pytest.importorskip("torch")
    pool = BufferPool()
    array = pool.empty(2 * MiB)
    array[:] = 3
    tensor = torch.from_numpy(array)
    where = address(array)
    del array
    assert address(pool.empty(2 * MiB)) != where
    assert int(tensor[0]) == 3
    del tensor
    assert address(pool.empty(2 * MiB)) == where


def test_near_sizes_share_a_block_and_far_ones_do_not() -> None:
    pool = BufferPool()
    array = pool.empty(4 * MiB + 100_000)
    where = address(array)
    del array
    # Both round up to 4.5 MiB (8 sizes per power of two); 4 MiB is a size
    # of its own.
    assert address(pool.empty(4 * MiB + 400_000)) == where
    assert pool.stats().hits == 1
    other = pool.empty(4 * MiB)
    assert address(other) != where
    assert pool.stats().misses == 2
    del other


def test_a_power_of_two_size_is_not_rounded_up() -> None:
    pool = BufferPool()
    del_me = pool.empty(64 * MiB)
    del del_me
    # Only the slack for the alignment (and offset) comes on top.
    assert pool.stats().cached_bytes == 64 * MiB + 64


def test_empty_starts_the_data_at_the_offset_asked_past_the_boundary() -> None:
    pool = BufferPool()
    for nbytes in (MiB, 3 * MiB + 5, 64 * MiB):
        for offset in (0, 16, 63):
            array = pool.empty(nbytes, align=64, offset=offset)
            assert array.shape == (nbytes,)
            assert address(array) % 64 == offset
            array[-1] = 1  # the whole size is usable
            del array


def test_one_block_serves_every_offset() -> None:
    pool = BufferPool()
    first = pool.empty(8 * MiB, offset=16)
    block = address(first) - 16
    del first
    again = pool.empty(8 * MiB, offset=0)
    assert address(again) == block
    assert pool.stats().hits == 1 and pool.stats().misses == 1


@pytest.mark.parametrize("offset", [-1, 64, 1.5, True])
def test_an_offset_outside_the_alignment_is_refused(offset: Any) -> None:
    with pytest.raises(ValueError, match="past a boundary"):
        BufferPool().empty(MiB, align=64, offset=offset)


def test_idle_bytes_stay_under_max_bytes_dropping_the_oldest() -> None:
    pool = BufferPool(max_bytes=10 * MiB)
    arrays = [pool.empty(4 * MiB) for _ in range(3)]
    where = [address(a) for a in arrays]
    del arrays[0]
    del arrays[0]
    assert pool.stats().cached_blocks == 2
    arrays.clear()
    stats = pool.stats()
    assert stats.cached_blocks == 2 and stats.cached_bytes <= 10 * MiB
    arrays = [pool.empty(4 * MiB), pool.empty(4 * MiB)]
    assert {address(a) for a in arrays} == set(where[1:])


def test_a_block_larger_than_max_bytes_is_never_kept_and_zero_turns_the_pool_off() -> None:
    pool = BufferPool(max_bytes=2 * MiB)
    del_me = pool.empty(4 * MiB)
    del del_me
    assert pool.stats().cached_blocks == 0
    pool.configure(max_bytes=0)
    small = pool.empty(MiB)
    del small
    assert pool.stats().cached_bytes == 0


def test_configure_drops_what_no_longer_fits_and_clear_drops_everything() -> None:
    pool = BufferPool()
    arrays = [pool.empty(4 * MiB) for _ in range(3)]
    arrays.clear()
    assert pool.stats().cached_blocks == 3
    pool.configure(max_bytes=9 * MiB)
    assert pool.stats().cached_blocks == 2
    pool.clear()
    assert pool.stats().cached_blocks == 0


def test_a_block_idle_longer_than_idle_s_is_dropped_at_the_next_use() -> None:
    pool = BufferPool(idle_s=0.05)
    del_me = pool.empty(2 * MiB)
    del del_me
    assert pool.stats().cached_blocks == 1
    time.sleep(0.1)
    fresh = pool.empty(2 * MiB)
    stats = pool.stats()
    assert (stats.hits, stats.cached_blocks) == (0, 0)
    time.sleep(0.1)
    other = pool.empty(3 * MiB)
    del other  # a block given back drops the ones idle too long, too
    assert pool.stats().cached_blocks == 1
    del fresh


@pytest.mark.parametrize(("nbytes", "align"), [(-1, 64), (1.5, 64), (True, 64), (MiB, 0)])
def test_bad_sizes_are_refused(nbytes: Any, align: Any) -> None:
    with pytest.raises(ValueError, match="cannot allocate"):
        BufferPool().empty(nbytes, align=align)


@pytest.mark.parametrize(
    "settings",
    [{"max_bytes": -1}, {"max_bytes": 1.5}, {"max_bytes": True}, {"idle_s": 0}, {"idle_s": "1"}],
)
def test_bad_settings_are_refused(settings: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        BufferPool(**settings)
    with pytest.raises(ConfigError):
        BufferPool().configure(**settings)


def test_arrays_dropped_in_another_thread_come_back() -> None:
    pool = BufferPool()
    arrays = [pool.empty(2 * MiB) for _ in range(4)]

    def drop() -> None:
        arrays.clear()

    thread = threading.Thread(target=drop)
    thread.start()
    thread.join()
    assert pool.stats().cached_blocks == 4


def test_an_array_collected_from_a_reference_cycle_comes_back() -> None:
    pool = BufferPool()
    cycle: list[Any] = [pool.empty(2 * MiB)]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert pool.stats().cached_blocks == 1


def test_a_block_given_back_inside_the_pools_own_section_waits_for_its_end() -> None:
    # What a collection that runs a lease's __del__ while this thread holds
    # the pool's lock does: the block is kept once the section ends.
    pool = BufferPool()
    block = np.empty(2 * MiB, np.uint8)
    with pool._section():
        pool._give(block)
        assert pool._deferred == [block]
        assert pool._cached == 0
    assert pool.stats().cached_blocks == 1


def test_a_child_forked_while_another_thread_holds_the_lock_can_use_the_pool() -> None:
    pool = BufferPool()
    idle = pool.empty(3 * MiB)
    del idle
    kept = pool.empty(2 * MiB)
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._section():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert entered.wait(10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork beside a thread (3.12+)
        pid = os.fork()
    if pid == 0:
        # The child starts with an empty pool, in a state it can use.
        emptied = pool.stats().cached_blocks == 0
        del kept
        os._exit(0 if emptied and pool.stats().cached_blocks == 1 else 1)
    leave.set()
    thread.join()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    if done == (0, 0):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the pool's lock")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_host_empty_pools_large_buffers_only() -> None:
    pool = buffer_pool()
    before = pool.stats()
    small = host_empty(POOL_MIN_BYTES - 1)
    assert address(small) % 64 == 0
    assert address(host_empty(1000, 48)) % 64 == 48
    assert address(host_empty(POOL_MIN_BYTES, 16)) % 64 == 16
    before = pool.stats()
    assert pool.stats().misses + pool.stats().hits == before.misses + before.hits
    large = host_empty(POOL_MIN_BYTES)
    after = pool.stats()
    assert after.misses + after.hits == before.misses + before.hits + 1
    del small, large


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_process_pool_takes_its_limit_from_the_environment() -> None:
    code = "from tensorwire.transports import buffer_pool; print(buffer_pool().stats().max_bytes)"
    assert _python(code, TENSORWIRE_BUFFER_POOL_BYTES="0").stdout.strip() == "0"
    assert _python(code, TENSORWIRE_BUFFER_POOL_BYTES="12345").stdout.strip() == "12345"
    for bad in ("lots", "-1"):
        # Receives use the pool: a bad setting must not make them fail.
        done = _python(code, TENSORWIRE_BUFFER_POOL_BYTES=bad)
        assert (done.returncode, done.stdout.strip()) == (0, str(1 << 30))
        assert "TENSORWIRE_BUFFER_POOL_BYTES" in done.stderr and repr(bad) in done.stderr


def test_pooled_arrays_alive_at_exit_end_the_process_cleanly() -> None:
    code = (
        "from tensorwire.transports import buffer_pool\n"
        "kept = [buffer_pool().empty(2 << 20) for _ in range(3)]\n"
        "cycle = [buffer_pool().empty(2 << 20)]\n"
        "cycle.append(cycle)\n"
        "del kept[0]\n"
    )
    done = _python(code)
    assert done.returncode == 0
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr
