# cython: language_level=3
"""Per-name metrics: counts, bytes, latency percentiles and histogram.

RPC methods (client and server) and collective operations keep theirs in
this one shape, which :mod:`tensorwire.metrics` exports.

Latencies go into fixed log-scale buckets (16 per decade, 1 µs to 1000 s),
so memory stays constant however many calls are made, and a percentile is
exact to within one bucket (about 15 %). Every fourth edge is an edge of
the exported histogram (:data:`HISTOGRAM_EDGES`, 4 per decade), so its
counts are exact: processes' histograms add up, where percentiles cannot.
"""

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

__all__ = ("HISTOGRAM_EDGES", "MethodMetrics", "Metrics", "now", "record_call")

_PER_DECADE = 16
_LOW = 1e-6
cdef enum:
    _N_EDGES = N_BUCKETS - 1  # 9 decades of _PER_DECADE (_counters.pxd)
_BUCKETS = N_BUCKETS
#: The lower edge of every bucket after the first: one C bisection per call
#: finds a latency's bucket, where log10 and its arithmetic cost several.
_EDGES = [_LOW * 10 ** (i / _PER_DECADE) for i in range(1, _BUCKETS)]
_EXPORT_EVERY = 4
#: Upper bounds (seconds) of the exported histogram's buckets: every fourth
#: edge, 10^(1/4) apart, from 1.8 µs to 1000 s (then +Inf).
HISTOGRAM_EDGES = tuple(_EDGES[_EXPORT_EVERY - 1::_EXPORT_EVERY])


# The edges again as a C array, searched in C: a bisect.bisect_left() call
# through Python costs more than the rest of observe() together.
cdef double _c_edges[_N_EDGES]
assert len(_EDGES) == _N_EDGES
for _i, _edge in enumerate(_EDGES):
    _c_edges[_i] = _edge
del _i, _edge


cdef inline Py_ssize_t _bucket(double seconds) noexcept:
    """``bisect.bisect_left(_EDGES, seconds)``."""
    cdef Py_ssize_t low = 0, high = _N_EDGES, middle
    while low < high:
        middle = (low + high) // 2
        if _c_edges[middle] < seconds:
            low = middle + 1
        else:
            high = middle
    return low


cpdef double now() noexcept:
    """``time.perf_counter()``, read in C: seconds on the monotonic clock
    (on Linux both are ``clock_gettime(CLOCK_MONOTONIC)``; a test checks
    that they agree). Every RPC call reads it twice."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef class MethodMetrics:
    """Counters of one method (compiled: every call of every method updates
    them)."""

    # Its fields are declared in _counters.pxd: errors, bytes_in, bytes_out,
    # seconds (the sum of every latency observed, a histogram's ``_sum``)
    # and the count of each latency bucket (C integers, zeroed by Cython).

    @property
    def buckets(self):
        """The count of calls in each latency bucket (a copy)."""
        return [self._counts[i] for i in range(N_BUCKETS)]

    @property
    def calls(self):
        """Calls observed: every one is in exactly one latency bucket (a
        count of its own would cost every call an increment)."""
        return sum(self.buckets)

    cpdef void observe(self, double seconds, bint error) except *:
        # bisect_left: a latency equal to an edge counts below it, as a
        # Prometheus bucket includes its upper bound ("le").
        self._counts[_bucket(seconds)] += 1
        self.seconds += seconds
        if error:
            self.errors += 1

    def percentile(self, double q):
        """Latency at quantile ``q`` (0..1), in seconds; None before any call."""
        buckets = self.buckets
        total = sum(buckets)
        if not total:
            return None
        rank = q * total
        seen = 0
        for index, count in enumerate(buckets):
            seen += count
            if seen >= rank and count:
                # The bucket's geometric middle.
                return float(_LOW * 10 ** ((index + 0.5) / _PER_DECADE))
        return None

    def histogram(self):
        """``[[le, count], ...]``: calls that took at most ``le`` seconds, at
        the :data:`HISTOGRAM_EDGES` where the count grows (the others repeat
        the count before them; calls past the last edge count only in
        ``calls``)."""
        found = []
        buckets = self.buckets
        total = sum(buckets)
        seen = 0
        for index, le in enumerate(HISTOGRAM_EDGES):
            if seen == total:
                break
            start = index * _EXPORT_EVERY
            grown = sum(buckets[start:start + _EXPORT_EVERY])
            if grown:
                seen += grown
                found.append([le, seen])
        return found

    def snapshot(self):
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


cdef class Metrics(dict):
    """Metrics of every method seen, by name; ``metrics[name]`` makes them
    on first use (a dict: a lookup of a known name runs no Python code).

    A compiled subclass, not a Python one: a Python subclass of dict looks
    ``metrics[name]`` up through its ``__getitem__`` method (a Python-level
    call per lookup, the client's per call), a compiled one keeps dict's
    own C lookup."""

    def __missing__(self, name):
        found = self[name] = MethodMetrics()
        return found

    def snapshot(self):
        """``{method: {calls, errors, bytes_in, bytes_out, p50, p90, p99, seconds,
        histogram}}``."""
        return {name: m.snapshot() for name, m in sorted(self.items())}


cpdef void record_call(MethodMetrics metrics, object timeline, str name, str category,
                       double started, bint error, dict args=None) except *:
    """Count a call (or operation) that began at ``started`` (a ``now()`` or
    ``time.perf_counter()`` reading) and has just ended in ``metrics``, and
    add its span to ``timeline`` when there is one, with ``args``."""
    metrics.observe(now() - started, error)
    if timeline is not None:
        timeline.add_since(name, category, started, error=error, **(args or {}))
