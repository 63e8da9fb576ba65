"""Changing the placement while training runs: the worker side of resharding.

One worker moves chunks between shards (:meth:`PSClient.reshard
<tensorwire.ps.PSClient.reshard>`): every shard first switches to the new
placement version, so calls made with the old one are redirected; each
moving chunk travels through the worker with its whole state; then the
shards drop what they gave away. A change that did not finish is finished
by the next one. The other workers adopt the new placement when a shard
redirects them (:func:`refresh`). These functions work on the client's
placement state; the data plane is in :mod:`.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import FailedPrecondition, InvalidArgument, Unavailable
from ._placement import Chunk, Placement, relocate
from .server import Shard, nbytes

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ("finish_change", "move_report", "refresh", "reshard", "transfer")

logger = logging.getLogger(__name__)


async def reshard(client: PSClient, addresses: Sequence[str], *,
                  placement: Placement | None = None) -> dict[str, Any]:
    """Move the parameters to the shards at ``addresses``: what
    :meth:`PSClient.reshard <tensorwire.ps.PSClient.reshard>` does."""
    if client._placement is None:
        raise FailedPrecondition("call init() first")
    new_addresses = list(addresses)
    if placement is not None and (
            placement.num_shards != len(new_addresses)
            or {c.key for c in placement.chunks} != {c.key for c in client._chunks}):
        raise InvalidArgument("the placement does not fit the addresses and tensors")
    started = time.monotonic()
    async with client._refreshing:
        await asyncio.gather(*(client._shards.hello(a) for a in new_addresses))
        asked = list(dict.fromkeys([*client.addresses, *new_addresses]))
        answers = await asyncio.gather(*(ask_hello(client, a, leaving=a not in new_addresses)
                                         for a in asked))
        infos = {a: info for a, info in zip(asked, answers, strict=True) if info is not None}
        top = max(int(info["version"]) for info in infos.values())
        finished: dict[str, Any] | None = None
        if top > client.version or any(int(info.get("incoming", 0))
                                     for info in infos.values()):
            # An earlier change did not finish (its worker failed or
            # died), or another worker's change has not reached us yet.
            finished = await finish_change(client, top, infos)
        old = client.placement
        if placement is None:
            placement = relocate(old, client.addresses, new_addresses)
        if finished is not None and new_addresses == client.addresses and dict(
                placement.shard_of) == dict(old.shard_of):
            finished["seconds"] = time.monotonic() - started
            return finished
        version = client.version + 1
        layout = {"version": version, "addresses": new_addresses,
                  "shard_of": dict(placement.shard_of), "step": client.clock}
        involved = list(dict.fromkeys([*client.addresses, *new_addresses]))
        job = client.job.to_wire()
        # Every shard first: from here on, old-version calls are redirected.
        await asyncio.gather(*(
            client._shards.call(a, Shard.begin, job, layout,
                                new_addresses.index(a) if a in new_addresses else -1)
            for a in involved))
        moves: dict[tuple[str, str], list[Chunk]] = {}
        for chunk in client._chunks:
            source = client.addresses[old.shard_of[chunk.key]]
            target = new_addresses[placement.shard_of[chunk.key]]
            if source != target:
                moves.setdefault((source, target), []).append(chunk)
        moved = await asyncio.gather(*(
            transfer(client, source, target, version, chunks)
            for (source, target), chunks in moves.items()))
        await asyncio.gather(*(
            client._shards.call(source, Shard.release, version, [c.key for c in chunks])
            for (source, _), chunks in moves.items()))
        client._use(new_addresses, placement, version)
        # Shards that keep checkpoints write one now, so that a restart
        # restores the new placement rather than chunks that left.
        await asyncio.gather(*(checkpoint_if_kept(client, a) for a in involved))
    report = move_report(version, moves, moved, placement, time.monotonic() - started)
    logger.info("placement version %d on %d shards: moved %d chunks, %d bytes in %.2f s",
                version, len(new_addresses), report["chunks_moved"],
                report["bytes_moved"], report["seconds"])
    return report


async def ask_hello(client: PSClient, address: str, *, leaving: bool) -> dict[str, Any] | None:
    """A shard's hello; None for a shard that is leaving and gone."""
    try:
        info: dict[str, Any] = await client._shards.call(address, Shard.hello)
    except Unavailable:
        if not leaving:
            raise
        return None
    return info


async def finish_change(client: PSClient, version: int,
                         infos: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Bring the change to placement ``version`` to its end, as far as an
    earlier :meth:`reshard` took it, and use that placement.

    Every shard of the placement is told to serve it again (``begin`` is
    idempotent); each chunk a shard still waits for is found on whichever
    shard this worker knows (the placement's, earlier ones', those just
    asked) still holds it and moved there; then every shard drops what it
    no longer owns. Shards outside the placement that cannot be reached
    are passed over. Runs under ``_refreshing``.

    Raises:
        FailedPrecondition: the placement is for other tensors, or a chunk
            is on no shard that can be reached.
    """
    holder = next(a for a, info in infos.items() if int(info["version"]) == version)
    layout = await client._shards.call(holder, Shard.layout)
    if layout is None:  # placement version 0, which every worker computes
        raise FailedPrecondition(f"shard {holder} serves no placement to finish")
    addresses = [str(a) for a in layout["addresses"]]
    shard_of = {str(k): int(v) for k, v in dict(layout["shard_of"]).items()}
    chunks = {c.key: c for c in client._chunks}
    if set(shard_of) != set(chunks):
        raise FailedPrecondition("the shards' new placement is for other tensors")
    await asyncio.gather(*(client._shards.hello(a) for a in addresses))
    job = client.job.to_wire()
    await asyncio.gather(*(client._shards.call(a, Shard.begin, job, layout, i)
                           for i, a in enumerate(addresses)))
    waiting = await asyncio.gather(*(client._shards.call(a, Shard.incoming, version)
                                     for a in addresses))
    needed = {str(key): addresses[i] for i, keys in enumerate(waiting) for key in keys}
    others = [a for a in dict.fromkeys([*client.addresses, *client._retired, *infos])
              if a not in addresses]
    reachable = list(addresses)
    for address in others:
        # A shard that left may be stopped already: what it held then
        # must be on a shard that took it (else the loss is named below).
        try:
            await client._shards.call(address, Shard.begin, job, layout, -1)
        except Unavailable:
            logger.info("shard %s, which left the placement, is gone", address)
            continue
        reachable.append(address)
    moves: dict[tuple[str, str], list[Chunk]] = {}
    if needed:
        wanted = sorted(needed)
        held = await asyncio.gather(*(client._shards.call(a, Shard.holding, wanted)
                                      for a in reachable))
        source: dict[str, str] = {}
        for address, keys in zip(reachable, held, strict=True):
            for key in keys:
                source.setdefault(str(key), address)
        lost = sorted(set(needed) - set(source))
        if lost:
            raise FailedPrecondition(
                f"placement version {version} cannot be finished: chunks {lost[:5]} "
                f"({len(lost)} in all) are on no shard this worker can reach")
        for key, target in needed.items():
            moves.setdefault((source[key], target), []).append(chunks[key])
    moved = await asyncio.gather(*(transfer(client, s, t, version, cs)
                                   for (s, t), cs in moves.items()))
    everything = sorted(chunks)
    await asyncio.gather(*(client._shards.call(a, Shard.release, version, everything)
                           for a in reachable))
    placement = Placement(len(addresses), client._chunks, shard_of)
    client._use(addresses, placement, version)
    await asyncio.gather(*(checkpoint_if_kept(client, a) for a in reachable))
    report = move_report(version, moves, moved, placement, 0.0)
    logger.info("finished placement version %d on %d shards: moved %d chunks that were "
                "still on their way", version, len(addresses), report["chunks_moved"])
    return report


async def checkpoint_if_kept(client: PSClient, address: str) -> None:
    """Have the shard write a checkpoint, if it keeps them."""
    with contextlib.suppress(FailedPrecondition):  # no checkpoint directory
        await client._shards.call(address, Shard.checkpoint)


async def transfer(client: PSClient, source: str, target: str, version: int,
                    chunks: list[Chunk]) -> int:
    """Chunks from ``source`` to ``target`` through this worker, a
    message's worth at a time; returns the bytes moved."""
    moved = 0
    group: list[str] = []
    size = 0
    groups: list[list[str]] = []
    for chunk in chunks:
        if group and size + chunk.nbytes > client.config.message_bytes:
            groups.append(group)
            group, size = [], 0
        group.append(chunk.key)
        size += chunk.nbytes
    if group:
        groups.append(group)
    for keys in groups:
        records = await client._shards.call(source, Shard.export, version, keys)
        await client._shards.call(target, Shard.adopt, version, records)
        moved += nbytes(records)
    return moved


async def refresh(client: PSClient, version: int) -> None:
    """Adopt placement ``version`` (or later) from the shards."""
    async with client._refreshing:
        if client.version >= version:
            return
        # The first shard that has it answers; a shard that left the
        # placement may be gone already.
        asks = [asyncio.ensure_future(client._shards.call(a, Shard.layout))
                for a in client.addresses]
        layout: dict[str, Any] | None = None
        error: BaseException | None = None
        try:
            for next_done in asyncio.as_completed(asks):
                try:
                    found = await next_done
                except (Unavailable, FailedPrecondition) as exc:
                    error = exc
                    continue
                if isinstance(found, dict) and int(found["version"]) >= version:
                    layout = found
                    break
        finally:
            for ask in asks:
                ask.cancel()
        if layout is None:
            raise error or FailedPrecondition(
                f"a shard redirected to placement version {version}, but none has it")
        addresses = [str(a) for a in layout["addresses"]]
        shard_of = {str(k): int(v) for k, v in dict(layout["shard_of"]).items()}
        if set(shard_of) != {c.key for c in client._chunks}:
            raise FailedPrecondition("the shards' new placement is for other tensors")
        await asyncio.gather(*(client._shards.hello(a) for a in addresses))
        client._use(addresses, Placement(len(addresses), client._chunks, shard_of),
                  int(layout["version"]))
        logger.info("worker %d now uses placement version %d (%d shards)", client.worker,
                    client.version, len(addresses))


def move_report(version: int, moves: Mapping[tuple[str, str], Sequence[Chunk]],
                 moved: Sequence[int], placement: Placement, seconds: float) -> dict[str, Any]:
    """What :meth:`PSClient.reshard` returns about a change of placement."""
    return {"version": version, "bytes_moved": sum(moved),
            "parameter_bytes_moved": sum(c.nbytes for cs in moves.values() for c in cs),
            "chunks_moved": sum(len(c) for c in moves.values()), "seconds": seconds,
            "imbalance": placement.imbalance}
