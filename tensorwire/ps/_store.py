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

from ..errors import InvalidArgument
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
    seen: Array  # ssp/async: next clock expected from each worker
    acc: Array | None = None  # sync: sum of the step being collected
    contributors: set[int] = dataclasses.field(default_factory=set)


class ShardStore:
    """Chunks, optimizer state and clocks of one shard of ``job``."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.clocks = Clocks(job.consistency, job.num_workers, job.staleness)
        self.entries: dict[str, _Entry] = {}
        #: Pushes applied (chunk updates counted once per push message).
        self.updates = 0

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
            flat = np.asarray(value).reshape(-1)
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
                value=owned, state=self.job.optimizer.init_state(owned), updates=0,
                seen=np.zeros(self.job.num_workers, np.int64),
            )

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

    def admit(self, worker: int, clock: int, seen: int = 0) -> Decision:
        """See :meth:`Clocks.admit`."""
        step = self.clocks.step
        decision = self.clocks.admit(worker, clock, seen)
        if self.clocks.step != step:
            # Skipped ahead: what was being collected belongs to a step the
            # workers already finished before this shard lost it.
            for entry in self.entries.values():
                entry.acc = None
                entry.contributors.clear()
        return decision

    def push(self, worker: int, clock: int, keys: Sequence[str],
             payloads: Sequence[Payload]) -> bool:
        """Apply an admitted push. Returns True when it changed anything.

        Every payload is decoded before anything changes, so a bad one leaves
        the store as it was.

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
            grads.append(decompress(dict(payload), entry.value.size, entry.value.dtype))
        changed = False
        if self.clocks.mode == "sync":
            for entry, grad in zip(entries, grads, strict=True):
                if worker in entry.contributors:
                    continue
                entry.contributors.add(worker)
                # The first gradient is kept as it arrived (a view of the
                # receive buffer, which nothing writes into); sums are new arrays.
                entry.acc = grad if entry.acc is None else entry.acc + grad
                changed = True
            if self.clocks.record(worker, clock):
                self._apply_step()
        else:
            scale = 1.0 / self.job.num_workers
            for entry, grad in zip(entries, grads, strict=True):
                if clock < entry.seen[worker]:
                    continue
                entry.seen[worker] = clock + 1
                self._update(entry, grad, scale)
                changed = True
            self.clocks.record(worker, clock)
        if changed:
            self.updates += 1
        return changed

    def _apply_step(self) -> None:
        """sync: every worker's push for the step is in; apply the mean (or the sum)."""
        aggregate = not self.job.optimizer.updates_parameters
        scale = 1.0 if aggregate else 1.0 / self.job.num_workers
        for entry in self.entries.values():
            if entry.acc is None:
                continue  # no worker pushed this chunk this step
            self._update(entry, entry.acc, scale)
            entry.acc = None
            entry.contributors.clear()
        self.clocks.advance()

    def _update(self, entry: _Entry, grad: Array, scale: float) -> None:
        entry.updates += 1
        entry.value, entry.state = self.job.optimizer.step(
            entry.value, grad, entry.state, entry.updates, scale=scale
        )

    # -- checkpoints -------------------------------------------------------------

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Array]]:
        """Metadata and arrays of the state a checkpoint keeps.

        The arrays are the store's own (never written into), so writing them
        out from another thread is safe while the store goes on.
        """
        meta: dict[str, Any] = {"job": self.job.to_wire(), "clocks": self.clocks.snapshot(),
                                "updates": self.updates, "chunks": {}}
        arrays: dict[str, Array] = {}
        for index, (key, entry) in enumerate(self.entries.items()):
            meta["chunks"][key] = {"id": index, "updates": entry.updates,
                                   "state": sorted(entry.state)}
            arrays[f"v{index}"] = entry.value
            arrays[f"seen{index}"] = entry.seen.copy()
            for name, array in entry.state.items():
                arrays[f"s{index}.{name}"] = array
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
        try:
            for key, info in dict(meta["chunks"]).items():
                index = int(info["id"])
                store.entries[key] = _Entry(
                    value=np.asarray(arrays[f"v{index}"]),
                    state={name: np.asarray(arrays[f"s{index}.{name}"]) for name in info["state"]},
                    updates=int(info["updates"]),
                    seen=np.asarray(arrays[f"seen{index}"], np.int64),
                )
        except KeyError as exc:
            raise InvalidArgument(f"checkpoint lacks {exc}") from None
        return store
