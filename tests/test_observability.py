"""Metrics (Python dicts, Prometheus text, the HTTP endpoint) and the timeline."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.collective import Group, GroupConfig, serve_rendezvous
from tensorwire.metrics import prometheus_text, serve_metrics
from tensorwire.timeline import Timeline

from .rpc.services import Store


async def test_collective_metrics_and_timeline(tmp_path: Path) -> None:
    timelines = [Timeline(process_name=f"rank {r}") for r in range(2)]
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", 2)
    ranks = await asyncio.gather(*(
        Group.create(rank=r, world_size=2, master=master, listen="tcp://127.0.0.1:0",
                     host_master=False,
                     config=GroupConfig(timeout=20, rendezvous_timeout=20, timeline=timeline))
        for r, timeline in enumerate(timelines)))
    try:
        for _ in range(3):
            await asyncio.gather(*(g.allreduce(np.ones(1000, np.float32)) for g in ranks))
        await asyncio.gather(*(g.barrier() for g in ranks))
        metrics = ranks[0].metrics()
        assert metrics["allreduce"]["calls"] == 3 and metrics["allreduce"]["errors"] == 0
        assert metrics["allreduce"]["bytes_out"] == 3 * 4000  # doubling: one exchange
        assert metrics["allreduce"]["bytes_in"] == 3 * 4000
        assert metrics["barrier"]["calls"] == 1
        assert metrics["allreduce"]["p50"] > 0
    finally:
        await asyncio.gather(*(g.close() for g in ranks))
        await server.close(grace=0)
    events = timelines[0].events
    assert [e["name"] for e in events] == ["allreduce"] * 3 + ["barrier"]
    assert all(e["ph"] == "X" and e["dur"] > 0 and e["cat"] == "collective" for e in events)
    assert events[0]["args"]["call"] == "allreduce(<f4[1000]C@cpu,sum)"
    starts = [e["ts"] for e in events]
    assert starts == sorted(starts)
    path = tmp_path / "rank0.trace.json"
    timelines[0].save(path)
    trace = json.loads(path.read_text())
    assert trace["traceEvents"][0] == {"name": "process_name", "ph": "M",
                                       "pid": events[0]["pid"], "args": {"name": "rank 0"}}
    assert len(trace["traceEvents"]) == 5


def test_timeline_is_bounded() -> None:
    timeline = Timeline(max_events=2)
    for i in range(5):
        with timeline.span("op", "test", i=i) as args:
            args["extra"] = True
    assert len(timeline.events) == 2 and timeline.dropped == 3
    assert timeline.events[1]["args"] == {"i": 1, "extra": True}


def _families(text: str) -> dict[str, Any]:
    """The text as prometheus_client's own parser reads it, by family name."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(family: Any, sample: str, **labels: str) -> float:
    (found,) = [s.value for s in family.samples if s.name == sample and s.labels == labels]
    return float(found)


async def test_prometheus_text_and_endpoint() -> None:
    server = tw.Server([Store()])
    (address,) = await server.start("tcp://127.0.0.1:0")
    async with tw.connect(address) as client:
        await client.call("Store.put", "k", np.arange(4))
        await client.call("Store.get", "k")
        with pytest.raises(tw.errors.NotFound):
            await client.call("Store.get", "nothing")
        text = prometheus_text({"rpc_server": server.metrics, "rpc_client": client.metrics,
                                "server_transport": server.transport_stats,
                                "client_transport": client.transport_stats})
        families = _families(text)
        ((peer, stats),) = client.transport_stats().items()
        # The RPC handshake's message each way, then the three calls; the
        # first call of each method also grants a CREDIT of 1, which the
        # server drops (docs/protocol.md, "Flow control").
        assert peer == address
        assert stats["messages_sent"] == 4 + 2 and stats["messages_received"] == 4
        sent = families["tensorwire_transport_messages_sent"]
        assert sent.type == "counter"
        assert _value(sent, "tensorwire_transport_messages_sent_total",
                      source="client_transport", name=address) == 4 + 2
        # Host arrays only: no device frame went through host memory.
        assert _value(families["tensorwire_transport_device_bytes_staged"],
                      "tensorwire_transport_device_bytes_staged_total",
                      source="client_transport", name=address) == 0
        calls = families["tensorwire_calls"]
        assert calls.type == "counter"
        assert _value(calls, "tensorwire_calls_total", source="rpc_server", name="Store.get") == 2
        assert _value(calls, "tensorwire_calls_total", source="rpc_client", name="Store.put") == 1
        assert _value(families["tensorwire_errors"], "tensorwire_errors_total",
                      source="rpc_client", name="Store.get") == 1
        put = client.metrics()["Store.put"]
        assert _value(families["tensorwire_bytes_out"], "tensorwire_bytes_out_total",
                      source="rpc_client", name="Store.put") == put["bytes_out"] > 32
        # Latency: a histogram whose buckets grow with their bound and end in
        # +Inf at the count of calls, its sum the sum of the latencies.
        latency = families["tensorwire_latency_seconds"]
        assert latency.type == "histogram"
        labels = {"source": "rpc_client", "name": "Store.get"}
        buckets = [(float(s.labels["le"]), s.value) for s in latency.samples
                   if s.name.endswith("_bucket") and s.labels.items() > labels.items()]
        assert len(buckets) == 37 and buckets[-1] == (float("inf"), 2)
        assert [b for b, _ in buckets] == sorted(b for b, _ in buckets)
        assert [n for _, n in buckets] == sorted(n for _, n in buckets)
        assert buckets[0][1] == 0 and buckets[-2][1] == 2  # a call takes over 1.8 µs
        assert _value(latency, "tensorwire_latency_seconds_count", **labels) == 2
        assert 0 < _value(latency, "tensorwire_latency_seconds_sum", **labels) < 10
        assert _value(latency, "tensorwire_latency_seconds_sum", **labels) == pytest.approx(
            client.metrics()["Store.get"]["seconds"])
        async with await serve_metrics("127.0.0.1", 0, {"rpc_server": server.metrics}) as endpoint:
            host, port = endpoint.address.removeprefix("http://").split("/")[0].split(":")
            status, body = await fetch(host, int(port), "/metrics")
            assert status.endswith(" 200 OK")
            served = _families(body)
            assert _value(served["tensorwire_calls"], "tensorwire_calls_total",
                          source="rpc_server", name="Store.put") == 1
            await client.call("Store.put", "k", 1)
            _, again = await fetch(host, int(port), "/metrics")
            assert _value(_families(again)["tensorwire_calls"], "tensorwire_calls_total",
                          source="rpc_server", name="Store.put") == 2
            assert "rpc_client" not in again
            endpoint.sources["rpc_client"] = client.metrics  # read anew at every scrape
            _, more = await fetch(host, int(port), "/metrics")
            assert _value(_families(more)["tensorwire_calls"], "tensorwire_calls_total",
                          source="rpc_client", name="Store.put") == 2
    await server.close()


def test_histograms_of_two_processes_add_up() -> None:
    # What percentiles cannot do: Prometheus sums the buckets of processes.
    from tensorwire._counters import HISTOGRAM_EDGES, Metrics

    first, second, both = Metrics(), Metrics(), Metrics()
    for seconds in (3e-6, 2e-4, 2e-4, 0.5):
        first["op"].observe(seconds, False)
        both["op"].observe(seconds, False)
    for seconds in (1e-5, 0.5, 2000.0):
        second["op"].observe(seconds, False)
        both["op"].observe(seconds, False)
    # An observation on an edge counts in that edge's bucket (le: at most).
    first["op"].observe(HISTOGRAM_EDGES[3], False)
    both["op"].observe(HISTOGRAM_EDGES[3], False)

    def buckets(metrics: Metrics) -> dict[str, float]:
        families = _families(prometheus_text({"p": metrics.snapshot}))
        return {s.labels["le"]: s.value for s in families["tensorwire_latency_seconds"].samples
                if s.name.endswith("_bucket")}

    one, two, total = buckets(first), buckets(second), buckets(both)
    assert {le: one[le] + two[le] for le in total} == total
    assert total["+Inf"] == 8 and total["1000"] == 7  # 2000 s: past the last bound
    le = f"{HISTOGRAM_EDGES[3]:.6g}"
    assert one[le] == 2  # 3 µs and the one on the edge


def test_the_counters_clock_is_perf_counter() -> None:
    # Calls are timed with _counters.now() (C); timeline spans and callers
    # that pass a time.perf_counter() reading must be on the same clock.
    import time

    from tensorwire._counters import MethodMetrics, now

    before = time.perf_counter()
    reading = now()
    after = time.perf_counter()
    assert before - 1e-6 <= reading <= after + 1e-6
    metrics = MethodMetrics()
    metrics.observe(2e-4, True)
    assert metrics.calls == 1 and metrics.errors == 1
    assert sum(metrics.buckets) == 1 and len(metrics.buckets) == 145


async def test_rpc_and_parameter_server_spans() -> None:
    from tensorwire import ps
    from tensorwire.rpc import ClientConfig, ServerConfig

    server_side, client_side, worker_side = Timeline(), Timeline(), Timeline()
    server = tw.Server([Store()], config=ServerConfig(timeline=server_side))
    (address,) = await server.start("tcp://127.0.0.1:0")
    async with tw.connect(address, config=ClientConfig(timeline=client_side)) as client:
        await client.call("Store.put", "k", np.arange(4))
        with pytest.raises(tw.errors.NotFound):
            await client.call("Store.get", "missing")
    await server.close()
    assert [(e["name"], e["cat"], e["args"]["error"]) for e in client_side.events] == [
        ("Store.put", "rpc.client", False), ("Store.get", "rpc.client", True)]
    assert {(e["name"], e["cat"]) for e in server_side.events} == {
        ("Store.put", "rpc.server"), ("Store.get", "rpc.server")}
    shard = await ps.serve("tcp://127.0.0.1:0")
    client = await ps.connect(shard.addresses, worker=0, num_workers=1,
                              optimizer=ps.SGD(lr=0.1),
                              config=ps.PSConfig(timeline=worker_side))
    await client.init({"w": np.zeros(8, np.float32)})
    await client.push({"w": np.ones(8, np.float32)})
    await client.pull()
    await client.push_pull({"w": np.ones(8, np.float32)})
    metrics = client.metrics()
    assert {name: m["calls"] for name, m in metrics.items()} == {
        "push": 1, "pull": 1, "push_pull": 1}
    assert metrics["push"]["bytes_out"] == 32 and metrics["push"]["bytes_in"] == 0
    assert metrics["pull"]["bytes_in"] == 32 and metrics["push_pull"]["bytes_in"] == 32
    await client.close()
    await shard.close(checkpoint=False)
    assert [(e["name"], e["args"]["clock"]) for e in worker_side.events] == [
        ("push", 0), ("pull", 1), ("push_pull", 1)]
    assert all(e["cat"] == "ps" and e["dur"] > 0 for e in worker_side.events)


async def fetch(host: str, port: int, path: str) -> tuple[str, str]:
    """GET over a bare socket: the status line and the body."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    response = (await reader.read()).decode()
    writer.close()
    await writer.wait_closed()
    head, _, body = response.partition("\r\n\r\n")
    return head.splitlines()[0], body
