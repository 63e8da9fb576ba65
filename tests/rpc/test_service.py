"""Service declarations, without a server."""

from __future__ import annotations

import asyncio
import inspect
import itertools
from typing import Any

import pytest

from tensorwire import rpc
from tensorwire.errors import ConfigError
from tensorwire.rpc.service import (
    argument_checker,
    cannot_suspend,
    describe,
    positional_arity,
    signature_text,
)


def plain(a: int, b: str, c: float = 1.0, d: Any = None) -> None: ...


def varargs(a: int, *rest: Any, key: str = "", **extra: Any) -> None: ...


ARGS: list[tuple[Any, ...]] = [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), (1, 2, 3, 4, 5)]
KWARGS: list[dict[str, Any]] = [{}, {"a": 0}, {"b": 0}, {"c": 0}, {"d": 0, "b": 0},
                                {"e": 0}, {"key": 0}, {"a": 0, "b": 0}]


@pytest.mark.parametrize("func", [plain, varargs])
def test_argument_checker_agrees_with_signature_bind(func: Any) -> None:
    signature = inspect.signature(func)
    check = argument_checker(signature)
    for args, kwargs in itertools.product(ARGS, KWARGS):
        try:
            signature.bind(*args, **kwargs)
            expected = None
        except TypeError as exc:
            expected = str(exc)
        try:
            check(args, kwargs)
            got = None
        except TypeError as exc:
            got = str(exc)
        assert got == expected, (args, kwargs)


def keyword_only(a: int, *, b: int) -> None: ...


@pytest.mark.parametrize(("func", "arity"), [(plain, 4), (varargs, -1), (keyword_only, -1),
                                              (lambda: None, 0)])
def test_positional_arity_counts_only_plain_signatures(func: Any, arity: int) -> None:
    # The server skips the argument check for exactly this many positional
    # arguments, so every such call must bind.
    signature = inspect.signature(func)
    assert positional_arity(signature) == arity
    if arity >= 0:
        signature.bind(*range(arity))


def test_methods_are_described_with_readable_signatures() -> None:
    class Svc(rpc.Service):
        @rpc.method
        async def put(self, key: str, value: Any) -> None:
            """Put it."""

        @rpc.method(name="fetch", idempotent=True)
        async def get(self, key: str) -> Any: ...

        @rpc.method
        async def scan(self, prefix: str) -> Any:
            yield prefix

        async def not_remote(self) -> None: ...

    methods = describe(Svc)
    assert sorted(methods) == ["fetch", "put", "scan"]
    attr, info = methods["fetch"]
    assert attr == "get"
    assert info.idempotent
    assert not info.streaming
    assert methods["scan"][1].streaming
    assert signature_text(methods["put"][1].signature) == "(key: str, value: Any) -> None"
    assert methods["put"][1].doc == "Put it."


def test_sync_functions_cannot_be_remote_methods() -> None:
    with pytest.raises(ConfigError, match="async def"):

        class Bad(rpc.Service):
            @rpc.method
            def get(self) -> None: ...


def test_two_methods_with_one_remote_name_are_refused() -> None:
    class Clash(rpc.Service):
        @rpc.method(name="x")
        async def a(self) -> None: ...

        @rpc.method(name="x")
        async def b(self) -> None: ...

    with pytest.raises(ConfigError, match="both have the remote name 'x'"):
        describe(Clash)


class _Kinds:
    async def plain(self, x: int) -> int:
        return x + 1

    async def awaits(self) -> None:
        await asyncio.sleep(0)

    async def uses_async_with(self, lock: asyncio.Lock) -> None:
        async with lock:
            pass

    async def uses_async_for(self, items: Any) -> None:
        async for _ in items:
            pass

    async def awaits_in_a_comprehension(self, items: Any) -> list[Any]:
        return [await item for item in items]

    def not_a_coroutine(self) -> None:
        return None


@pytest.mark.parametrize(
    ("name", "at_once"),
    [("plain", True), ("awaits", False), ("uses_async_with", False),
     ("uses_async_for", False), ("awaits_in_a_comprehension", False),
     ("not_a_coroutine", False)],
)
def test_only_handlers_that_cannot_suspend_run_at_once(name: str, at_once: bool) -> None:
    assert cannot_suspend(getattr(_Kinds(), name)) is at_once
