"""A client that holds a shared secret refuses a server that cannot prove it.

The fake server is written here, as an attacker would write one: it speaks
the wire protocol, answers the client's HELLO with a WELCOME that asks for no
authentication, and answers whatever request comes with a result of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import pytest

import tensorwire as tw
from tensorwire import serde
from tensorwire.errors import ConnectionClosedError, Unauthenticated
from tensorwire.rpc import protocol as p

SECRET = b"correct horse battery"


async def test_a_client_with_a_secret_refuses_a_server_that_asks_for_no_proof() -> None:
    received: list[p.Message] = []

    async def impostor(conn: Any) -> None:
        # HELLO, answered with auth=false: "no secret needed here".
        received.append(p.parse(await conn.recv()))
        await conn.send(p.encode(p.Welcome(0, p.RPC_VERSION, os.urandom(16), False, 64)))
        with contextlib.suppress(ConnectionClosedError):
            while True:
                message = p.parse(await conn.recv())
                received.append(message)
                if isinstance(message, p.Request):
                    header, _ = serde.encode("forged")
                    reply = p.Response(message.call_id, [header])
                    await conn.send(p.encode(reply))

    async with await tw.transports.listen("tcp://127.0.0.1:0", impostor) as listener:
        client = tw.connect(listener.address, secret=SECRET, reconnect_attempts=1)
        with pytest.raises(Unauthenticated, match="did not prove"):
            await asyncio.wait_for(client.call("Vault.open", b"my arguments"), 10)
        await client.close()
        await asyncio.sleep(0.05)  # the impostor reads what (if anything) followed
    # The impostor learnt the client's name and nonce, nothing more.
    assert [type(m) for m in received] == [p.Hello], received

