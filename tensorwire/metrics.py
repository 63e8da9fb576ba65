"""Metrics in the Prometheus text format, and an HTTP endpoint that serves them.

Every metrics source in tensorwire returns the same shape of dict,
``{name: {calls, errors, bytes_in, bytes_out, p50, p90, p99}}``:
``Server.metrics()`` and ``Client.metrics()`` per RPC method,
``Group.metrics()`` per collective operation, ``PSClient.metrics()`` per
push, pull and push_pull. Connection counters have their own shape,
``{peer: {messages_sent, messages_received, bytes_sent, bytes_received}}``
(``Server.transport_stats()``, ``Client.transport_stats()``), and become
``tensorwire_transport_*`` metrics. Give them names and serve::

    endpoint = await serve_metrics("127.0.0.1", 9464, {
        "rpc_server": server.metrics,
        "collective": group.metrics,
    })
    # curl http://127.0.0.1:9464/metrics

The text follows Prometheus's exposition format (version 0.0.4), so any
Prometheus server, or ``prometheus_client``'s parser, reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ("MetricsEndpoint", "prometheus_text", "serve_metrics")

logger = logging.getLogger(__name__)

Snapshot = Mapping[str, Mapping[str, Any]]
Source = Callable[[], Snapshot]

_COUNTERS = (
    ("calls", "tensorwire_calls_total", "Calls made or operations run."),
    ("errors", "tensorwire_errors_total", "Calls or operations that failed."),
    ("bytes_in", "tensorwire_bytes_in_total", "Bytes received."),
    ("bytes_out", "tensorwire_bytes_out_total", "Bytes sent."),
)
_QUANTILES = (("p50", "0.5"), ("p90", "0.9"), ("p99", "0.99"))
_TRANSPORT = (
    ("messages_sent", "tensorwire_transport_messages_sent_total", "Messages sent."),
    ("messages_received", "tensorwire_transport_messages_received_total",
     "Messages received."),
    ("bytes_sent", "tensorwire_transport_bytes_sent_total", "Bytes sent on the transport."),
    ("bytes_received", "tensorwire_transport_bytes_received_total",
     "Bytes received on the transport."),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(sources: Mapping[str, Source]) -> str:
    """The current values of every source, in the Prometheus text format."""
    snapshots = {source: read() for source, read in sources.items()}
    # Connection counters (``transport_stats()``) have a shape of their own.
    transport = {s: v for s, v in snapshots.items()
                 if any("messages_sent" in values for values in v.values())}
    snapshots = {s: v for s, v in snapshots.items() if s not in transport}
    lines: list[str] = []
    for key, metric, help_text in _TRANSPORT:
        if not transport:
            break
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for source, snapshot in transport.items():
            for name, values in snapshot.items():
                lines.append(f'{metric}{{source="{_label(source)}",name="{_label(name)}"}} '
                             f"{int(values.get(key, 0))}")
    for key, metric, help_text in _COUNTERS:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for source, snapshot in snapshots.items():
            for name, values in snapshot.items():
                lines.append(f'{metric}{{source="{_label(source)}",name="{_label(name)}"}} '
                             f"{int(values.get(key, 0))}")
    for key, quantile in _QUANTILES:
        # Gauges of their own: the "quantile" label belongs to summaries,
        # which also need a sum these sources do not keep.
        metric = f"tensorwire_latency_{key}_seconds"
        lines += [f"# HELP {metric} Latency at quantile {quantile}, exact to about 15 %.",
                  f"# TYPE {metric} gauge"]
        for source, snapshot in snapshots.items():
            for name, values in snapshot.items():
                if values.get(key) is not None:
                    lines.append(f'{metric}{{source="{_label(source)}",name="{_label(name)}"}} '
                                 f"{float(values[key]):.9g}")
    return "\n".join(lines) + "\n"


class MetricsEndpoint:
    """A running metrics endpoint; ``address`` is where it listens."""

    def __init__(self, server: asyncio.Server, sources: Mapping[str, Source]) -> None:
        self._server = server
        self.sources = dict(sources)
        host, port = server.sockets[0].getsockname()[:2]
        self.address = f"http://{host}:{port}/metrics"

    async def close(self) -> None:
        self._server.close()
        await self._server.wait_closed()

    async def __aenter__(self) -> MetricsEndpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def serve_metrics(host: str, port: int, sources: Mapping[str, Source]) -> MetricsEndpoint:
    """Serve ``GET /metrics`` on ``host:port`` (port 0 takes a free one).

    Raises:
        OSError: the address cannot be bound.
    """
    endpoint: MetricsEndpoint | None = None

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)).strip():
                pass  # the headers: nothing in them matters here
            parts = request.decode("latin-1").split()
            assert endpoint is not None
            if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                kind = "text/plain; version=0.0.4; charset=utf-8"
                try:
                    status, body = "200 OK", prometheus_text(endpoint.sources).encode()
                except Exception:
                    logger.exception("a metrics source failed")
                    status, body = "500 Internal Server Error", b"a metrics source failed\n"
            else:
                status, body, kind = "404 Not Found", b"try /metrics\n", "text/plain"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: "
                         f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError, ValueError) as exc:
            logger.debug("metrics request failed: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, port)
    endpoint = MetricsEndpoint(server, sources)
    return endpoint
