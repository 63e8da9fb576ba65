"""bench/rpc.py's ceilings: what any RPC on this host is measured against.

- a bare asyncio ``Protocol`` echo with write coalescing (tcp://'s ceiling
  for tiny calls): fixed 16-byte records (call id, value), each call a
  future that the client's ``data_received`` resolves; on both sides every
  record queued in one loop iteration leaves in one ``write`` (as the
  compiled core gathers its output), no encoding, deadlines, metrics or
  dispatch (uvloop);
- a bare blocking-socket echo (tcp://'s ceiling for large tensors): an
  8-byte length, then the bytes, received with ``recv_into`` into a
  preallocated NumPy buffer and sent back with ``sendall``;
- raw ucxx in its blocking progress mode (ucx://'s ceiling): ucxx's asyncio
  API after ``ucxx.init(progress_mode="blocking")``, tag send/recv into
  preallocated NumPy buffers, as bench/gpu.py measures it on a GPU.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import threading
from typing import Any

import numpy as np
from _rpc_variants import FLOOR_RECORD, TINY, TINY_BYTES, Variant, _Caller, _wait_stop

#: The bare socket's and raw ucxx's message header: the payload's length.
_LENGTH = struct.Struct("<Q")
#: raw ucxx: the header tag carries tiny calls (an 8-byte value echoed back)
#: and announcements of a tensor (_ANNOUNCE | length) that comes on _DATA.
_HEAD, _DATA, _BACK = 1, 2, 3
_ANNOUNCE = 1 << 63


def _receive_buffer(backs: dict[int, np.ndarray[Any, Any]], nbytes: int) -> np.ndarray[Any, Any]:
    """The one receive buffer kept for ``nbytes`` (a raw user keeps one per size)."""
    back = backs.get(nbytes)
    if back is None:
        backs.clear()
        back = backs[nbytes] = np.empty(nbytes, np.uint8)
    return back


# -- the coalescing asyncio Protocol echo ----------------------------------------


class _Coalescing(asyncio.Protocol):
    """Queues writes and sends all of one loop iteration's in one write."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.out = bytearray()
        self.rest = b""
        self.loop = asyncio.get_running_loop()

    def queue(self, data: bytes) -> None:
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out += data

    def _flush(self) -> None:
        self.transport.write(bytes(self.out))
        self.out.clear()

    def records(self, data: bytes) -> memoryview:
        """The whole records of what arrived, keeping a partial one for later."""
        data = self.rest + data
        whole = len(data) - len(data) % FLOOR_RECORD.size
        self.rest = data[whole:]
        return memoryview(data)[:whole]


class _FloorEcho(_Coalescing):
    """Echoes every whole record it has."""

    def data_received(self, data: bytes) -> None:
        records = self.records(data)
        if records:
            self.queue(bytes(records))


class _FloorProtocol(_Coalescing):
    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future[int]] = {}
        self.ids = 0

    def data_received(self, data: bytes) -> None:
        pending = self.pending
        for call_id, value in FLOOR_RECORD.iter_unpack(self.records(data)):
            pending.pop(call_id).set_result(value)


async def floor_server(ready: Any, stop: Any, variant: Variant) -> None:
    server = await asyncio.get_running_loop().create_server(_FloorEcho, "127.0.0.1", 0)
    ready.put(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    await _wait_stop(stop)
    server.close()


class _FloorCaller(_Caller):
    async def open(self, address: str) -> _FloorCaller:
        host, port = address.rsplit(":", 1)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_connection(_FloorProtocol, host, int(port))
        self.transport = transport

        async def tiny() -> Any:
            protocol.ids += 1
            call_id = protocol.ids
            future = loop.create_future()
            protocol.pending[call_id] = future
            protocol.queue(FLOOR_RECORD.pack(call_id, TINY))
            return await future

        async def tensor(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            raise NotImplementedError("the bare Protocol echo carries tiny records only")

        self.tiny = tiny
        self.tensor = tensor
        return self

    async def close(self) -> None:
        self.transport.close()


# -- the bare blocking-socket echo ------------------------------------------------


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the peer closed first."""
    while view:
        n = sock.recv_into(view)
        if n == 0:
            return False
        view = view[n:]
    return True


def _socket_echo(sock: socket.socket) -> None:
    """Serve one connection: receive each message whole, then send it back."""
    head = bytearray(_LENGTH.size)
    buffer = np.empty(0, np.uint8)  # the receive buffer, kept while the size repeats
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while _recv_into(sock, memoryview(head)):
            (size,) = _LENGTH.unpack(head)
            if buffer.nbytes != size:
                buffer = np.empty(size, np.uint8)
            if not _recv_into(sock, memoryview(buffer)):
                return
            sock.sendall(buffer)


async def socket_server(ready: Any, stop: Any, variant: Variant) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(f"127.0.0.1:{listener.getsockname()[1]}")

    def serve() -> None:
        with listener:
            sock, _ = listener.accept()
            _socket_echo(sock)

    threading.Thread(target=serve, daemon=True).start()
    await _wait_stop(stop)


class _SocketCaller(_Caller):
    """Blocking calls straight from the coroutine: nothing else runs on its loop."""

    async def open(self, address: str) -> _SocketCaller:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        tiny_message = _LENGTH.pack(len(TINY_BYTES)) + TINY_BYTES
        tiny_back = memoryview(bytearray(len(TINY_BYTES)))
        backs: dict[int, np.ndarray[Any, Any]] = {}  # one receive buffer per size

        async def tiny() -> Any:
            sock.sendall(tiny_message)
            if not _recv_into(sock, tiny_back):
                raise ConnectionError("the bare socket echo closed")
            return tiny_back

        async def tensor(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            back = _receive_buffer(backs, arr.nbytes)
            sock.sendall(_LENGTH.pack(arr.nbytes))
            sock.sendall(arr)
            if not _recv_into(sock, memoryview(back)):
                raise ConnectionError("the bare socket echo closed")
            return back.view(arr.dtype).reshape(arr.shape)

        self.tiny = tiny
        self.tensor = tensor
        return self

    async def close(self) -> None:
        self.sock.close()


# -- raw ucxx, blocking progress mode ---------------------------------------------


def _import_ucxx() -> Any:
    """ucxx, under the UCX settings tensorwire's default ``UCXOptions()`` applies,
    so that the two differ by their code alone."""
    from tensorwire.transports import UCXOptions

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.update(UCXOptions().ucx_environment())
    import ucxx

    ucxx.init(progress_mode="blocking")
    return ucxx


async def _ucxx_endpoint(ucxx: Any, reader: Any, writer: Any) -> Any:
    """An endpoint to the peer at the other end of a TCP side channel."""
    ours = bytes(ucxx.get_worker_address())
    writer.write(_LENGTH.pack(len(ours)) + ours)
    await writer.drain()
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    theirs = await reader.readexactly(size)
    address = ucxx.get_ucx_address_from_buffer(theirs)
    return await ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)


async def ucxx_server(ready: Any, stop: Any, variant: Variant) -> None:
    ucxx = _import_ucxx()

    async def serve(reader: Any, writer: Any) -> None:
        ep = await _ucxx_endpoint(ucxx, reader, writer)
        head = np.empty(_LENGTH.size, np.uint8)
        buffer = np.empty(0, np.uint8)
        while True:
            await ep.recv(head, tag=_HEAD, force_tag=True)
            (value,) = _LENGTH.unpack(head.tobytes())
            if value == 0:
                break
            if not value & _ANNOUNCE:
                await ep.send(head, tag=_BACK, force_tag=True)  # a tiny call
                continue
            size = value & ~_ANNOUNCE
            if buffer.nbytes != size:
                buffer = np.empty(size, np.uint8)
            await ep.recv(buffer, tag=_DATA, force_tag=True)
            await ep.send(buffer, tag=_BACK, force_tag=True)
        await ep.close()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    ready.put(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    await _wait_stop(stop)
    server.close()


class _UCXXCaller(_Caller):
    async def open(self, address: str) -> _UCXXCaller:
        ucxx = _import_ucxx()
        host, port = address.rsplit(":", 1)
        reader, self.writer = await asyncio.open_connection(host, int(port))
        ep = self.ep = await _ucxx_endpoint(ucxx, reader, self.writer)
        tiny_out = np.frombuffer(TINY_BYTES, np.uint8).copy()
        tiny_back = np.empty(len(TINY_BYTES), np.uint8)
        backs: dict[int, np.ndarray[Any, Any]] = {}  # one receive buffer per size

        async def tiny() -> Any:
            await ep.send(tiny_out, tag=_HEAD, force_tag=True)
            await ep.recv(tiny_back, tag=_BACK, force_tag=True)
            return tiny_back

        async def tensor(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
            back = _receive_buffer(backs, arr.nbytes)
            announce = np.frombuffer(_LENGTH.pack(_ANNOUNCE | arr.nbytes), np.uint8).copy()
            await ep.send(announce, tag=_HEAD, force_tag=True)
            await ep.send(arr.view(np.uint8).reshape(-1), tag=_DATA, force_tag=True)
            await ep.recv(back, tag=_BACK, force_tag=True)
            return back.view(arr.dtype).reshape(arr.shape)

        self.tiny = tiny
        self.tensor = tensor
        return self

    async def close(self) -> None:
        await self.ep.send(np.zeros(_LENGTH.size, np.uint8), tag=_HEAD, force_tag=True)
        await self.ep.close()
        self.writer.close()


#: The ceilings' servers and callers by variant kind.
SERVERS = {"floor": floor_server, "socket": socket_server, "ucxx": ucxx_server}
CALLERS: dict[str, type[_Caller]] = {
    "floor": _FloorCaller, "socket": _SocketCaller, "ucxx": _UCXXCaller,
}
