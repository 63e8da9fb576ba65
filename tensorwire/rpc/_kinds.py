"""The RPC message kinds (docs/protocol.md, "RPC messages"): the first byte
of a binary header, the first item of a msgpack one. ``protocol`` exports
them; they live here so that the compiled message classes of ``_wire``,
which ``protocol`` imports, can name their kind."""

import enum


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    AUTH = 3
    AUTH_OK = 4
    REJECT = 5
    REQUEST = 10
    RESPONSE = 11
    ERROR = 12
    CANCEL = 13
    ITEM = 14
    END = 15
    CREDIT = 16
    PING = 20
    PONG = 21
