"""The RPC suite, over tcp://, inproc:// and ucx://."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import traceback
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import tensorwire as tw
from tensorwire import rpc, testing
from tensorwire.errors import (
    ConfigError,
    DeadlineExceeded,
    EncodeError,
    Internal,
    InvalidArgument,
    NotFound,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from tensorwire.rpc import ClientConfig, ServerConfig
from tensorwire.rpc import protocol as p
from tensorwire.transports import Limits, TransportConfig
from tensorwire.transports import connect as transport_connect

from ..transports.test_conformance import at_offset
from .services import Store


@contextlib.asynccontextmanager
async def serving(
    url: str, *services: rpc.Service, config: ServerConfig | None = None
) -> AsyncIterator[tw.Server]:
    server = tw.Server(services or [Store()], config=config)
    await server.start(url)
    try:
        yield server
    finally:
        await server.close(grace=0)


async def test_tensors_and_nested_values_round_trip(url: str) -> None:
    value = {
        "w": np.arange(1 << 18, dtype=np.float32).reshape(512, 512),
        "nested": [1, 2.5, "three", (b"four", None, True), {"deep": np.ones((2, 3), np.int64)}],
        "empty": np.zeros((0, 4)),
    }
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        store = client.proxy(Store)
        await store.put("v", value)
        back = await store.get("v")
    assert back.keys() == value.keys()
    assert np.array_equal(back["w"], value["w"])
    assert back["nested"][:3] == [1, 2.5, "three"]
    assert back["nested"][3] == (b"four", None, True)
    assert np.array_equal(back["nested"][4]["deep"], np.ones((2, 3), np.int64))
    assert back["empty"].shape == (0, 4)


async def test_server_receives_tensors_without_copies(url: str) -> None:
    # 16 bytes past a 64-byte boundary, as NumPy's large arrays are.
    array = at_offset(np.arange(1 << 20, dtype=np.float64).view(np.uint8), 16).view(np.float64)
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        seen = await client.proxy(Store).inspect(array)
    # The handler's array owns no memory: it is a view whose root is the
    # transport's receive buffer, the tensor's size plus at most the 64 bytes
    # of alignment slack.
    assert seen["owndata"] is False
    assert array.nbytes <= seen["root_nbytes"] <= array.nbytes + 64
    if url.startswith("inproc"):
        # In one process the frame is the caller's own memory.
        assert seen["address"] == array.ctypes.data
    else:
        assert seen["root_dtype"] == "uint8"
        assert seen["writeable"] is True
        # tcp:// aligns a frame to 64 bytes; ucx:// puts it where the
        # caller's lay past a 64-byte boundary (docs/transports.md).
        assert seen["address"] % 64 == (16 if url.startswith("ucx") else 0)


async def test_a_thousand_concurrent_calls_on_one_connection(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        store = client.proxy(Store)
        results = await asyncio.wait_for(
            asyncio.gather(*(store.echo([i, str(i)]) for i in range(1000))), 60
        )
    assert results == [[i, str(i)] for i in range(1000)]


async def test_plain_call_by_name(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        await client.call("Store.put", "k", 5)
        assert await client.call("Store.get", key="k") == 5


async def test_deadline_passing_mid_handler_cancels_it(url: str) -> None:
    store = Store()
    async with serving(url, store) as server, tw.connect(server.addresses[0]) as client:
        with pytest.raises(DeadlineExceeded):
            await client.call("Store.sleep", 30, "late", timeout=0.3)
        for _ in range(200):
            if store.cancelled:
                break
            await asyncio.sleep(0.01)
        assert store.cancelled == ["late"]


@pytest.mark.parametrize("timeout", [0.0, -1.0])
async def test_a_deadline_already_past_fails_only_its_call(url: str, timeout: float) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        assert await client.call("Store.echo", 1) == 1
        with pytest.raises(DeadlineExceeded):
            await client.call("Store.echo", 2, timeout=timeout)
        with pytest.raises(DeadlineExceeded):
            await client.proxy(Store, timeout=timeout).echo(3)
        assert await client.call("Store.echo", 4) == 4  # the connection goes on


async def test_an_infinite_timeout_is_no_deadline_and_nan_is_refused(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        assert await client.call("Store.echo", 1, timeout=math.inf) == 1
        assert await client.proxy(Store, timeout=1e12).echo(2) == 2
        assert [i async for i in client.stream("Store.count", 3, timeout=math.inf)] == [0, 1, 2]
        with pytest.raises(ConfigError, match="timeout"):
            await client.call("Store.echo", 3, timeout=math.nan)
        with pytest.raises(ConfigError, match="timeout"):
            async for _ in client.stream("Store.count", 3, timeout=math.nan):
                pass
        assert await client.call("Store.echo", 4) == 4  # the connection goes on


async def test_deadline_travels_to_the_server(url: str) -> None:
    store = Store()
    config = ClientConfig(timeout=60)
    async with serving(url, store) as server, tw.connect(server.addresses[0],
                                                         config=config) as client:
        # The client waits a little longer than the server, so the server's
        # deadline fires first and its DEADLINE_EXCEEDED is what arrives.
        task = asyncio.create_task(client.call("Store.sleep", 30, "srv", timeout=0.3))
        with pytest.raises(DeadlineExceeded, match=r"within its deadline of 0\.\d+ s"):
            await task
        assert store.cancelled == ["srv"]


async def test_a_handlers_own_deadline_error_keeps_its_message(url: str) -> None:
    async with serving(url, Store()) as server, tw.connect(server.addresses[0]) as client:
        with pytest.raises(DeadlineExceeded, match="the backend took too long") as caught:
            await client.call("Store.expire", "the backend took too long")
        assert "Traceback" in caught.value.remote_traceback


async def test_cancelling_the_caller_cancels_the_handler(url: str) -> None:
    store = Store()
    async with serving(url, store) as server, tw.connect(server.addresses[0]) as client:
        task = asyncio.create_task(client.call("Store.sleep", 30, "cancel-me"))
        for _ in range(200):
            if server.metrics() and store.calls == 0 and task.done() is False:
                break
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if store.cancelled:
                break
            await asyncio.sleep(0.01)
        assert store.cancelled == ["cancel-me"]
        # The connection is fine afterwards.
        assert await client.call("Store.echo", 1) == 1


async def test_exceptions_arrive_with_type_message_and_traceback(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        store = client.proxy(Store)
        with pytest.raises(Internal) as info:
            await store.boom("missing")
        error = info.value
        assert error.type_name == "KeyError"
        assert "missing" in error.message
        assert "in boom" in error.remote_traceback
        with pytest.raises(NotFound, match="no key 'x'") as found:
            await store.get("x")
        assert found.value.type_name == "NotFound"
        assert await store.echo("still serving") == "still serving"


async def test_unknown_service_or_method(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        with pytest.raises(NotFound, match="no service 'Nope'"):
            await client.call("Nope.get")
        with pytest.raises(NotFound, match="has no method 'nope'"):
            await client.call("Store.nope")
        assert await client.call("Store.echo", 2) == 2


async def test_wrong_arguments(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        with pytest.raises(InvalidArgument, match=r"Store.put\(key: str, value"):
            await client.call("Store.put", "only-key")
        with pytest.raises(InvalidArgument, match="unexpected keyword"):
            await client.call("Store.get", "k", color="red")
        with pytest.raises(EncodeError):
            await client.call("Store.echo", object())
        assert await client.call("Store.echo", 3) == 3


class _Named(rpc.Service):
    """Methods whose remote names are long: the client writes a REQUEST's
    header with its method name into a buffer on the stack up to 232 bytes
    of name, and into one it allocates beyond."""

    @rpc.method(name="m" * 200)
    async def short(self, value: Any) -> Any:
        return value

    @rpc.method(name="n" * 5000)
    async def long(self, value: Any) -> Any:
        return ["long", value]


async def test_long_method_names_reach_their_methods(url: str) -> None:
    async with serving(url, _Named()) as server, tw.connect(server.addresses[0]) as client:
        assert await client.call("_Named." + "m" * 200, [1, 2]) == [1, 2]
        assert await client.call("_Named." + "n" * 5000, 3) == ["long", 3]
        # Beyond the REQUEST's 16-bit length field: refused before sending,
        # and the connection goes on.
        with pytest.raises(ProtocolError, match="65535"):
            await client.call("_Named." + "x" * 70_000, 1)
        assert await client.call("_Named." + "m" * 200, "still") == "still"


async def test_server_streaming_with_backpressure(url: str) -> None:
    store = Store()
    config = ClientConfig(stream_window=4)
    async with serving(url, store) as server, tw.connect(server.addresses[0],
                                                         config=config) as client:
        got = []
        async for item in client.proxy(Store).count(100):
            got.append(item)
            if item == 9:
                # Paused consumer: the producer may run ahead only by the window.
                await asyncio.sleep(0.3)
                assert store.produced <= 10 + 4 + 1
        assert got == list(range(100))


async def test_leaving_a_stream_early_cancels_it(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        async for item in client.proxy(Store).count(10_000):
            if item == 3:
                break
        assert await client.call("Store.echo", "ok") == "ok"


async def test_client_streaming_with_backpressure(url: str) -> None:
    sent = 0

    async def values() -> AsyncIterator[np.ndarray[Any, Any]]:
        nonlocal sent
        for i in range(40):
            sent += 1
            yield np.full(1000, i, dtype=np.float64)

    config = ServerConfig(stream_window=4)
    async with serving(url, config=config) as server, tw.connect(server.addresses[0]) as client:
        task = asyncio.create_task(client.call("Store.total", values(), delay=0.02))
        await asyncio.sleep(0.1)
        # The server consumes one item per 20 ms: the client is held back.
        assert sent <= 4 + 8
        assert await task == 1000 * sum(range(40))


async def test_bidirectional_streaming(url: str) -> None:
    async def values() -> AsyncIterator[np.ndarray[Any, Any]]:
        for i in range(20):
            yield np.full(3, i, dtype=np.float32)

    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        out = [x async for x in client.stream("Store.scale", 2.0, values())]
    assert [float(x[0]) for x in out] == [2.0 * i for i in range(20)]


async def test_wrong_or_missing_secret_is_unauthenticated(url: str) -> None:
    store = Store()
    config = ServerConfig(secret=b"correct horse battery")
    async with serving(url, store, config=config) as server:
        address = server.addresses[0]
        with pytest.raises(Unauthenticated):
            await tw.connect(address, secret=b"wrong secret!!")
        with pytest.raises(Unauthenticated):
            await tw.connect(address)
        assert store.calls == 0
        async with tw.connect(address, secret=b"correct horse battery") as client:
            await client.proxy(Store).put("k", 1)
        assert store.calls == 1


async def test_replayed_proof_does_not_authenticate() -> None:
    secret = b"correct horse battery"
    async with serving("tcp://127.0.0.1:0", config=ServerConfig(secret=secret)) as server:
        # Capture a real client's proof...
        conn = await transport_connect(server.addresses[0])
        shake = p.ClientHandshake(secret=secret)
        await conn.send(p.encode(shake.start()))
        proof = shake.receive(p.parse(await conn.recv()))
        assert isinstance(proof, p.Auth)
        await conn.close()
        # ...and replay it on a new connection: the server's fresh nonce
        # makes it worthless.
        conn = await transport_connect(server.addresses[0])
        await conn.send(p.encode(p.ClientHandshake(secret=None).start()))
        welcome = p.parse(await conn.recv())
        assert isinstance(welcome, p.Welcome)
        await conn.send(p.encode(proof))
        reply = p.parse(await conn.recv())
        assert isinstance(reply, p.Reject)
        assert reply.status == tw.errors.Status.UNAUTHENTICATED
        await conn.close()


async def test_version_mismatch_is_clear_on_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    async with serving("tcp://127.0.0.1:0") as server:
        conn = await transport_connect(server.addresses[0])
        await conn.send(p.encode(p.Hello(0, 99, b"n" * 16, "future client")))
        reply = p.parse(await conn.recv())
        assert isinstance(reply, p.Reject)
        assert "version 99" in reply.message
        await conn.close()
    assert any("version 99" in r.getMessage() for r in caplog.records)

    async def future_server(conn: Any) -> None:
        await conn.recv()
        await conn.send(p.encode(p.Welcome(0, 99, b"n" * 16, False, 10)))
        with contextlib.suppress(tw.errors.ConnectionClosedError):
            await conn.recv()

    async with await tw.transports.listen("tcp://127.0.0.1:0", future_server) as listener:
        with pytest.raises(ProtocolError, match="version 99"):
            await tw.connect(listener.address)


async def test_garbage_after_handshake_drops_only_that_connection() -> None:
    async with serving("tcp://127.0.0.1:0") as server:
        address = server.addresses[0]
        async with tw.connect(address) as good:
            conn = await transport_connect(address)
            await conn.send(p.encode(p.ClientHandshake(secret=None).start()))
            p.parse(await conn.recv())
            await conn.send([b"\xc1 not msgpack"])
            with pytest.raises(tw.errors.ConnectionClosedError):
                await asyncio.wait_for(conn.recv(), 10)
            # A request whose value does not decode gets InvalidArgument,
            # and the connection stays up.
            conn = await transport_connect(address)
            await conn.send(p.encode(p.ClientHandshake(secret=None).start()))
            p.parse(await conn.recv())
            await conn.send(p.encode(p.Request(1, "Store.echo", 5.0, -1, [b"garbage"])))
            reply = p.parse(await conn.recv())
            assert isinstance(reply, p.Error)
            assert reply.status == tw.errors.Status.INVALID_ARGUMENT
            await conn.send(p.encode(p.Ping(0)))
            assert isinstance(p.parse(await conn.recv()), p.Pong)
            await conn.close()
            assert await good.call("Store.echo", "fine") == "fine"


async def test_a_request_value_must_be_args_and_kwargs() -> None:
    encoder = tw.serde.Encoder()

    async def call(conn: Any, call_id: int, value: Any) -> p.Message:
        header, buffers = encoder.encode(value)
        await conn.send(p.encode(p.Request(call_id, "Store.echo", 5.0, -1, [header, *buffers])))
        return p.parse(await conn.recv())

    async with serving("tcp://127.0.0.1:0") as server:
        conn = await transport_connect(server.addresses[0])
        await conn.send(p.encode(p.ClientHandshake(secret=None).start()))
        p.parse(await conn.recv())
        wrong = [5, [["x"]], [["x"], {}, 1], ["x", {}], [["x"], ["k"]], [("x",), ("k",)]]
        for call_id, value in enumerate(wrong, 1):
            reply = await call(conn, call_id, value)
            assert isinstance(reply, p.Error), value
            assert reply.status == tw.errors.Status.INVALID_ARGUMENT
            assert "must be [args, kwargs]" in reply.message
        # Tuples in either place are taken as well as lists.
        decoder = tw.serde.Decoder()
        for call_id, value in enumerate([(["x"], {}), [("x",), {}], [[], {"value": "x"}]], 10):
            reply = await call(conn, call_id, value)
            assert isinstance(reply, p.Response), value
            assert decoder.decode(reply.value[0], reply.value[1:]) == "x"
        await conn.close()


async def test_per_connection_limit_queues_on_the_client(url: str) -> None:
    config = ServerConfig(max_concurrent_per_connection=2)
    async with serving(url, config=config) as server, tw.connect(server.addresses[0]) as client:
        results = await asyncio.gather(*(client.call("Store.sleep", 0.05, str(i))
                                         for i in range(8)))
    assert results == [str(i) for i in range(8)]


async def test_over_the_limit_without_queueing_is_resource_exhausted() -> None:
    config = ServerConfig(max_concurrent_per_connection=1)
    async with serving("tcp://127.0.0.1:0", config=config) as server:
        conn = await transport_connect(server.addresses[0])
        await conn.send(p.encode(p.ClientHandshake(secret=None).start()))
        welcome = p.parse(await conn.recv())
        assert isinstance(welcome, p.Welcome)
        assert welcome.max_concurrent == 1
        header, buffers = tw.serde.encode([[1.0, "a"], {}])
        for call_id in (1, 2):
            await conn.send(p.encode(p.Request(call_id, "Store.sleep", 5.0, -1,
                                               [header, *buffers])))
        reply = p.parse(await conn.recv())
        assert isinstance(reply, p.Error)
        assert reply.call_id == 2
        assert reply.status == ResourceExhausted.status
        await conn.close()


async def test_introspection_and_metrics(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        services = {s["name"]: s for s in await client.services()}
        methods = {m["name"]: m for m in services["Store"]["methods"]}
        assert services["Store"]["doc"] == "A key-value store of tensors."
        assert methods["put"]["signature"].startswith("(key: str, value")
        assert methods["put"]["doc"] == "Store ``value`` under ``key``."
        assert methods["get"]["idempotent"] is True
        assert methods["count"]["streaming"] is True
        store = client.proxy(Store)
        for _ in range(5):
            await store.put("k", np.ones(1000))
        with pytest.raises(NotFound):
            await store.get("absent")
        theirs, ours = server.metrics(), client.metrics()
    assert theirs["Store.put"]["calls"] == 5
    assert theirs["Store.put"]["bytes_in"] >= 5 * 8000
    assert theirs["Store.get"]["errors"] == 1
    assert ours["Store.put"]["calls"] == 5
    assert ours["Store.put"]["bytes_out"] >= 5 * 8000
    assert 0 < ours["Store.put"]["p50"] <= ours["Store.put"]["p99"]


async def test_both_ends_count_the_same_bytes(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        store = client.proxy(Store)
        await store.put("tensor", np.arange(100_000, dtype=np.float32))  # buffers out of band
        await store.put("small", 7)  # one frame
        await store.get("tensor")
        await store.get("small")
        theirs, ours = server.metrics(), client.metrics()
    for method in ("Store.put", "Store.get"):
        assert ours[method]["bytes_out"] == theirs[method]["bytes_in"]
        assert ours[method]["bytes_in"] == theirs[method]["bytes_out"]
    assert theirs["Store.put"]["bytes_in"] > 400_000
    assert ours["Store.get"]["bytes_in"] > 400_000


async def test_silent_server_is_detected_by_heartbeats() -> None:
    async def mute(conn: Any) -> None:
        shake = p.ServerHandshake(secret=None, max_concurrent=4)
        await conn.send(p.encode(shake.receive(p.parse(await conn.recv()))))
        await asyncio.sleep(30)  # never answers pings or calls

    config = ClientConfig(heartbeat_interval=0.1, heartbeat_timeout=0.5)
    listener = await tw.transports.listen("tcp://127.0.0.1:0", mute)
    async with listener, tw.connect(listener.address, config=config) as client:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(Unavailable, match="silent"):
            await client.call("Store.echo", 1)
        assert loop.time() - start < 3


async def test_graceful_close_finishes_calls_in_flight_and_refuses_new() -> None:
    server = tw.Server([Store()])
    (address,) = await server.start("tcp://127.0.0.1:0")
    async with tw.connect(address) as client:
        running = asyncio.create_task(client.call("Store.slow", 0.3))
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(server.close(grace=5))
        await asyncio.sleep(0.05)
        # Refused by the server on the open connection (not a lost one).
        with pytest.raises(Unavailable, match="the server is shutting down"):
            await client.call("Store.echo", 1)
        assert await running == "done"
        await closing


async def test_testing_helper_runs_services_in_process() -> None:
    async with testing.client_for(Store()) as client:
        store = client.proxy(Store)
        await store.put("w", np.ones(3))
        assert (await store.get("w")).sum() == 3


def test_remote_error_formats_readably() -> None:
    error = Internal("boom", type_name="KeyError", remote_traceback="Traceback...")
    assert str(error) == "[INTERNAL] boom (remote KeyError)"
    assert "".join(traceback.format_exception_only(error)).strip().endswith(
        "[INTERNAL] boom (remote KeyError)"
    )


async def test_rpc_over_tls() -> None:
    import ssl

    import trustme

    from tensorwire.transports import TransportConfig

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(client_ctx)
    server_config = ServerConfig(transport=TransportConfig(ssl_server=server_ctx))
    client_config = ClientConfig(transport=TransportConfig(ssl_client=client_ctx))
    async with serving("tcp://127.0.0.1:0", config=server_config) as server:
        client = await tw.connect(server.addresses[0], config=client_config)
        assert np.array_equal(await client.call("Store.echo", np.arange(5)), np.arange(5))
        await client.close()
        # A client without TLS cannot get through.
        with pytest.raises(Unavailable):
            await tw.connect(server.addresses[0], reconnect_attempts=1)


async def test_huge_exception_text_is_cut_and_the_connection_survives() -> None:
    async with serving("tcp://127.0.0.1:0") as server, tw.connect(server.addresses[0]) as client:
        bystander = asyncio.create_task(client.call("Store.slow", 0.3))
        with pytest.raises(Internal, match="characters cut") as info:
            await client.call("Store.boom", "k" * 100_000)
        assert len(info.value.message) <= p.MAX_ERROR_TEXT
        assert len(info.value.remote_traceback) <= p.MAX_ERROR_TEXT
        assert await bystander == "done"


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, float("inf")])
async def test_hostile_request_timeouts_are_refused(timeout: float) -> None:
    async with serving("tcp://127.0.0.1:0") as server:
        conn = await transport_connect(server.addresses[0])
        await conn.send(p.encode(p.ClientHandshake(secret=None).start()))
        p.parse(await conn.recv())
        header, buffers = tw.serde.encode([[1], {}])
        await conn.send(p.encode(p.Request(1, "Store.echo", timeout, -1, [header, *buffers])))
        with pytest.raises(tw.errors.ConnectionClosedError):
            await asyncio.wait_for(conn.recv(), 10)
        async with tw.connect(server.addresses[0]) as client:
            assert await client.call("Store.echo", 1, timeout=1) == 1


async def test_the_deadline_covers_connecting() -> None:
    async def silent(conn: Any) -> None:
        await asyncio.sleep(30)  # never answers the handshake

    listener = await tw.transports.listen("tcp://127.0.0.1:0", silent)
    async with listener:
        client = tw.connect(listener.address, connect_timeout=5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(DeadlineExceeded, match="could not connect"):
            await client.call("Store.echo", 1, timeout=0.3)
        assert loop.time() - start < 2
        await client.close()


async def test_a_cancelled_call_frees_its_server_slot_at_once() -> None:
    class Stubborn(rpc.Service):
        @rpc.method
        async def linger(self) -> None:
            try:
                await asyncio.sleep(30)
            finally:
                await asyncio.shield(asyncio.sleep(0.5))  # slow cleanup after cancel

        @rpc.method
        async def fast(self) -> str:
            return "ok"

    config = ServerConfig(max_concurrent_per_connection=2)
    server_cm = serving("tcp://127.0.0.1:0", Stubborn(), config=config)
    async with server_cm as server, tw.connect(server.addresses[0]) as client:
        for _ in range(2):
            with pytest.raises(DeadlineExceeded):
                await client.call("Stubborn.linger", timeout=0.1)
        assert await client.call("Stubborn.fast") == "ok"
        assert await client.call("Stubborn.fast") == "ok"


async def test_a_long_transfer_is_not_mistaken_for_silence() -> None:
    # The reply takes longer than the heartbeat timeout to arrive through small
    # socket buffers; bytes keep flowing, so the connection must survive.
    from tensorwire.transports import TransportConfig

    small = TransportConfig(socket_sndbuf=1 << 16, socket_rcvbuf=1 << 16)
    server_config = ServerConfig(transport=small, heartbeat_timeout=0.5)
    client_config = ClientConfig(transport=small, heartbeat_interval=0.1,
                                 heartbeat_timeout=0.3)
    store = Store()
    store.data["big"] = np.ones(512 << 20, np.uint8)
    async with serving("tcp://127.0.0.1:0", store, config=server_config) as server:
        client = await tw.connect(server.addresses[0], config=client_config)
        started = asyncio.get_running_loop().time()
        value = await client.call("Store.get", "big")
        took = asyncio.get_running_loop().time() - started
        await client.close()
    assert value.nbytes == 512 << 20
    if took < 0.3:
        pytest.skip(f"the transfer took only {took:.2f} s; nothing to prove here")


async def test_a_stream_deadline_never_cancels_the_consumers_own_code() -> None:
    async with serving("tcp://127.0.0.1:0") as server, tw.connect(server.addresses[0]) as client:
        task = asyncio.current_task()
        assert task is not None
        got: list[int] = []

        async def consume() -> None:
            async for item in client.stream("Store.count", 100, timeout=0.3):
                got.append(item)
                await asyncio.sleep(0.2)  # work between items: must not be cancelled

        with pytest.raises(DeadlineExceeded):
            await consume()
        assert task.cancelling() == 0
        assert 1 <= len(got) < 100


async def test_a_deadline_mid_send_does_not_break_other_calls(url: str) -> None:
    # A large request whose deadline passes while it is still being written
    # must not take the connection (and the calls sharing it) down with it.
    if url.startswith("inproc"):
        pytest.skip("an inproc:// send never waits")
    # The handler sleeps past the deadline too: a transport fast enough to
    # deliver 256 MiB before the client's deadline timer fires (UCX over
    # shared memory) still ends the call with DeadlineExceeded, then from
    # the server.
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        bystander = asyncio.create_task(client.call("Store.slow", 0.5))
        with pytest.raises(DeadlineExceeded):
            await client.call("Store.sleep", 10.0, np.ones(256 << 20, np.uint8), timeout=0.02)
        assert await bystander == "done"
        assert await client.call("Store.echo", "still connected") == "still connected"


_TAG: contextvars.ContextVar[str] = contextvars.ContextVar("tag", default="unset")


class Tagged(rpc.Service):
    """Handlers without an await run inline; they still get a context each."""

    @rpc.method
    async def set_tag(self, tag: str) -> str:
        _TAG.set(tag)
        return _TAG.get()

    @rpc.method
    async def tag(self) -> str:
        return _TAG.get()

    @rpc.method
    async def cancels_itself(self) -> None:
        raise asyncio.CancelledError


async def test_inline_handlers_do_not_share_context_variables(url: str) -> None:
    async with serving(url, Tagged()) as server, tw.connect(server.addresses[0]) as client:
        assert await client.call("Tagged.set_tag", "mine") == "mine"
        assert await client.call("Tagged.tag") == "unset"
        with pytest.raises(DeadlineExceeded):
            await client.call("Tagged.cancels_itself", timeout=0.2)
        # The connection and the server are fine after it.
        assert await client.call("Tagged.tag") == "unset"
        assert server.metrics()["Tagged.tag"]["calls"] == 2


async def test_deadlines_of_calls_in_flight_expire_each_in_time(url: str) -> None:
    async with serving(url) as server, tw.connect(server.addresses[0]) as client:
        loop = asyncio.get_running_loop()
        started = loop.time()
        long = asyncio.create_task(client.call("Store.sleep", 0.3, "long", timeout=5))
        await asyncio.sleep(0)
        short = asyncio.create_task(client.call("Store.sleep", 5, "short", timeout=0.1))
        with pytest.raises(DeadlineExceeded):
            await short
        assert loop.time() - started < 0.3  # not held up by the earlier, later deadline
        assert await long == "long"
        for _ in range(300):
            await client.call("Store.echo", 1)
        # Deadlines of finished calls do not pile up.
        session = client._session
        assert session is not None
        assert len(session.calls.deadlines) + len(session.calls.in_order) <= 64 + 2


_SMALL = TransportConfig(limits=Limits(max_message_bytes=1 << 20))


async def test_a_request_beyond_the_server_limit_is_resource_exhausted(url: str) -> None:
    config = ServerConfig(transport=_SMALL)
    async with serving(url, config=config) as server, tw.connect(server.addresses[0]) as client:
        store = client.proxy(Store)
        await store.put("small", np.ones(1000, np.uint8))
        peers = set(server.transport_stats())
        with pytest.raises(ResourceExhausted, match="1048576"):
            await store.put("big", np.ones(2 << 20, np.uint8))
        # The same connection goes on (a reconnect would show a new peer).
        assert await store.echo("after") == "after"
        assert set(server.transport_stats()) == peers
        with pytest.raises(ResourceExhausted, match="1048576"):
            await client.call("Store.total", _items([np.ones(4, np.float32),
                                                      np.ones(1 << 19, np.float32)]))
        assert await store.echo("still") == "still"
        assert set(server.transport_stats()) == peers
    assert server.metrics()["Store.put"]["errors"] == 1


async def test_an_oversized_request_right_behind_the_hello_fails_only_itself(url: str) -> None:
    # The server's transport parses bytes as they arrive, also while the
    # handshake is answered: the request is skipped then and fails once the
    # session starts.
    config = ServerConfig(transport=_SMALL)
    async with serving(url, config=config) as server:
        conn = await transport_connect(server.addresses[0])
        header, buffers = tw.serde.encode([["big", np.ones(2 << 20, np.uint8)], {}])
        await conn.send_many([p.encode(p.ClientHandshake(secret=None).start()),
                              p.encode(p.Request(1, "Store.put", 5.0, -1, [header, *buffers]))])
        assert isinstance(p.parse(await conn.recv()), p.Welcome)
        reply = p.parse(await asyncio.wait_for(conn.recv(), 10))
        assert isinstance(reply, p.Error)
        assert (reply.call_id, reply.status) == (1, ResourceExhausted.status)
        await conn.send(p.encode(p.Ping(0)))
        assert isinstance(p.parse(await asyncio.wait_for(conn.recv(), 10)), p.Pong)
        await conn.close()


async def test_an_oversized_hello_ends_the_connection_at_once(url: str) -> None:
    config = ServerConfig(transport=_SMALL, heartbeat_timeout=60)
    async with serving(url, config=config) as server:
        conn = await transport_connect(server.addresses[0])
        await conn.send([np.zeros(2 << 20, np.uint8)])
        with pytest.raises(tw.errors.ConnectionClosedError):
            await asyncio.wait_for(conn.recv(), 10)  # well before the handshake's 60 s
        async with tw.connect(server.addresses[0]) as client:
            assert await client.call("Store.echo", "fine") == "fine"


async def test_a_reply_beyond_the_client_limit_is_resource_exhausted(url: str) -> None:
    async with (
        serving(url) as server,
        tw.connect(server.addresses[0], transport=_SMALL) as client,
    ):
        store = client.proxy(Store)
        await store.put("big", np.ones(2 << 20, np.uint8))
        with pytest.raises(ResourceExhausted, match="1048576"):
            await store.get("big")
        assert await store.echo("after") == "after"
        assert len(server.transport_stats()) == 1
        assert client.transport_stats()[server.addresses[0]]["messages_received"] >= 4


async def test_a_stream_item_beyond_the_client_limit_ends_the_stream_in_order(
        url: str) -> None:
    async with (
        serving(url) as server,
        tw.connect(server.addresses[0], transport=_SMALL) as client,
    ):
        values = [np.full(4, 1.0, np.float32), np.full(4, 2.0, np.float32),
                  np.ones(1 << 19, np.float32), np.full(4, 4.0, np.float32)]
        stream = client.stream("Store.scale", 1.0, _items(values))
        got = [float((await anext(stream))[0])]
        # The rest arrive while the consumer is behind: the items before the
        # refused one still come, then the error, never what follows.
        await asyncio.sleep(0.5)
        got.append(float((await anext(stream))[0]))
        with pytest.raises(ResourceExhausted, match="1048576"):
            await anext(stream)
        assert got == [1.0, 2.0]
        assert await client.call("Store.echo", "after") == "after"
        assert len(server.transport_stats()) == 1


async def _items(values: list[Any]) -> AsyncIterator[Any]:
    for value in values:
        yield value
