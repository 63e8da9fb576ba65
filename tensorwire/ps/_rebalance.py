"""Bandwidth-aware balancing: measure each shard's effective bandwidth and
move chunks from slow shards to fast ones when the predicted step time is
uneven (:meth:`PSClient.rebalance <tensorwire.ps.PSClient.rebalance>`).

The plan is :func:`~tensorwire.ps.balance`'s; the move is a reshard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import FailedPrecondition, Unavailable
from ._placement import balance, predicted_times
from .server import Shard

if TYPE_CHECKING:
    from .client import PSClient

__all__ = ("bandwidth", "maybe_rebalance", "rebalance")

logger = logging.getLogger(__name__)


async def bandwidth(client: PSClient) -> list[float | None]:
    """Each shard's effective bandwidth since the last call: what
    :meth:`PSClient.bandwidth <tensorwire.ps.PSClient.bandwidth>` returns."""
    reports = await asyncio.gather(*(client._shards.call(a, Shard.traffic)
                                     for a in client.addresses))
    out: list[float | None] = []
    for address, report in zip(client.addresses, reports, strict=True):
        link = client._shards.link(address)
        served = waited = 0.0
        if float(client.worker) in report["workers"]:
            row = report["workers"].index(float(client.worker))
            served = report["bytes_in"][row] + report["bytes_out"][row]
            waited = report["waited"][row]
        busy = link.busy_now()
        before = link.mark
        link.mark = (busy, served, waited)
        moved = served - before[1]
        seconds = (busy - before[0]) - (waited - before[2])
        out.append(moved / seconds if moved > 0 and seconds > 0 else None)
    return out


async def rebalance(client: PSClient, *, threshold: float | None = None,
                    bandwidth: Sequence[float] | None = None) -> dict[str, Any]:
    """Move chunks from slow shards to fast ones when it pays: what
    :meth:`PSClient.rebalance <tensorwire.ps.PSClient.rebalance>` does."""
    threshold = client.config.rebalance_threshold if threshold is None else threshold
    measured: list[float | None] = (list(bandwidth) if bandwidth is not None
                                    else await client.bandwidth())
    if bandwidth is None:
        # Each link's estimate is the mean of its last two measurements:
        # one step's worth of traffic is noisy, a slower reaction is cheap.
        for i, (address, value) in enumerate(zip(client.addresses, measured, strict=True)):
            link = client._shards.link(address)
            if value is not None:
                link.estimate = value if link.estimate is None else (
                    link.estimate + value) / 2
            measured[i] = link.estimate
    known = [b for b in measured if b is not None]
    report: dict[str, Any] = {"bandwidth": measured, "rebalanced": False}
    if not known:
        report.update(predicted=None, imbalance=1.0)
        return report
    fill = sum(known) / len(known)
    speeds = [fill if b is None else b for b in measured]
    predicted = predicted_times(client.placement, speeds)
    mean = sum(predicted) / len(predicted)
    imbalance = max(predicted) / mean if mean > 0 else 1.0
    report.update(predicted=predicted, imbalance=imbalance)
    if imbalance <= 1 + threshold:
        return report
    plan = balance(client.placement, speeds)
    after = predicted_times(plan, speeds)
    if max(after) * (1 + threshold) >= max(predicted):
        # Chunks too coarse to do better, or too little to gain.
        report["predicted_after"] = after
        return report
    report.update(await client.reshard(client.addresses, placement=plan))
    report.update(rebalanced=True, predicted_after=after)
    return report


async def maybe_rebalance(client: PSClient, clock: int) -> None:
    """On worker 0, every ``config.rebalance_every`` steps (and only between
    steps), check the balance; a failed move is logged and finished by the next."""
    every = client.config.rebalance_every
    if (every is None or client.worker != 0 or clock == 0 or clock % every
            or client._running > 1):
        return
    try:
        report = await client.rebalance()
    except (FailedPrecondition, Unavailable) as exc:
        # A move that stopped part-way is finished by the next check.
        logger.warning("rebalancing failed, checked again in %d steps: %s", every, exc)
        return
    logger.info("rebalance check at step %d: bandwidth %s MB/s, predicted-time "
                "imbalance %.3f%s", clock,
                [None if b is None else round(b / 1e6, 1) for b in report["bandwidth"]],
                report["imbalance"], ", moved" if report["rebalanced"] else "")
