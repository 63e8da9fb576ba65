"""A cache of large host receive buffers, reused once their arrays are gone.

A fresh large allocation is new pages from the kernel, and the first write to
each page faults: on the benchmark host, filling a fresh 64 MiB array ran at
about 6 GB/s against 9 GB/s for one already touched, and glibc hands blocks
above 32 MiB back to the kernel on ``free``, so a loop that receives the same
large tensors step after step paid for new pages on every step. Run back to
back with the pool off (``TENSORWIRE_BUFFER_POOL_BYTES=0``) and on,
``bench/rpc.py --quick --rounds 1`` gave 3.84 and 6.17 GB/s for the paired
64 MiB RPC echo over ucx:// (docs/transports.md, "Receive buffers").

How a buffer comes back
    :meth:`BufferPool.empty` returns a NumPy array whose ``base`` is a small
    lease object holding the pooled block. Every view, ``memoryview``,
    ``np.frombuffer`` or ``torch.from_numpy`` of the array keeps the lease
    alive through that chain, so the block returns to the pool only when the
    last object that can reach its memory is gone (the lease's ``__del__``),
    never while someone can still read or write it.

What it keeps
    The receive paths ask it for buffers of ``POOL_MIN_BYTES`` and more
    (smaller ones come from malloc's heap, already touched). Blocks of
    ``HUGE_PAGE_BYTES`` (2 MiB) and more start on a 2 MiB boundary and are
    advised to be backed by transparent huge pages where the kernel offers
    them (``_huge_pages``; ``tensorwire.transports.transparent_huge_pages()``
    says whether it does). Sizes are
    rounded up to one of 8 per power of two (at most 12.5% more), so that
    near sizes share blocks. At most ``max_bytes`` of idle blocks are kept,
    the least recently returned dropped first, and a block idle for
    ``idle_s`` seconds is dropped at the pool's next use. ``max_bytes=0``
    turns the pool off. A reused block holds old data, as ``np.empty`` may:
    receivers overwrite every byte they hand out.

What it cannot see
    Raw addresses (``arr.ctypes.data``, ``tensor.data_ptr()``) hold no
    reference: memory used through one after the array is gone may be
    reused, as freed memory may be without a pool. UCX requests keep their
    buffers referenced until UCX lets go of them (``_ucx_runtime``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import ConfigError
from ._huge_pages import HUGE_PAGE_BYTES, huge_page_empty, transparent_huge_pages

__all__ = ("POOL_MIN_BYTES", "BufferPool", "PoolStats", "buffer_pool")

logger = logging.getLogger(__name__)

#: The receive paths pool buffers of this size and more.
POOL_MIN_BYTES = 1 << 20
#: Blocks are rounded up to one of 2 ** (_CLASS_BITS - 1) sizes per power of two.
_CLASS_BITS = 4
#: Environment variable that sets the process pool's ``max_bytes``.
ENV_MAX_BYTES = "TENSORWIRE_BUFFER_POOL_BYTES"
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_IDLE_S = 30.0


def _block_size(nbytes: int) -> int:
    step = max(4096, 1 << (nbytes.bit_length() - _CLASS_BITS))
    return -(-nbytes // step) * step


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a :class:`BufferPool`.

    Attributes:
        hits: requests served with a cached block.
        misses: requests that allocated a new block.
        cached_bytes / cached_blocks: idle blocks held now.
        max_bytes: the most idle bytes the pool keeps.
    """

    hits: int
    misses: int
    cached_bytes: int
    cached_blocks: int
    max_bytes: int


class _Lease:
    """The ``base`` of a pooled array: gives the block back when collected."""

    __slots__ = ("__array_interface__", "_block", "_pool")

    def __init__(self, pool: BufferPool, block: np.ndarray[Any, Any], nbytes: int, align: int,
                 offset: int):
        self._pool = pool
        self._block = block
        address = block.ctypes.data
        self.__array_interface__ = {
            "data": (address + (offset - address) % align, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        self._pool._give(self._block)


class BufferPool:
    """Large host buffers for received frames, reused when freed.

    Thread-safe: arrays may be dropped in any thread. See the module
    docstring for what is kept and when a block comes back.

    Raises:
        ConfigError: ``max_bytes`` is negative or ``idle_s`` is not positive.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, idle_s: float = DEFAULT_IDLE_S):
        self._lock = threading.RLock()
        #: The thread inside a locked section, so that a block given back
        #: from a ``__del__`` that the collector runs there is deferred
        #: instead of changing the pool under that section.
        self._owner: int | None = None
        self._deferred: list[np.ndarray[Any, Any]] = []
        #: Idle blocks, least recently returned first: id(block) -> (when, block).
        self._idle: OrderedDict[int, tuple[float, np.ndarray[Any, Any]]] = OrderedDict()
        #: Idle blocks by size, most recently returned last.
        self._by_size: dict[int, list[np.ndarray[Any, Any]]] = {}
        self._cached = 0
        self._hits = 0
        self._misses = 0
        self._max_bytes = DEFAULT_MAX_BYTES
        self._idle_s = DEFAULT_IDLE_S
        self.configure(max_bytes=max_bytes, idle_s=idle_s)
        _track_for_fork(self)

    def configure(self, *, max_bytes: int | None = None, idle_s: float | None = None) -> None:
        """Change the limits; blocks over the new ones are dropped now.

        Raises:
            ConfigError: ``max_bytes`` is negative or ``idle_s`` is not positive.
        """
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise ConfigError(f"BufferPool max_bytes must be an int >= 0, got {max_bytes!r}")
        if idle_s is not None and (
            isinstance(idle_s, bool) or not isinstance(idle_s, int | float) or not idle_s > 0
        ):
            raise ConfigError(f"BufferPool idle_s must be a number > 0, got {idle_s!r}")
        with self._section():
            if max_bytes is not None:
                self._max_bytes = max_bytes
            if idle_s is not None:
                self._idle_s = float(idle_s)
            self._trim(time.monotonic())

    def empty(self, nbytes: int, *, align: int = 64,
              offset: int = 0) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A writable uint8 array of ``nbytes`` whose data starts ``offset``
        bytes past an ``align`` boundary.

        Its contents are undefined (old data when the block is reused).

        Raises:
            ValueError: ``nbytes`` is negative, ``align`` is not positive,
                or ``offset`` is not in ``range(align)``.
        """
        if (isinstance(nbytes, bool) or not isinstance(nbytes, int | np.integer) or nbytes < 0
                or isinstance(align, bool) or not isinstance(align, int | np.integer)
                or align < 1 or isinstance(offset, bool)
                or not isinstance(offset, int | np.integer) or not 0 <= offset < align):
            raise ValueError(
                f"cannot allocate {nbytes!r} bytes {offset!r} past a boundary of {align!r}"
            )
        nbytes, align, offset = int(nbytes), int(align), int(offset)
        # The slack for the offset comes on top of the rounded size, so that
        # a power-of-two tensor gets a block of its own size class. (A
        # huge-page block starts on a 2 MiB boundary: its slack is a huge
        # page of address space, of which only a frame asked at an offset
        # touches, and faults in, the first bytes.)
        size = _block_size(nbytes) + align
        huge = size >= HUGE_PAGE_BYTES and transparent_huge_pages() in ("always", "madvise")
        block = None
        with self._section():
            now = time.monotonic()
            self._trim(now)
            blocks = self._by_size.get(size)
            if blocks:
                block = blocks.pop()
                del self._idle[id(block)]
                self._cached -= block.nbytes
                self._hits += 1
            else:
                self._misses += 1
        if block is None:
            block = huge_page_empty(size) if huge else np.empty(size, dtype=np.uint8)
        return np.asarray(_Lease(self, block, nbytes, align, offset))

    def clear(self) -> None:
        """Drop every idle block."""
        with self._section():
            while self._idle:
                self._drop_oldest()

    def stats(self) -> PoolStats:
        """Counts and sizes as they are now."""
        with self._section():
            return PoolStats(self._hits, self._misses, self._cached, len(self._idle),
                             self._max_bytes)

    def _give(self, block: np.ndarray[Any, Any]) -> None:
        if block.nbytes > self._max_bytes:
            return
        if self._owner == threading.get_ident():
            self._deferred.append(block)
            return
        with self._section():
            now = time.monotonic()
            self._trim(now)
            self._keep(block, now)

    def _section(self) -> _Section:
        return _Section(self)

    def _keep(self, block: np.ndarray[Any, Any], now: float) -> None:
        size = block.nbytes
        if size > self._max_bytes:
            return
        while self._cached + size > self._max_bytes:
            self._drop_oldest()
        self._idle[id(block)] = (now, block)
        self._by_size.setdefault(size, []).append(block)
        self._cached += size

    def _trim(self, now: float) -> None:
        deadline = now - self._idle_s
        while self._idle and next(iter(self._idle.values()))[0] <= deadline:
            self._drop_oldest()
        while self._cached > self._max_bytes:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, block) = self._idle.popitem(last=False)
        blocks = self._by_size[block.nbytes]
        for i, other in enumerate(blocks):
            if other is block:
                del blocks[i]
                break
        if not blocks:
            del self._by_size[block.nbytes]
        self._cached -= block.nbytes


class _Section:
    """The pool's lock, with blocks given back meanwhile in this thread kept after."""

    __slots__ = ("_outer", "_pool")

    def __init__(self, pool: BufferPool):
        self._pool = pool
        self._outer = False

    def __enter__(self) -> None:
        pool = self._pool
        pool._lock.acquire()
        self._outer = pool._owner is None
        pool._owner = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        pool = self._pool
        try:
            if self._outer:
                now = time.monotonic()
                while True:
                    while pool._deferred:
                        pool._keep(pool._deferred.pop(), now)
                    pool._owner = None
                    # A collection between the last check and here gave its
                    # block to _deferred; one after goes through the lock
                    # (re-entrant) itself.
                    if not pool._deferred:
                        break
                    pool._owner = threading.get_ident()
        finally:
            pool._lock.release()


#: Every pool, so that a forked child gets working locks: a fork while
#: another thread held one would leave the child's copy held forever (a
#: DataLoader worker forked beside a SyncClient's loop thread, say).
_pools: weakref.WeakSet[BufferPool] = weakref.WeakSet()
_fork_hook_installed = False


def _track_for_fork(pool: BufferPool) -> None:
    global _fork_hook_installed
    _pools.add(pool)
    if not _fork_hook_installed:
        _fork_hook_installed = True
        os.register_at_fork(after_in_child=_after_fork_in_child)


def _after_fork_in_child() -> None:
    # Another thread may have been half-way through a change of the pool's
    # structures: the child starts with an empty pool (the idle blocks are
    # freed; blocks in use come back as usual).
    global _process_pool_lock
    _process_pool_lock = threading.Lock()
    for pool in list(_pools):
        pool._lock = threading.RLock()
        pool._owner = None
        pool._deferred = []
        pool._idle = OrderedDict()
        pool._by_size = {}
        pool._cached = 0


_process_pool: BufferPool | None = None
_process_pool_lock = threading.Lock()


def buffer_pool() -> BufferPool:
    """The process's pool, which the default receive allocator uses.

    Created at first use, with ``max_bytes`` from the environment variable
    ``TENSORWIRE_BUFFER_POOL_BYTES`` if set (``0`` turns it off), else 1 GiB.
    A value that is not a byte count is logged as a warning and the default
    used: this runs inside receives, which must not fail over it.
    """
    global _process_pool
    if _process_pool is None:
        with _process_pool_lock:
            if _process_pool is None:
                _process_pool = BufferPool(max_bytes=_max_bytes_from_environment())
    return _process_pool


def _max_bytes_from_environment() -> int:
    raw = os.environ.get(ENV_MAX_BYTES)
    if raw is None:
        return DEFAULT_MAX_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        logger.warning("%s=%r is not a byte count; the buffer pool keeps up to %d bytes",
                       ENV_MAX_BYTES, raw, DEFAULT_MAX_BYTES)
        return DEFAULT_MAX_BYTES
    return value
