"""Per-name metrics: counts, bytes, latency percentiles and histogram.

RPC methods (client and server) and collective operations keep theirs in
this one shape, which :mod:`tensorwire.metrics` exports.

Latencies go into fixed log-scale buckets (16 per decade, 1 µs to 1000 s),
so memory stays constant however many calls are made, and a percentile is
exact to within one bucket (about 15 %). Every fourth edge is an edge of
the exported histogram (:data:`HISTOGRAM_EDGES`, 4 per decade), so its
counts are exact: processes' histograms add up, where percentiles cannot.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .timeline import Timeline

__all__ = ("HISTOGRAM_EDGES", "MethodMetrics", "Metrics", "record_call")

_PER_DECADE = 16
_LOW = 1e-6
_BUCKETS = 9 * _PER_DECADE + 1
#: The lower edge of every bucket after the first: one C bisection per call
#: finds a latency's bucket, where log10 and its arithmetic cost several.
_EDGES = [_LOW * 10 ** (i / _PER_DECADE) for i in range(1, _BUCKETS)]
_EXPORT_EVERY = 4
#: Upper bounds (seconds) of the exported histogram's buckets: every fourth
#: edge, 10^(1/4) apart, from 1.8 µs to 1000 s (then +Inf).
HISTOGRAM_EDGES = tuple(_EDGES[_EXPORT_EVERY - 1::_EXPORT_EVERY])


@dataclasses.dataclass(slots=True)
class MethodMetrics:
    """Counters of one method."""

    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    #: The sum of every latency observed, a histogram's ``_sum``.
    seconds: float = 0.0
    buckets: list[int] = dataclasses.field(default_factory=lambda: [0] * _BUCKETS)

    @property
    def calls(self) -> int:
        """Calls observed: every one is in exactly one latency bucket (a
        count of its own would cost every call an increment)."""
        return sum(self.buckets)

    def observe(self, seconds: float, error: bool) -> None:
        # bisect_left: a latency equal to an edge counts below it, as a
        # Prometheus bucket includes its upper bound ("le").
        self.buckets[bisect.bisect_left(_EDGES, seconds)] += 1
        self.seconds += seconds
        if error:
            self.errors += 1

    def percentile(self, q: float) -> float | None:
        """Latency at quantile ``q`` (0..1), in seconds; None before any call."""
        total = sum(self.buckets)
        if not total:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(self.buckets):
            seen += count
            if seen >= rank and count:
                # The bucket's geometric middle.
                return float(_LOW * 10 ** ((index + 0.5) / _PER_DECADE))
        return None

    def histogram(self) -> list[list[float]]:
        """``[[le, count], ...]``: calls that took at most ``le`` seconds, at
        the :data:`HISTOGRAM_EDGES` where the count grows (the others repeat
        the count before them; calls past the last edge count only in
        ``calls``)."""
        found: list[list[float]] = []
        total = sum(self.buckets)
        seen = 0
        for index, le in enumerate(HISTOGRAM_EDGES):
            if seen == total:
                break
            start = index * _EXPORT_EVERY
            grown = sum(self.buckets[start:start + _EXPORT_EVERY])
            if grown:
                seen += grown
                found.append([le, seen])
        return found

    def snapshot(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "errors": self.errors,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "p50": self.percentile(0.50),
            "p90": self.percentile(0.90),
            "p99": self.percentile(0.99),
            "seconds": self.seconds,
            "histogram": self.histogram(),
        }


class Metrics(dict[str, MethodMetrics]):
    """Metrics of every method seen, by name; ``metrics[name]`` makes them
    on first use (a dict: a lookup of a known name runs no Python code)."""

    def __missing__(self, name: str) -> MethodMetrics:
        found = self[name] = MethodMetrics()
        return found

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{method: {calls, errors, bytes_in, bytes_out, p50, p90, p99, seconds,
        histogram}}``."""
        return {name: m.snapshot() for name, m in sorted(self.items())}


def record_call(metrics: MethodMetrics, timeline: Timeline | None, name: str, category: str,
                started: float, error: bool, **args: Any) -> None:
    """Count a call (or operation) that began at ``started`` (a
    ``time.perf_counter()`` reading) and has just ended in ``metrics``, and
    add its span to ``timeline`` when there is one."""
    metrics.observe(time.perf_counter() - started, error)
    if timeline is not None:
        timeline.add_since(name, category, started, error=error, **args)
