"""tensorwire's metrics for Prometheus, through ``prometheus_client``.

Every metrics source in tensorwire returns the same shape of dict,
``{name: {calls, errors, bytes_in, bytes_out, p50, p90, p99, seconds,
histogram}}``: ``Server.metrics()`` and ``Client.metrics()`` per RPC method,
``Group.metrics()`` per collective operation, ``PSClient.metrics()`` per
push, pull and push_pull. Connection counters have their own shape,
``{peer: {messages_sent, messages_received, bytes_sent, bytes_received,
device_bytes_staged}}``
(``Server.transport_stats()``, ``Client.transport_stats()``), and become
``tensorwire_transport_*`` metrics. Give them names and serve::

    endpoint = await serve_metrics("127.0.0.1", 9464, {
        "rpc_server": server.metrics,
        "collective": group.metrics,
    })
    # curl http://127.0.0.1:9464/metrics

Counters stay counters; latency is a histogram
(``tensorwire_latency_seconds``), which Prometheus adds up across
processes and turns into quantiles with ``histogram_quantile()``.
``prometheus_client`` (the ``metrics`` extra) writes the text and serves
it; it is imported when first needed, so importing this module costs
nothing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._counters import HISTOGRAM_EDGES
from .errors import ConfigError

__all__ = ("Collector", "MetricsEndpoint", "prometheus_text", "serve_metrics")

Snapshot = Mapping[str, Mapping[str, Any]]
Source = Callable[[], Snapshot]

_LABELS = ("source", "name")
_COUNTERS = (
    ("calls", "tensorwire_calls_total", "Calls made or operations run."),
    ("errors", "tensorwire_errors_total", "Calls or operations that failed."),
    ("bytes_in", "tensorwire_bytes_in_total", "Bytes received."),
    ("bytes_out", "tensorwire_bytes_out_total", "Bytes sent."),
)
_TRANSPORT = (
    ("messages_sent", "tensorwire_transport_messages_sent_total", "Messages sent."),
    ("messages_received", "tensorwire_transport_messages_received_total",
     "Messages received."),
    ("bytes_sent", "tensorwire_transport_bytes_sent_total", "Bytes sent on the transport."),
    ("bytes_received", "tensorwire_transport_bytes_received_total",
     "Bytes received on the transport."),
    ("device_bytes_staged", "tensorwire_transport_device_bytes_staged_total",
     "Bytes of CUDA frames copied through host memory (a transport without device support)."),
)
#: Seconds an endpoint's scrape waits for the event loop to read the sources.
_READ_TIMEOUT = 10.0


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ConfigError("tensorwire.metrics needs prometheus_client: "
                          "pip install 'tensorwire[metrics]'") from None
    return prometheus_client


def _buckets(histogram: list[list[float]], calls: int) -> list[tuple[str, float]]:
    """A snapshot's sparse ``[[le, count], ...]`` -> every exported bucket."""
    found = {le: count for le, count in histogram}
    buckets = []
    count = 0.0
    for le in HISTOGRAM_EDGES:
        count = found.get(le, count)
        buckets.append((f"{le:.6g}", count))
    buckets.append(("+Inf", float(calls)))
    return buckets


class Collector:
    """A ``prometheus_client`` collector over tensorwire's metrics sources.

    ``read`` returns ``{source name: snapshot}``; ``Collector.of(sources)``
    reads a mapping of sources. Register one in a registry of your own to
    export tensorwire's metrics beside others::

        prometheus_client.REGISTRY.register(Collector.of({"rpc": server.metrics}))

    The registry then calls the sources from the thread that scrapes; a
    source that is not safe to call from there belongs behind
    :func:`serve_metrics`, which reads them on the event loop.
    """

    def __init__(self, read: Callable[[], Mapping[str, Snapshot]]) -> None:
        self._read = read

    @classmethod
    def of(cls, sources: Mapping[str, Source]) -> Collector:
        """A collector that calls each source when scraped."""
        return cls(lambda: {name: read() for name, read in sources.items()})

    def describe(self) -> list[Any]:
        # Nothing in advance: a registry would otherwise collect once at
        # register() to learn the names, calling every source.
        return []

    def collect(self) -> Iterator[Any]:
        """The metric families, read now.

        Raises:
            ConfigError: prometheus_client is not installed.
        """
        metrics_core = _prometheus().metrics_core
        snapshots = self._read()
        # Connection counters (``transport_stats()``) have a shape of their own.
        transport = {s: v for s, v in snapshots.items()
                     if any("messages_sent" in values for values in v.values())}
        methods = {s: v for s, v in snapshots.items() if s not in transport}
        if transport:
            for key, metric, help_text in _TRANSPORT:
                family = metrics_core.CounterMetricFamily(metric, help_text, labels=_LABELS)
                for source, snapshot in transport.items():
                    for name, values in snapshot.items():
                        family.add_metric([source, name], int(values.get(key, 0)))
                yield family
        for key, metric, help_text in _COUNTERS:
            family = metrics_core.CounterMetricFamily(metric, help_text, labels=_LABELS)
            for source, snapshot in methods.items():
                for name, values in snapshot.items():
                    family.add_metric([source, name], int(values.get(key, 0)))
            yield family
        latency = metrics_core.HistogramMetricFamily(
            "tensorwire_latency_seconds",
            "Latency of calls and operations (for RPC servers the handler's run).",
            labels=_LABELS)
        for source, snapshot in methods.items():
            for name, values in snapshot.items():
                if "histogram" in values:
                    latency.add_metric([source, name],
                                       _buckets(values["histogram"], int(values["calls"])),
                                       float(values.get("seconds", 0.0)))
        yield latency


def _registry(collector: Collector) -> Any:
    registry = _prometheus().CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def prometheus_text(sources: Mapping[str, Source]) -> str:
    """The current values of every source, in the Prometheus text format.

    Raises:
        ConfigError: prometheus_client is not installed.
    """
    text: bytes = _prometheus().generate_latest(_registry(Collector.of(sources)))
    return text.decode()


class MetricsEndpoint:
    """A running metrics endpoint; ``address`` is where it listens.

    ``sources`` may be changed while it runs: each scrape reads what it holds.
    """

    def __init__(self, server: Any, thread: threading.Thread,
                 sources: Mapping[str, Source]) -> None:
        self._server = server
        self._thread = thread
        self.sources = dict(sources)
        host, port = server.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        self.address = f"http://{host}:{port}/metrics"

    def _stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    async def close(self) -> None:
        """Stop serving (a scrape in progress finishes first)."""
        await asyncio.to_thread(self._stop)

    async def __aenter__(self) -> MetricsEndpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def serve_metrics(host: str, port: int, sources: Mapping[str, Source]) -> MetricsEndpoint:
    """Serve the sources' metrics over HTTP on ``host:port`` (port 0 takes a
    free one), with ``prometheus_client``'s server in a thread of its own.

    Each scrape reads the sources on this event loop (they are not safe to
    call from another thread); a loop that does not answer within 10 s
    fails that scrape.

    Raises:
        ConfigError: prometheus_client is not installed.
        OSError: the address cannot be bound.
    """
    prometheus = _prometheus()
    loop = asyncio.get_running_loop()
    endpoint: MetricsEndpoint | None = None

    async def snapshots() -> dict[str, Snapshot]:
        assert endpoint is not None
        return {name: read() for name, read in endpoint.sources.items()}

    def read() -> Mapping[str, Snapshot]:
        return asyncio.run_coroutine_threadsafe(snapshots(), loop).result(_READ_TIMEOUT)

    server, thread = prometheus.start_http_server(port, host, _registry(Collector(read)))
    endpoint = MetricsEndpoint(server, thread, sources)
    return endpoint
