"""What one shard holds, and how a push changes it. Pure: no I/O, no asyncio.

Pushes are idempotent, keyed by (worker, clock, chunk): in sync mode each
chunk remembers which workers added to the step being collected, otherwise
each chunk remembers, per worker, the next clock it expects. A retried push
finds its key taken and changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import FailedPrecondition, InvalidArgument
from ._arrays import array_module, like, to_host
from ._compress import Payload, decompress
from ._consistency import Clocks, Decision
from ._optim import State
from .config import Job

__all__ = ("ShardStore",)

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]


@dataclasses.dataclass(slots=True)
class _Entry:
    value: Array  # flat; replaced, never written into
    state: State
    updates: int  # optimizer steps taken (Adam's bias correction)
    acc: Array | None = None  # sync: sum of the step being collected
    acc_owned: bool = False  # acc is the store's own array (a sum), safe to add into


class ShardStore:
    """Chunks, optimizer state and clocks of one shard of ``job``."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.clocks = Clocks(job.consistency, job.num_workers, job.staleness)
        self.entries: dict[str, _Entry] = {}
        #: Pushes applied (chunk updates counted once per push message).
        self.updates = 0
        #: The placement version this shard serves (0: the computed placement
        #: of ``init``); workers that call with another get redirected.
        self.version = 0
        #: The placement of ``version`` once it was changed: ``{"version",
        #: "addresses", "shard_of", "step"}`` (None for version 0).
        self.layout: dict[str, Any] | None = None
        #: This shard's index in ``layout`` (-1: not part of it).
        self.index = -1
        #: Chunks this shard owns in ``version`` but has not received yet.
        self.incoming: set[str] = set()

    # -- parameters ------------------------------------------------------------

    def init(self, keys: Sequence[str], values: Sequence[Array]) -> None:
        """Set chunks that have no value yet; existing ones keep theirs (first wins).

        Raises:
            InvalidArgument: lengths differ, or a chunk exists with another
                size or dtype (the workers disagree on the model or chunking).
        """
        if len(keys) != len(values):
            raise InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values, strict=True):
            flat = array_module(value).asarray(value).reshape(-1)  # stays on its device
            entry = self.entries.get(key)
            if entry is not None:
                if entry.value.size != flat.size or entry.value.dtype != flat.dtype:
                    raise InvalidArgument(
                        f"chunk {key!r} holds {entry.value.size} x {entry.value.dtype}, "
                        f"init sent {flat.size} x {flat.dtype}"
                    )
                continue
            if flat.dtype.kind != "f":
                raise InvalidArgument(f"chunk {key!r}: parameters must be floating point, "
                                      f"got {flat.dtype}")
            owned = flat.copy()  # the receive buffer is not ours to keep
            self.entries[key] = _Entry(
                value=owned, state=self.job.optimizer.init_state(owned), updates=0)
            self.clocks.add(key)

    def values(self, keys: Sequence[str]) -> list[Array]:
        """The current value of each chunk (arrays the store will not change).

        Raises:
            InvalidArgument: a chunk that was never initialized.
        """
        return [self._entry(key).value for key in keys]

    def _entry(self, key: str) -> _Entry:
        entry = self.entries.get(key)
        if entry is None:
            raise InvalidArgument(f"chunk {key!r} is not initialized on this shard")
        return entry

    # -- pushes ----------------------------------------------------------------

    def decide(self, worker: int, clock: int, keys: Sequence[str], seen: int = 0) -> Decision:
        """See :meth:`Clocks.decide`: pure, changes nothing.

        Raises:
            InvalidArgument: unknown worker or chunk, negative clock.
        """
        return self.clocks.decide(worker, clock, keys, seen)

    def admit(self, worker: int, clock: int, keys: Sequence[str], seen: int = 0) -> Decision:
        """See :meth:`Clocks.admit`.

        Raises:
            InvalidArgument: unknown worker or chunk, negative clock.
        """
        decision, dropped = self.clocks.admit(worker, clock, keys, seen)
        for key in dropped:
            # What was collected belongs to a step the workers finished
            # before this shard lost it.
            self.entries[key].acc, self.entries[key].acc_owned = None, False
        return decision

    def push(self, worker: int, clock: int, keys: Sequence[str],
             payloads: Sequence[Payload]) -> bool:
        """Apply an admitted push. Returns True when it changed anything.

        Every payload is decoded before anything changes, so a bad one leaves
        the store as it was. In sync mode a chunk is updated as soon as its
        last worker's gradient arrives, with the mean of the step's gradients
        (the sum for :class:`Aggregate`); otherwise each push updates the
        chunk at once with the gradient over ``num_workers``, so a round of
        pushes moves SGD as far as one synchronous step.

        Raises:
            InvalidArgument: unknown chunk, bad payload, lengths differ.
        """
        if len(keys) != len(payloads):
            raise InvalidArgument(f"{len(keys)} keys but {len(payloads)} payloads")
        entries = [self._entry(key) for key in keys]
        grads = []
        for key, entry, payload in zip(keys, entries, payloads, strict=True):
            if not isinstance(payload, Mapping):
                raise InvalidArgument(f"chunk {key!r}: payload must be a dict")
            grad = decompress(dict(payload), entry.value.size, entry.value.dtype)
            grads.append(like(grad, entry.value))  # to the chunk's side
        clocks = self.clocks
        sync = clocks.mode == "sync"
        aggregate = not self.job.optimizer.updates_parameters
        scale = 1.0 if aggregate else 1.0 / self.job.num_workers
        changed = False
        for key, entry, grad in zip(keys, entries, grads, strict=True):
            if not clocks.accepts(worker, clock, key):
                continue
            changed = True
            if not sync:
                clocks.record(worker, clock, key)
                self._update(entry, grad, scale)
                continue
            # The first gradient is kept as it arrived (a view of the receive
            # buffer, never written into); the first sum is a new array,
            # which the next gradients are added into.
            if entry.acc is None:
                entry.acc, entry.acc_owned = grad, False
            elif entry.acc_owned:
                array_module(entry.acc).add(entry.acc, grad, out=entry.acc)
            else:
                entry.acc, entry.acc_owned = entry.acc + grad, True
            if clocks.record(worker, clock, key):
                self._update(entry, entry.acc, scale)
                entry.acc, entry.acc_owned = None, False
                clocks.advance(key)
        if changed:
            self.updates += 1
        return changed

    def _update(self, entry: _Entry, grad: Array, scale: float) -> None:
        entry.updates += 1
        entry.value, entry.state = self.job.optimizer.step(
            entry.value, grad, entry.state, entry.updates, scale=scale
        )

    # -- placement changes ------------------------------------------------------

    def begin(self, layout: Mapping[str, Any], index: int) -> None:
        """Serve placement ``layout`` (a later version) as its shard ``index``
        (-1: a shard the placement no longer uses).

        Chunks it owns there but lacks become ``incoming``; chunks it holds
        but no longer owns stay until :meth:`release`, unchanged, because
        every call of the old version is redirected from now on.

        Raises:
            InvalidArgument: an older version than the one served.
            FailedPrecondition: another placement under the same version.
        """
        version = int(layout["version"])
        if version < self.version:
            raise InvalidArgument(f"placement version {version} is older than this "
                                  f"shard's {self.version}")
        if version == self.version:
            if self.layout is not None and (
                    list(layout["addresses"]) != self.layout["addresses"]
                    or dict(layout["shard_of"]) != self.layout["shard_of"]):
                raise FailedPrecondition(
                    f"placement version {version} is already another placement: two "
                    "workers changed the placement at the same time")
            return  # a retried begin
        self.version, self.index = version, index
        self.layout = {"version": version, "addresses": list(layout["addresses"]),
                       "shard_of": dict(layout["shard_of"]), "step": int(layout["step"])}
        self._expect()

    def _expect(self) -> None:
        assert self.layout is not None
        owned = {key for key, shard in self.layout["shard_of"].items() if shard == self.index}
        self.incoming = owned - set(self.entries)

    def export(self, keys: Sequence[str]) -> list[dict[str, Any]]:
        """Each chunk's whole state, for another shard's :meth:`adopt`: value,
        optimizer state and update count, clocks (the idempotence keys), and
        the partly collected sum of a sync step. Changes nothing.

        Raises:
            InvalidArgument: a chunk this shard does not hold.
        """
        out = []
        for key in keys:
            entry = self._entry(key)
            out.append({"key": key, "value": entry.value, "state": dict(entry.state),
                        "updates": entry.updates, "clock": self.clocks.export(key),
                        "acc": entry.acc})
        return out

    def adopt(self, records: Sequence[Mapping[str, Any]]) -> int:
        """Take chunks :meth:`export` gave; a chunk held already is kept (a
        retried transfer must not undo pushes since). Returns how many were new.

        Raises:
            InvalidArgument: a malformed record.
        """
        taken = 0
        for record in records:
            try:
                key = str(record["key"])
                if key in self.entries:
                    continue
                value = _copy(record["value"]).reshape(-1)  # ours to keep
                acc = record["acc"]
                self.clocks.adopt(key, record["clock"])
                self.entries[key] = _Entry(
                    value=value,
                    state={str(k): _copy(v) for k, v in dict(record["state"]).items()},
                    updates=int(record["updates"]),
                    acc=None if acc is None else _copy(acc).reshape(-1),
                    acc_owned=acc is not None)
            except (KeyError, TypeError, ValueError) as exc:
                raise InvalidArgument(f"bad chunk record: {exc!r}") from None
            self.incoming.discard(key)
            taken += 1
        return taken

    def release(self, keys: Sequence[str]) -> None:
        """Drop chunks that now live on another shard."""
        for key in keys:
            self.entries.pop(key, None)
            self.clocks.remove(key)

    # -- checkpoints -------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Array]]:
        """Metadata and arrays of the state a checkpoint keeps.

        The arrays are the store's own (never written into), so writing them
        out from another thread is safe while the store goes on; chunks on
        the GPU are copied to host memory (a restored shard holds them there).
        """
        meta: dict[str, Any] = {"job": self.job.to_wire(), "clocks": self.clocks.snapshot(),
                                "step": self.clocks.step, "updates": self.updates,
                                "version": self.version, "layout": self.layout,
                                "index": self.index,
                                "chunks": {}}
        arrays: dict[str, Array] = {}
        for index, (key, entry) in enumerate(self.entries.items()):
            meta["chunks"][key] = {"id": index, "updates": entry.updates,
                                   "state": sorted(entry.state)}
            arrays[f"v{index}"] = to_host(entry.value)
            for name, array in entry.state.items():
                arrays[f"s{index}.{name}"] = to_host(array)
        return meta, arrays

    @classmethod
    def restore(cls, meta: Mapping[str, Any], arrays: Mapping[str, Array]) -> ShardStore:
        """A store from :meth:`snapshot`'s output.

        Raises:
            InvalidArgument: the snapshot is inconsistent.
        """
        store = cls(Job.from_wire(dict(meta["job"])))
        store.clocks.restore(dict(meta["clocks"]))
        store.updates = int(meta["updates"])
        store.version = int(meta.get("version", 0))
        layout = meta.get("layout")
        store.layout = None if layout is None else dict(layout)
        store.index = int(meta.get("index", -1))
        try:
            for key, info in dict(meta["chunks"]).items():
                index = int(info["id"])
                store.entries[key] = _Entry(
                    value=np.asarray(arrays[f"v{index}"]),
                    state={name: np.asarray(arrays[f"s{index}.{name}"]) for name in info["state"]},
                    updates=int(info["updates"]),
                )
        except KeyError as exc:
            raise InvalidArgument(f"checkpoint lacks {exc}") from None
        if store.layout is not None:
            store._expect()
        return store


def _copy(x: Any) -> Array:
    """A copy of a received array, on the side it arrived on."""
    copied: Array = array_module(x).array(x)
    return copied
