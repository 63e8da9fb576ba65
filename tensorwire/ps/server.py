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
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .. import rpc
from ..errors import (
    ConfigError,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PlacementMoved,
)
from . import _checkpoint
from ._arrays import array_module
from ._compress import Payload
from ._consistency import Decision
from ._store import ShardStore
from .config import Job, ShardConfig

__all__ = ("Shard", "ShardServer", "serve")

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
T = TypeVar("T")

def _moved(version: int, used: int) -> PlacementMoved:
    """The error for a call made with placement ``used`` to a shard that
    serves ``version``: the worker fetches that placement (:meth:`Shard.layout`)
    and calls again."""
    return PlacementMoved(f"this shard serves placement version {version}, the call used "
                          f"{used}", version=version)


class Shard(rpc.Service):
    """One shard of a parameter server (remote name ``tensorwire.ps.Shard``).

    Workers call it through :func:`tensorwire.ps.connect`; the methods are
    the wire protocol between the two. Every method is idempotent: a retry
    after a reconnect is safe. A method whose wait for other workers runs
    out raises ``DeadlineExceeded`` naming the workers behind; a call made
    with another placement version than the shard serves raises
    ``PlacementMoved`` with the version it serves.
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
        self._traffic = _Traffic()

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

    async def _wait_until(self, ready: Callable[[], bool], timeout: float,
                          describe: Callable[[], str], worker: int | None = None) -> None:
        changed = self._condition()
        if worker is not None:
            self._traffic.wait_begins(worker)
        try:
            async with asyncio.timeout(timeout), changed:
                await changed.wait_for(ready)
        except TimeoutError:
            raise DeadlineExceeded(describe()) from None
        finally:
            if worker is not None:
                self._traffic.wait_ends(worker)

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    async def _enter(self, worker: int, version: int, keys: list[str],
                     wait: float) -> ShardStore:
        """The store, once this shard serves placement ``version`` and holds ``keys``.

        A caller behind the shard's version is redirected (``PlacementMoved``);
        one ahead of it (the new placement has not reached this shard yet)
        waits for it, as it waits for chunks still on their way here.
        """
        if version > 0 and (self.store is None or self.store.version < version):
            await self._wait_until(
                lambda: self.store is not None and self.store.version >= version, wait,
                lambda: f"worker {worker} waited {wait:g} s for placement version {version}")
        store = self._store()
        if version < store.version:
            raise _moved(store.version, version)
        if store.incoming.intersection(keys):
            await self._wait_until(
                lambda: store.version != version or not store.incoming.intersection(keys),
                wait, lambda: (f"worker {worker} waited {wait:g} s for chunks moving to this "
                               f"shard: {sorted(store.incoming.intersection(keys))[:5]}"))
            if store.version != version:
                raise _moved(store.version, version)
        return store

    # -- remote methods -----------------------------------------------------------

    @rpc.method(idempotent=True)
    async def hello(self) -> dict[str, Any]:
        """Who this shard is: its host name (workers on the same host treat
        the link as local) and the placement version it serves."""
        store = self.store
        return {"host": socket.gethostname(), "version": 0 if store is None else store.version,
                "incoming": 0 if store is None else len(store.incoming)}

    @rpc.method(idempotent=True)
    async def init(self, job: dict[str, Any], worker: int, keys: list[str],
                   values: list[Array], sizes: list[int], wait: float,
                   version: int = 0) -> list[Array]:
        """Set up the job (the first worker to arrive sets it) and the chunks.

        Worker 0 sends ``values``, taken by chunks that have none yet; other
        workers send none and wait up to ``wait`` seconds for worker 0.
        Returns the chunks' values.
        """
        if version == 0:
            self._job(job, worker)
        store = await self._enter(worker, version, keys, wait)
        self._job(job, worker)
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

    def _job(self, job: dict[str, Any], worker: int) -> ShardStore:
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
        return self.store

    @rpc.method(idempotent=True)
    async def push(self, worker: int, clock: int, keys: list[str], payloads: list[Payload],
                   seen: int, wait: float, version: int = 0) -> None:
        """Take ``worker``'s gradients for step ``clock`` (a retry is ignored).

        ``seen`` is the clock of the worker's latest read from this shard. In
        sync mode a push for a step beyond the one being collected waits up
        to ``wait`` seconds for that step to complete. ``version`` is the
        placement the worker uses: another one raises ``PlacementMoved``.
        """
        self._traffic.received(worker, payloads)
        await self._push(worker, clock, keys, payloads, seen, wait, version)

    async def _push(self, worker: int, clock: int, keys: list[str], payloads: list[Payload],
                    seen: int, wait: float, version: int) -> None:
        store = await self._enter(worker, version, keys, wait)
        # A pure check while waiting: admit() may change the chunks' clocks.
        if store.decide(worker, clock, keys, seen) is Decision.WAIT:
            await self._wait_until(
                lambda: (store.version != version
                         or store.decide(worker, clock, keys, seen) is not Decision.WAIT),
                wait,
                lambda: (f"push of worker {worker} for step {clock} waited {wait:g} s: an "
                         f"earlier step still waits for workers "
                         f"{store.clocks.waiting_for(keys)}"),
                worker,
            )
            if store.version != version:
                raise _moved(store.version, version)
        decision = store.admit(worker, clock, keys, seen)
        if decision is Decision.DUPLICATE:
            logger.debug("duplicate push of worker %d for step %d ignored", worker, clock)
            return
        if store.push(worker, clock, keys, payloads):
            self._after_update()
        await self._notify()

    @rpc.method(idempotent=True)
    async def pull(self, worker: int, clock: int, keys: list[str],
                   wait: float, version: int = 0) -> list[Array]:
        """The chunks' values once ``worker`` at ``clock`` may read them.

        Waits up to ``wait`` seconds; the answer then names the workers that
        are behind.
        """
        return self._traffic.sent(worker, await self._pull(worker, clock, keys, wait, version))

    async def _pull(self, worker: int, clock: int, keys: list[str], wait: float,
                    version: int) -> list[Array]:
        store = await self._enter(worker, version, keys, wait)
        if not store.clocks.ready(worker, clock, keys):
            await self._wait_until(
                lambda: store.version != version or store.clocks.ready(worker, clock, keys),
                wait,
                lambda: (f"worker {worker} at clock {clock} waited {wait:g} s for workers "
                         f"{store.clocks.behind(clock, keys)} (behind; shard clocks "
                         f"{store.clocks.clocks})"),
                worker,
            )
            if store.version != version:
                raise _moved(store.version, version)
        return store.values(keys)

    @rpc.method(idempotent=True)
    async def push_pull(self, worker: int, clock: int, keys: list[str],
                        payloads: list[Payload], seen: int,
                        wait: float, version: int = 0) -> list[Array]:
        """``push`` then ``pull`` at ``clock + 1``, in one round trip."""
        self._traffic.received(worker, payloads)
        started = time.monotonic()
        await self._push(worker, clock, keys, payloads, seen, wait, version)
        remaining = max(wait - (time.monotonic() - started), 1e-3)
        return self._traffic.sent(
            worker, await self._pull(worker, clock + 1, keys, remaining, version))

    @rpc.method(idempotent=True)
    async def checkpoint(self) -> str:
        """Write a checkpoint now and return its path."""
        return await self.save()

    @rpc.method(idempotent=True)
    async def status(self) -> dict[str, Any]:
        """Clocks, chunk count, bytes held, updates, checkpoint facts,
        placement version."""
        store = self.store
        if store is None:
            return {"job": None, "host": socket.gethostname()}
        return {
            "job": store.job.to_wire(),
            "step": store.clocks.step,
            "clocks": list(store.clocks.clocks),
            "lost_steps": store.clocks.lost_steps,
            "chunks": len(store.entries),
            "bytes": sum(e.value.nbytes for e in store.entries.values()),
            "updates": store.updates,
            "restored_from": None if self.restored_from is None else str(self.restored_from),
            "version": store.version,
            "host": socket.gethostname(),
        }

    @rpc.method(idempotent=True)
    async def traffic(self) -> dict[str, list[float]]:
        """Per worker, since the shard started: array bytes received and sent
        by push, pull and push_pull, and the seconds its calls spent waiting
        for other workers (time a worker can subtract from its calls' to
        learn this shard's effective bandwidth)."""
        return self._traffic.report()

    # -- placement changes (driven by one worker, see PSClient.reshard) ------------

    @rpc.method(idempotent=True)
    async def layout(self) -> dict[str, Any] | None:
        """The placement this shard serves (None: version 0, computed by
        every worker from the tensors)."""
        return None if self.store is None else self.store.layout

    @rpc.method(idempotent=True)
    async def begin(self, job: dict[str, Any], layout: dict[str, Any], index: int) -> int:
        """Serve placement ``layout`` as its shard ``index`` (-1: none).

        From now on a call of an older version raises ``PlacementMoved``,
        calls waiting here are woken to raise it, and chunks this
        shard should own are waited for until :meth:`adopt` brings them.
        Returns the version served.
        """
        store = self.store or self._job(job, -1)
        if store.job != Job.from_wire(job):
            self._job(job, -1)  # raises: another job
        store.begin(layout, index)
        logger.info("placement version %d: shard %d, %d chunks to receive", store.version,
                    index, len(store.incoming))
        await self._notify()
        return store.version

    def _at(self, version: int) -> ShardStore:
        store = self._store()
        if store.version != version:
            raise FailedPrecondition(f"this shard serves placement version {store.version}, "
                                     f"not {version}")
        return store

    @rpc.method(idempotent=True)
    async def export(self, version: int, keys: list[str]) -> list[dict[str, Any]]:
        """The whole state of chunks that leave this shard in ``version``
        (kept until :meth:`release`)."""
        return self._at(version).export(keys)

    @rpc.method(idempotent=True)
    async def adopt(self, version: int, records: list[dict[str, Any]]) -> int:
        """Take chunks moving here in ``version``; returns how many were new."""
        taken = self._at(version).adopt(records)
        await self._notify()
        return taken

    @rpc.method(idempotent=True)
    async def incoming(self, version: int) -> list[str]:
        """Chunks this shard owns in placement ``version`` but does not hold yet."""
        return sorted(self._at(version).incoming)

    @rpc.method(idempotent=True)
    async def holding(self, keys: list[str]) -> list[str]:
        """Which of ``keys`` this shard holds, whatever placement it serves."""
        store = self.store
        return [] if store is None else [key for key in keys if key in store.entries]

    @rpc.method(idempotent=True)
    async def release(self, version: int, keys: list[str]) -> None:
        """Drop chunks that now live elsewhere (after their :meth:`adopt`)."""
        store = self._at(version)
        owned = store.layout["shard_of"] if store.layout is not None else {}
        mine = [key for key in keys if owned.get(key) != store.index]
        store.release(mine)


class _Traffic:
    """Per worker: array bytes in and out, and the wall time during which at
    least one of its calls waited for other workers."""

    def __init__(self) -> None:
        self.bytes_in: dict[int, int] = {}
        self.bytes_out: dict[int, int] = {}
        self.waited: dict[int, float] = {}
        self._waiting: dict[int, int] = {}
        self._since: dict[int, float] = {}

    def received(self, worker: int, payloads: Any) -> None:
        self.bytes_in[worker] = self.bytes_in.get(worker, 0) + nbytes(payloads)

    def sent(self, worker: int, result: T) -> T:
        if isinstance(result, list):
            self.bytes_out[worker] = self.bytes_out.get(worker, 0) + nbytes(result)
        return result

    def wait_begins(self, worker: int) -> None:
        count = self._waiting.get(worker, 0)
        if count == 0:
            self._since[worker] = time.monotonic()
        self._waiting[worker] = count + 1

    def wait_ends(self, worker: int) -> None:
        count = self._waiting[worker] - 1
        self._waiting[worker] = count
        if count == 0:
            self.waited[worker] = (self.waited.get(worker, 0.0)
                                   + time.monotonic() - self._since.pop(worker))

    def report(self) -> dict[str, list[float]]:
        workers = sorted(set(self.bytes_in) | set(self.bytes_out) | set(self.waited)
                         | set(self._waiting))
        now = time.monotonic()
        waited = [self.waited.get(w, 0.0)
                  + (now - self._since[w] if self._waiting.get(w) else 0.0) for w in workers]
        return {"workers": [float(w) for w in workers],
                "bytes_in": [float(self.bytes_in.get(w, 0)) for w in workers],
                "bytes_out": [float(self.bytes_out.get(w, 0)) for w in workers],
                "waited": waited}


def nbytes(value: Any) -> int:
    """The array bytes in a value (arrays inside dicts and lists)."""
    if isinstance(value, np.ndarray) or array_module(value) is not np:
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(nbytes(v) for v in value)
    return 0


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

