"""Services: classes whose ``@rpc.method`` methods can be called remotely."""

from __future__ import annotations

import dataclasses
import dis
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

from ..errors import ConfigError

__all__ = ("MethodInfo", "Service", "describe", "method")

F = TypeVar("F", bound=Callable[..., Any])

_ATTR = "__tensorwire_method__"


@dataclasses.dataclass(frozen=True, slots=True)
class MethodInfo:
    """What the server knows of a remote method.

    Attributes:
        name: the method's remote name (the Python name unless renamed).
        streaming: True for async generators (the server streams results).
        idempotent: safe to run twice; the client retries it once after a
            reconnect.
        signature: the Python signature, for binding and introspection.
        doc: the docstring.
    """

    name: str
    streaming: bool
    idempotent: bool
    signature: inspect.Signature
    doc: str


@overload
def method(func: F, /) -> F: ...


@overload
def method(*, name: str | None = None, idempotent: bool = False) -> Callable[[F], F]: ...


def method(
    func: F | None = None, /, *, name: str | None = None, idempotent: bool = False
) -> F | Callable[[F], F]:
    """Mark an ``async def`` (unary) or async generator (streaming) method as remote.

    ``@rpc.method`` or ``@rpc.method(idempotent=True, name="...")``. A
    parameter may receive an async iterator: the caller passes an async
    iterable there and its items stream to the server.

    The server runs each call in a task of its own, except a unary method
    whose body has no ``await``, ``async with`` or ``async for``: that one
    cannot be suspended, deadlined or cancelled half-way, so it runs at
    once where its request is read, in a copy of the context, without a
    task (``asyncio.current_task()`` there is not the call's own).

    Raises:
        ConfigError: the function is neither a coroutine function nor an
            async generator function.
    """

    def mark(f: F) -> F:
        streaming = inspect.isasyncgenfunction(f)
        if not streaming and not inspect.iscoroutinefunction(f):
            raise ConfigError(
                f"@rpc.method needs an async def or async generator, got {f.__qualname__}"
            )
        signature = inspect.signature(f)
        params = list(signature.parameters.values())[1:]  # drop self
        info = MethodInfo(
            name=name or f.__name__,
            streaming=streaming,
            idempotent=idempotent,
            signature=signature.replace(parameters=params),
            doc=inspect.getdoc(f) or "",
        )
        setattr(f, _ATTR, info)
        return f

    if func is not None:
        return mark(func)
    return mark


class Service:
    """Base class of services. The service's remote name is the class name,
    or the class attribute ``service_name`` when set.

    Example::

        class Store(rpc.Service):
            @rpc.method
            async def get(self, key: str) -> np.ndarray: ...
    """

    service_name: str | None = None


class _Text:
    """An annotation shown as written (``from __future__ import annotations``
    leaves strings, which inspect would show quoted)."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


def signature_text(signature: inspect.Signature) -> str:
    """``signature`` as source would spell it: ``(key: str, value) -> None``."""

    def unquote(annotation: Any) -> Any:
        return _Text(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=unquote(p.annotation)) for p in signature.parameters.values()]
    return str(signature.replace(parameters=params,
                                 return_annotation=unquote(signature.return_annotation)))


ArgumentChecker = Callable[[Sequence[Any], Mapping[str, Any]], None]


def positional_arity(signature: inspect.Signature) -> int:
    """How many arguments a call gives by position, and no others, when it
    fits ``signature`` (named parameters only, none left to its default);
    -1 for a signature with ``*args``, ``**kwargs`` or keyword-only or
    positional-only parameters. The server checks this first, in C, on every
    call (``_dispatch.Method.check``)."""
    params = signature.parameters.values()
    if any(p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params):
        return -1
    return len(params)


def cannot_suspend(func: Callable[..., Any]) -> bool:
    """True for a coroutine function whose body has no ``await``, ``async
    with`` or ``async for`` (every suspension point compiles to
    YIELD_VALUE): its coroutine runs to its end in one step. The server
    runs such a unary handler at once, with no task (``_dispatch``): code
    that awaits may need one before it suspends (``asyncio.timeout``,
    ``TaskGroup``), so nothing else can run that way."""
    code = getattr(func, "__code__", None)
    if code is None or not code.co_flags & inspect.CO_COROUTINE:
        return False
    return not any(ins.opname == "YIELD_VALUE" for ins in dis.get_instructions(code))


def argument_checker(signature: inspect.Signature) -> ArgumentChecker:
    """A function that raises TypeError when arguments do not fit ``signature``.

    For the common signature (named parameters, no ``*args``/``**kwargs``)
    it checks counts and names directly, several times faster than
    ``Signature.bind``, which every call would otherwise pay.
    """
    params = list(signature.parameters.values())
    if positional_arity(signature) < 0:

        def bind(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            signature.bind(*args, **kwargs)

        return bind
    names = [p.name for p in params]
    required = [p.default is inspect.Parameter.empty for p in params]
    count = len(names)

    def check(args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        given = len(args)
        if given == count and not kwargs:
            return  # every parameter given by position: the usual call
        if given > count or (given + len(kwargs) < count and not all(
            not required[i] or names[i] in kwargs for i in range(given, count)
        )):
            signature.bind(*args, **kwargs)  # raises with Python's own message
        for key in kwargs:
            if key not in names or names.index(key) < given:
                signature.bind(*args, **kwargs)

    return check


def service_name(cls: type) -> str:
    """The remote name of a service class."""
    name = getattr(cls, "service_name", None)
    return name if isinstance(name, str) and name else cls.__name__


def describe(cls: type) -> dict[str, tuple[str, MethodInfo]]:
    """The remote methods of a service class: remote name -> (attribute, info).

    Raises:
        ConfigError: two methods claim the same remote name.
    """
    methods: dict[str, tuple[str, MethodInfo]] = {}
    for attr in dir(cls):
        info = getattr(getattr(cls, attr, None), _ATTR, None)
        if not isinstance(info, MethodInfo):
            continue
        if info.name in methods:
            raise ConfigError(
                f"{cls.__name__}: methods {methods[info.name][0]!r} and {attr!r} "
                f"both have the remote name {info.name!r}"
            )
        methods[info.name] = (attr, info)
    return methods
