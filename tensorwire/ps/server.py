"""A parameter-server shard: an RPC service over a :class:`ShardStore`.

Run one per process (``tensorwire ps serve --listen tcp://0.0.0.0:7000``)
or from Python with :func:`serve`. The service is a thin async layer: the
store decides, the service waits (with the call's deadline) when the
consistency mode says "not yet", and writes checkpoints in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .. import rpc
from ..errors import ConfigError, FailedPrecondition, InvalidArgument
from . import _checkpoint
from ._compress import Payload
from ._consistency import Decision
from ._store import ShardStore
from .config import Job, ShardConfig

__all__ = ("LATE", "Shard", "ShardServer", "serve")

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
T = TypeVar("T")

#: The key of the result a shard returns when a wait for other workers ran
#: out: ``{LATE: "message naming the workers behind"}``. A result, not a
#: raised DeadlineExceeded, because the RPC client replaces the message of a
#: remote DeadlineExceeded with its own; the worker raises DeadlineExceeded.
LATE = "deadline_exceeded"


Late = dict[str, str]


class _Late(Exception):
    """A wait for other workers ran out (see :data:`LATE`)."""


async def _answer(work: Awaitable[T]) -> T | Late:
    try:
        return await work
    except _Late as late:
        return {LATE: str(late)}


class Shard(rpc.Service):
    """One shard of a parameter server (remote name ``tensorwire.ps.Shard``).

    Workers call it through :func:`tensorwire.ps.connect`; the methods are
    the wire protocol between the two. Every method is idempotent: a retry
    after a reconnect is safe. A method whose wait for other workers runs
    out returns ``{LATE: message}`` instead of its result.
    """

    service_name = "tensorwire.ps.Shard"

    def __init__(self, config: ShardConfig | None = None) -> None:
        self.config = config or ShardConfig()
        self.store: ShardStore | None = None
        self._changed: asyncio.Condition | None = None
        self._checkpointing: asyncio.Lock | None = None
        self._since_checkpoint = 0
        self._periodic: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.restored_from: Path | None = None

    # -- lifetime -----------------------------------------------------------------

    def restore(self) -> Path | None:
        """Load the newest checkpoint of ``config.checkpoint_dir``, if any.

        Unreadable files are skipped (with a warning) for older ones.
        """
        directory = self.config.checkpoint_dir
        if directory is None:
            return None
        found = _checkpoint.latest(directory)
        if found is None:
            return None
        path, meta, arrays = found
        self.store = ShardStore.restore(meta, arrays)
        self.restored_from = path
        logger.info("restored %d chunks at step %d from %s", len(self.store.entries),
                    self.store.clocks.step, path)
        return path

    def start(self) -> None:
        """Start the periodic checkpoint task (call on the serving loop)."""
        self._condition()
        interval = self.config.checkpoint_interval
        if interval is not None and self._periodic is None:
            self._periodic = asyncio.get_running_loop().create_task(self._every(interval))

    async def stop(self) -> None:
        """Stop the periodic task and let a checkpoint being written finish."""
        periodic, self._periodic = self._periodic, None
        if periodic is not None:
            periodic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await periodic
        if self._background:
            await asyncio.wait(list(self._background))

    async def _every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.store is not None and self._since_checkpoint:
                try:
                    await self.save()
                except Exception:
                    # Whatever went wrong, the next period tries again.
                    logger.exception("periodic checkpoint failed")

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._checkpointing = asyncio.Lock()
        return self._changed

    def _store(self) -> ShardStore:
        if self.store is None:
            raise FailedPrecondition("this shard has no job yet: a worker must init() first")
        return self.store

    async def save(self) -> str:
        """Write a checkpoint now; returns its path.

        Raises:
            FailedPrecondition: no checkpoint directory, or nothing to save yet.
            OSError: the file could not be written.
        """
        directory = self.config.checkpoint_dir
        if directory is None:
            raise FailedPrecondition("this shard has no checkpoint directory")
        store = self._store()
        self._condition()
        assert self._checkpointing is not None
        async with self._checkpointing:
            # The snapshot shares the store's arrays, which updates replace
            # rather than change, so the thread writes a consistent state.
            meta, arrays = store.snapshot()
            self._since_checkpoint = 0
            path = await asyncio.to_thread(_checkpoint.save, directory, meta, arrays,
                                           keep=self.config.keep_checkpoints)
        logger.info("checkpoint %s (step %s, %d updates)", path, meta["step"],
                    meta["updates"])
        return str(path)

    def _after_update(self) -> None:
        every = self.config.checkpoint_every
        self._since_checkpoint += 1
        if every is not None and self._since_checkpoint >= every:
            self._since_checkpoint = 0
            task = asyncio.get_running_loop().create_task(self._save_quietly())
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _save_quietly(self) -> None:
        try:
            await self.save()
        except Exception:
            logger.exception("checkpoint failed")

    # -- waiting ------------------------------------------------------------------

    async def _wait_until(self, ready: Any, timeout: float, describe: Any) -> None:
        changed = self._condition()
        try:
            async with asyncio.timeout(timeout), changed:
                await changed.wait_for(ready)
        except TimeoutError:
            raise _Late(describe()) from None

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    # -- remote methods -----------------------------------------------------------

    @rpc.method(idempotent=True)
    async def init(self, job: dict[str, Any], worker: int, keys: list[str],
                   values: list[Array], sizes: list[int], wait: float) -> list[Array] | Late:
        """Set up the job (the first worker to arrive sets it) and the chunks.

        Worker 0 sends ``values``, taken by chunks that have none yet; other
        workers send none and wait up to ``wait`` seconds for worker 0.
        Returns the chunks' values.
        """
        return await _answer(self._init(job, worker, keys, values, sizes, wait))

    async def _init(self, job: dict[str, Any], worker: int, keys: list[str],
                    values: list[Array], sizes: list[int], wait: float) -> list[Array]:
        try:
            wanted = Job.from_wire(job)
        except ConfigError as exc:
            raise InvalidArgument(str(exc)) from None
        if self.store is None:
            self.store = ShardStore(wanted)
            logger.info("job: %d workers, %s, %s", wanted.num_workers, wanted.consistency,
                        wanted.optimizer)
        elif self.store.job != wanted:
            raise FailedPrecondition(
                f"this shard serves another job: {self.store.job.to_wire()}, "
                f"worker {worker} asked for {wanted.to_wire()}"
            )
        store = self.store
        store.clocks.check_worker(worker)
        if len(sizes) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes)} sizes")
        if values:
            store.init(keys, values)
            await self._notify()
        elif not all(key in store.entries for key in keys):
            await self._wait_until(
                lambda: all(key in store.entries for key in keys), wait,
                lambda: f"worker {worker} waited {wait:g} s for worker 0 to init() the chunks")
        current = store.values(keys)
        for key, size, value in zip(keys, sizes, current, strict=True):
            if value.size != size:
                raise InvalidArgument(f"chunk {key!r} holds {value.size} elements, worker "
                                      f"{worker} expects {size}: the workers disagree on the "
                                      "model or the chunk size")
        return current

    @rpc.method(idempotent=True)
    async def push(self, worker: int, clock: int, keys: list[str], payloads: list[Payload],
                   seen: int, wait: float) -> Late | None:
        """Take ``worker``'s gradients for step ``clock`` (a retry is ignored).

        ``seen`` is the clock of the worker's latest read from this shard. In
        sync mode a push for a step beyond the one being collected waits up
        to ``wait`` seconds for that step to complete.
        """
        return await _answer(self._push(worker, clock, keys, payloads, seen, wait))

    async def _push(self, worker: int, clock: int, keys: list[str], payloads: list[Payload],
                    seen: int, wait: float) -> None:
        store = self._store()
        decision = store.admit(worker, clock, keys, seen)
        if decision is Decision.WAIT:
            await self._wait_until(
                lambda: store.admit(worker, clock, keys, seen) is not Decision.WAIT, wait,
                lambda: (f"push of worker {worker} for step {clock} waited {wait:g} s: an "
                         f"earlier step still waits for workers "
                         f"{store.clocks.waiting_for(keys)}"),
            )
            decision = store.admit(worker, clock, keys, seen)
        if decision is Decision.DUPLICATE:
            logger.debug("duplicate push of worker %d for step %d ignored", worker, clock)
            return
        if store.push(worker, clock, keys, payloads):
            self._after_update()
        await self._notify()

    @rpc.method(idempotent=True)
    async def pull(self, worker: int, clock: int, keys: list[str],
                   wait: float) -> list[Array] | Late:
        """The chunks' values once ``worker`` at ``clock`` may read them.

        Waits up to ``wait`` seconds; the answer then names the workers that
        are behind.
        """
        return await _answer(self._pull(worker, clock, keys, wait))

    async def _pull(self, worker: int, clock: int, keys: list[str], wait: float) -> list[Array]:
        store = self._store()
        if not store.clocks.ready(worker, clock, keys):
            await self._wait_until(
                lambda: store.clocks.ready(worker, clock, keys), wait,
                lambda: (f"worker {worker} at clock {clock} waited {wait:g} s for workers "
                         f"{store.clocks.behind(clock, keys)} (behind; shard clocks "
                         f"{store.clocks.clocks})"),
            )
        return store.values(keys)

    @rpc.method(idempotent=True)
    async def push_pull(self, worker: int, clock: int, keys: list[str],
                        payloads: list[Payload], seen: int,
                        wait: float) -> list[Array] | Late:
        """``push`` then ``pull`` at ``clock + 1``, in one round trip."""
        return await _answer(self._push_pull(worker, clock, keys, payloads, seen, wait))

    async def _push_pull(self, worker: int, clock: int, keys: list[str],
                         payloads: list[Payload], seen: int, wait: float) -> list[Array]:
        started = time.monotonic()
        await self._push(worker, clock, keys, payloads, seen, wait)
        remaining = max(wait - (time.monotonic() - started), 1e-3)
        return await self._pull(worker, clock + 1, keys, remaining)

    @rpc.method(idempotent=True)
    async def checkpoint(self) -> str:
        """Write a checkpoint now and return its path."""
        return await self.save()

    @rpc.method(idempotent=True)
    async def status(self) -> dict[str, Any]:
        """Clocks, chunk count, bytes held, updates, checkpoint facts."""
        store = self.store
        if store is None:
            return {"job": None}
        return {
            "job": store.job.to_wire(),
            "step": store.clocks.step,
            "clocks": list(store.clocks.clocks),
            "lost_steps": store.clocks.lost_steps,
            "chunks": len(store.entries),
            "bytes": sum(e.value.nbytes for e in store.entries.values()),
            "updates": store.updates,
            "restored_from": None if self.restored_from is None else str(self.restored_from),
        }


class ShardServer:
    """A running shard: its RPC server, addresses and service."""

    def __init__(self, server: rpc.Server, shard: Shard) -> None:
        self.server = server
        self.shard = shard

    @property
    def addresses(self) -> list[str]:
        """Where the shard listens."""
        return self.server.addresses

    async def serve_forever(self) -> None:
        """Wait until :meth:`close`."""
        await self.server.serve_forever()

    async def close(self, *, checkpoint: bool = True) -> None:
        """Stop serving; write a last checkpoint when there is a directory."""
        await self.server.close(grace=0)
        await self.shard.stop()
        if checkpoint and self.shard.config.checkpoint_dir is not None \
                and self.shard.store is not None:
            await self.shard.save()

    async def __aenter__(self) -> ShardServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def serve(*urls: str, config: ShardConfig | None = None,
                checkpoint_dir: str | Path | None = None) -> ShardServer:
    """Start a shard on ``urls`` (e.g. ``tcp://0.0.0.0:7000``), restoring its
    newest checkpoint first when ``checkpoint_dir`` holds one.

    ``checkpoint_dir`` is a shortcut for ``ShardConfig(checkpoint_dir=...)``.

    Raises:
        ConfigError: both ``config`` and ``checkpoint_dir`` given, or no URL.
        TransportError: an address cannot be bound.
    """
    if not urls:
        raise ConfigError("serve() needs at least one address")
    if checkpoint_dir is not None:
        if config is not None:
            raise ConfigError("pass checkpoint_dir inside config, not both")
        config = ShardConfig(checkpoint_dir=Path(checkpoint_dir))
    shard = Shard(config)
    shard.restore()
    server = rpc.Server([shard], config=shard.config.rpc)
    await server.start(*urls)
    shard.start()
    return ShardServer(server, shard)

