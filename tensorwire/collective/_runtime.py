"""The per-process side of a group: rendezvous, data connections, failure news.

Rank 0 hosts the :class:`Coordinator` RPC service at the master address.
Every rank joins it, learns the others' addresses, and keeps a streaming
``watch`` call open: when a rank's call ends without a ``leave`` (the process
died, or its link did), the coordinator tells every other rank, so their
operations fail at once with that rank named instead of waiting out a
deadline. A rank that sees an operation fail (a mismatch, a timeout) reports
it the same way.

Every rank also listens for data connections on its own address (tcp:// or
ucx://) and hosts a :class:`Member` service that reports where it stands,
which is how a timed-out operation names the ranks that had not reached it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack

from .. import rpc, transports
from ..errors import (
    AlreadyExists,
    ConfigError,
    InvalidArgument,
    ProtocolError,
    TensorwireError,
    Unavailable,
)
from ..transports import Connection, format_host_port, parse_host_port
from .config import GroupConfig

__all__ = ("Coordinator", "Member", "RendezvousServer", "Runtime", "serve_rendezvous")

logger = logging.getLogger(__name__)

HELLO_MAGIC = "tensorwire.collective"
HELLO_VERSION = 1
#: The watch stream lives as long as the group; its deadline is "never".
_FOREVER = 10.0**8


class Coordinator(rpc.Service):
    """Rank 0's rendezvous: who is in the group, and who has failed."""

    service_name = "tensorwire.collective.Coordinator"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._members: dict[int, dict[str, Any]] = {}
        self._complete = asyncio.Event()
        self._watchers: dict[int, asyncio.Queue[dict[str, Any]]] = {}
        self._gone: set[int] = set()
        self._all_gone = asyncio.Event()

    @rpc.method
    async def join(
        self, rank: int, world_size: int, member: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Register ``rank``; returns every rank's addresses once all have joined."""
        if world_size != self.world_size:
            raise InvalidArgument(
                f"rank {rank} was started with world size {world_size}, "
                f"rank 0 with {self.world_size}"
            )
        if not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} is outside the world of {world_size}")
        if rank in self._members:
            raise AlreadyExists(
                f"rank {rank} has joined already (from {self._members[rank].get('host')}); "
                "two processes were given the same rank"
            )
        self._members[rank] = member
        if len(self._members) == self.world_size:
            self._complete.set()
        try:
            await self._complete.wait()
        except asyncio.CancelledError:
            if not self._complete.is_set():
                del self._members[rank]
            raise
        return [self._members[r] for r in range(self.world_size)]

    @rpc.method
    async def watch(self, rank: int) -> AsyncIterator[dict[str, Any]]:
        """Stream news of failures to ``rank`` until it leaves."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._watchers[rank] = queue
        try:
            yield {"kind": "ready"}
            while True:
                yield await queue.get()
        finally:
            if self._watchers.get(rank) is queue:
                del self._watchers[rank]
            if rank not in self._gone:
                logger.warning("rank %d is gone without leaving the group", rank)
                self.publish({"kind": "failed", "rank": rank})
                self._mark_gone(rank)

    @rpc.method
    async def leave(self, rank: int) -> None:
        """``rank`` is closing the group on purpose."""
        self._mark_gone(rank)

    @rpc.method
    async def report(self, event: dict[str, Any]) -> None:
        """Pass an operation's failure on to every other rank."""
        self.publish(event)

    def publish(self, event: dict[str, Any]) -> None:
        for rank, queue in self._watchers.items():
            if rank != event.get("rank"):
                queue.put_nowait(event)

    def _mark_gone(self, rank: int) -> None:
        self._gone.add(rank)
        if len(self._gone) >= self.world_size:
            self._all_gone.set()

    async def wait_all_gone(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_gone.wait(), timeout)


class RendezvousServer(rpc.Server):
    """An RPC server hosting a group's :class:`Coordinator`."""

    def __init__(self, coordinator: Coordinator, config: GroupConfig) -> None:
        super().__init__([coordinator], config=rpc.ServerConfig(
            heartbeat_timeout=config.heartbeat_timeout, transport=config.transport))
        self.coordinator = coordinator


async def serve_rendezvous(url: str, world_size: int, *,
                           config: GroupConfig | None = None) -> tuple[RendezvousServer, str]:
    """Serve a group's rendezvous on ``url`` (``tcp://host:0`` takes a free
    port); returns the server and its real address.

    A rank silent for ``config.heartbeat_timeout`` is reported dead to the
    others; give it the same config as the ranks.

    Rank 0 does this itself unless the group is told its master is hosted
    elsewhere: by a launcher, or by a test that needs to know the port
    before the ranks start.

    Raises:
        ConfigError: ``url`` is not ``tcp://host:port`` or the size is not positive.
        TransportError: the address cannot be bound.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
    scheme, _, rest = url.partition("://")
    if scheme != "tcp":
        raise ConfigError(f"the rendezvous address must be tcp://host:port, got {url!r}")
    parse_host_port(rest, "tcp")
    server = RendezvousServer(Coordinator(world_size), config or GroupConfig())
    (address,) = await server.start(url)
    return server, address


class Member(rpc.Service):
    """Every rank's answer to "where are you?"."""

    service_name = "tensorwire.collective.Member"

    def __init__(self, status: Callable[[str], dict[str, Any]]) -> None:
        self._status = status

    @rpc.method(idempotent=True)
    async def status(self, group: str) -> dict[str, Any]:
        """The operation ``group`` last started on this rank, and whether it finished."""
        return self._status(group)


def advertised_host(listen_host: str, master_host: str) -> str:
    """The address other ranks can reach us at when we listen on ``listen_host``.

    A wildcard listen address is replaced by the local address of the
    interface that routes to the master (no packet is sent: a UDP socket's
    ``connect`` only picks the route).
    """
    if listen_host not in ("", "0.0.0.0", "::"):
        return listen_host.strip("[]")
    family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, 9))
            host: str = probe.getsockname()[0]
            return host
    except OSError:
        return socket.gethostname()


def _address_host(url: str) -> str:
    """The host part of a data address (``tcp://10.0.0.2:4000`` -> ``10.0.0.2``)."""
    scheme, _, rest = url.partition("://")
    try:
        return parse_host_port(rest, scheme)[0]
    except (ConfigError, ValueError):
        return rest


class Runtime:
    """The process's membership in a root group and all its subgroups."""

    def __init__(self, rank: int, world_size: int, config: GroupConfig) -> None:
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.members: list[dict[str, Any]] = []
        self.coordinator: Coordinator | None = None
        self._server: rpc.Server | None = None
        self._master: RendezvousServer | None = None
        self._listener: transports.Listener | None = None
        self._client: rpc.Client | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._watching = asyncio.Event()
        self._incoming: dict[tuple[str, int, str], asyncio.Future[Connection]] = {}
        self._status: dict[str, Callable[[], dict[str, Any]]] = {}
        self._on_event: Callable[[dict[str, Any]], None] = lambda event: None
        self._reports: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self, master: str, listen: str, host_master: bool,
                    on_event: Callable[[dict[str, Any]], None]) -> None:
        """Listen, join the group at ``master`` (serving it there first when
        ``host_master``), and watch for failures.

        Raises:
            TensorwireError: the master cannot be reached, a rank is taken,
                the world sizes disagree, or the rendezvous timed out.
        """
        self._on_event = on_event
        master_host, _ = parse_host_port(master.partition("://")[2], "tcp")
        scheme, _, rest = listen.partition("://")
        listen_host = parse_host_port(rest, scheme)[0]
        # May resolve a host name: not on the event loop.
        host = await asyncio.to_thread(advertised_host, listen_host, master_host)
        self._listener = await transports.listen(listen, self._accept,
                                                 config=self.config.transport)
        data_address = self._listener.address
        if listen_host in ("0.0.0.0", "::"):
            port = parse_host_port(data_address.partition("://")[2], scheme)[1]
            data_address = format_host_port(scheme, host, port)
        if host_master:
            self._master, master = await serve_rendezvous(master, self.world_size,
                                                          config=self.config)
            self.coordinator = self._master.coordinator
        self._server = rpc.Server([Member(self._member_status)])
        await self._server.start(format_host_port("tcp", host, 0))
        control = self._server.addresses[0]
        self._client = await self._reach(master)
        info = {"data": data_address, "control": control, "host": socket.gethostname(),
                "pid": os.getpid()}
        self.members = await self._client.call(
            "tensorwire.collective.Coordinator.join", self.rank, self.world_size, info,
            timeout=self.config.rendezvous_timeout,
        )
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        await asyncio.wait_for(self._watching.wait(), self.config.rendezvous_timeout)

    async def _reach(self, master: str) -> rpc.Client:
        """Connect to rank 0, which may not be listening yet: retry until the
        rendezvous deadline, backing off from 50 ms to 1 s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.rendezvous_timeout
        pause = 0.05
        while True:
            try:
                return await rpc.connect(master, config=self.config.client_config())
            except Unavailable as exc:
                if loop.time() + pause > deadline:
                    raise Unavailable(
                        f"rank 0's rendezvous at {master} did not answer within "
                        f"{self.config.rendezvous_timeout} s: {exc}"
                    ) from exc
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _watch(self) -> None:
        assert self._client is not None
        try:
            async for event in self._client.stream(
                "tensorwire.collective.Coordinator.watch", self.rank, timeout=_FOREVER
            ):
                if event.get("kind") == "ready":
                    self._watching.set()
                else:
                    self._on_event(event)
        except asyncio.CancelledError:
            raise
        except TensorwireError as exc:
            if not self._closing:
                logger.warning("lost the connection to rank 0: %s", exc)
                self._on_event({"kind": "failed", "rank": 0,
                                "reason": f"lost the connection to rank 0 ({exc})"})
        if not self._closing and self.rank != 0:
            self._on_event({"kind": "failed", "rank": 0,
                            "reason": "rank 0 ended the group's watch stream"})

    def report(self, event: dict[str, Any]) -> None:
        """Tell the other ranks, through rank 0, that an operation failed."""
        if self._client is None or self._closing:
            return
        client = self._client

        async def send() -> None:
            with contextlib.suppress(TensorwireError):
                await client.call("tensorwire.collective.Coordinator.report", event, timeout=5)

        task = asyncio.get_running_loop().create_task(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def flush(self) -> None:
        """Wait (briefly) until the failures reported so far have reached rank 0."""
        if self._reports:
            await asyncio.wait(self._reports, timeout=5)

    # -- group status -------------------------------------------------------

    def track(self, group: str, status: Callable[[], dict[str, Any]]) -> None:
        self._status[group] = status

    def _member_status(self, group: str) -> dict[str, Any]:
        status = self._status.get(group)
        if status is None:
            return {"seq": -1, "op": "", "done": True}
        return status()

    async def peer_status(self, rank: int, group: str, timeout: float) -> dict[str, Any] | None:
        """Rank ``rank``'s answer to :meth:`Member.status`; ``None`` when it cannot answer."""
        address = self.members[rank]["control"]
        config = rpc.ClientConfig(timeout=timeout, connect_timeout=timeout,
                                  reconnect_attempts=1, transport=self.config.transport)
        try:
            async with rpc.connect(address, config=config) as client:
                status: dict[str, Any] = await client.call(
                    "tensorwire.collective.Member.status", group)
                return status
        except TensorwireError:
            return None

    # -- data connections ---------------------------------------------------

    async def _accept(self, conn: Connection) -> None:
        try:
            frames = await asyncio.wait_for(conn.recv(), self.config.transport.handshake_timeout)
            hello = msgpack.unpackb(bytes(frames[0]))
            magic, version, group, rank, channel = hello
            if magic != HELLO_MAGIC or version != HELLO_VERSION or len(frames) != 1:
                raise ProtocolError(f"not a tensorwire collective hello: {hello!r:.80}")
            key = (str(group), int(rank), str(channel))
        except (TimeoutError, TensorwireError, ValueError, TypeError) as exc:
            logger.warning("refusing data connection from %s: %s", conn.peer_address, exc)
            conn.abort()
            return
        future = self._incoming_future(key)
        if future.done():
            logger.warning("refusing a second %s connection from rank %d for group %s",
                           key[2], key[1], key[0])
            conn.abort()
            return
        future.set_result(conn)

    def _incoming_future(self, key: tuple[str, int, str]) -> asyncio.Future[Connection]:
        future = self._incoming.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._incoming[key] = future
        return future

    async def incoming(self, group: str, rank: int, channel: str) -> Connection:
        """The connection rank ``rank`` opens to us for ``group``'s ``channel``."""
        key = (group, rank, channel)
        conn = await asyncio.shield(self._incoming_future(key))
        del self._incoming[key]
        return conn

    async def dial(self, rank: int, group: str, channel: str) -> Connection:
        """Open ``channel`` of ``group`` to rank ``rank``.

        Raises:
            TransportError: the rank cannot be reached.
        """
        conn = await transports.connect(self.members[rank]["data"], config=self.config.transport)
        try:
            await conn.send([msgpack.packb([HELLO_MAGIC, HELLO_VERSION, group, self.rank,
                                            channel])])
        except BaseException:
            conn.abort()
            raise
        return conn

    def hosts(self) -> list[str]:
        """Each rank's host.

        ``GroupConfig.topology`` when given; else the host name each rank
        reported, told apart by the address it listens on: ranks that share
        a host name but advertise different addresses (cloned machines, all
        called ``localhost``) are on different hosts. A machine whose ranks
        listen on different interfaces then counts as several hosts, which
        only costs the hierarchy, never a wrong result.
        """
        if self.config.topology is not None:
            out = [""] * self.world_size
            for name, ranks in self.config.topology.items():
                for rank in ranks:
                    out[rank] = str(name)
            return out
        names = [str(member["host"]) for member in self.members]
        addresses = [_address_host(str(member["data"])) for member in self.members]
        seen: dict[str, set[str]] = {}
        for name, address in zip(names, addresses, strict=True):
            seen.setdefault(name, set()).add(address)
        return [name if len(seen[name]) == 1 else f"{name}@{address}"
                for name, address in zip(names, addresses, strict=True)]

    async def close(self) -> None:
        """Leave the group (rank 0 waits for the others first) and stop listening."""
        if self._closing:
            return
        self._closing = True
        client = self._client
        if client is not None:
            with contextlib.suppress(TensorwireError):
                await client.call("tensorwire.collective.Coordinator.leave", self.rank, timeout=5)
        if self.coordinator is not None:
            await self.coordinator.wait_all_gone(self.config.rendezvous_timeout)
        if self._watch_task is not None:
            self._watch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch_task
        if client is not None:
            await client.close()
        for future in self._incoming.values():
            if future.done() and not future.cancelled():
                future.result().abort()
            else:
                future.cancel()
        if self._listener is not None:
            await self._listener.close()
        if self._server is not None:
            await self._server.close(grace=1.0)
        if self._master is not None:
            await self._master.close(grace=1.0)
