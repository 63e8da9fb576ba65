"""Metrics (Python dicts, Prometheus text, the HTTP endpoint) and the timeline."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

import tensorwire as tw
from tensorwire.collective import Group, GroupConfig, serve_rendezvous
from tensorwire.metrics import prometheus_text, serve_metrics
from tensorwire.timeline import Timeline

from .rpc.services import Store

SAMPLE = re.compile(r'^[a-z0-9_]+\{source="[^"]*",name="[^"]*"\} [0-9.e+-]+$')


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


async def test_prometheus_text_and_endpoint() -> None:
    server = tw.Server([Store()])
    (address,) = await server.start("tcp://127.0.0.1:0")
    async with tw.connect(address) as client:
        await client.call("Store.put", "k", np.arange(4))
        await client.call("Store.get", "k")
        text = prometheus_text({"rpc_server": server.metrics, "rpc_client": client.metrics,
                                "server_transport": server.transport_stats,
                                "client_transport": client.transport_stats})
        ((peer, stats),) = client.transport_stats().items()
        # The RPC handshake's message each way, then the two calls.
        assert peer == address and stats["messages_sent"] == stats["messages_received"] == 3
        assert (f'tensorwire_transport_messages_sent_total{{source="client_transport",'
                f'name="{address}"}} 3') in text
        assert 'tensorwire_calls_total{source="rpc_server",name="Store.get"} 1' in text
        assert 'tensorwire_calls_total{source="rpc_client",name="Store.put"} 1' in text
        assert 'tensorwire_latency_p99_seconds{source="rpc_server",name="Store.get"} ' in text
        for line in text.splitlines():
            assert line.startswith("# ") or SAMPLE.match(line), line
        async with await serve_metrics("127.0.0.1", 0, {"rpc_server": server.metrics}) as endpoint:
            host, port = endpoint.address.removeprefix("http://").split("/")[0].split(":")
            status, body = await fetch(host, int(port), "/metrics")
            assert status == "HTTP/1.1 200 OK"
            assert 'name="Store.put"} 1' in body
            await client.call("Store.put", "k", 1)
            _, again = await fetch(host, int(port), "/metrics")
            assert 'tensorwire_calls_total{source="rpc_server",name="Store.put"} 2' in again
            status, _ = await fetch(host, int(port), "/")
            assert status == "HTTP/1.1 404 Not Found"
    await server.close()


async def fetch(host: str, port: int, path: str) -> tuple[str, str]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    response = (await reader.read()).decode()
    writer.close()
    await writer.wait_closed()
    head, _, body = response.partition("\r\n\r\n")
    return head.splitlines()[0], body


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
