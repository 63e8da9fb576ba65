"""Typed stand-ins for service classes, for the async and the blocking client."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from .service import describe, service_name

__all__ = ("Proxy",)


class _Caller(Protocol):
    def _call(self, method: str, timeout: float | None, idempotent: bool, /,
              *args: Any, **kwargs: Any) -> Any:
        """``call`` with its options by position."""

    def stream(self, method: str, /, *args: Any, timeout: float | None = None,
               **kwargs: Any) -> Any: ...


class Proxy:
    """Stands in for a service class: each remote method becomes a call on
    ``client`` (``Client`` gives awaitables, ``SyncClient`` blocking calls)."""

    def __init__(self, client: _Caller, cls: type, timeout: float | None) -> None:
        self._client = client
        self._name = service_name(cls)
        self._methods = {attr: info for _, (attr, info) in describe(cls).items()}
        self._timeout = timeout

    def __getattr__(self, attr: str) -> Callable[..., Any]:
        info = self._methods.get(attr)
        if info is None:
            raise AttributeError(f"{self._name} has no remote method {attr!r}")
        full = f"{self._name}.{info.name}"
        client, timeout, idempotent = self._client, self._timeout, info.idempotent
        remote: Callable[..., Any]
        if info.streaming:
            stream = client.stream

            def remote(*args: Any, **kwargs: Any) -> Any:
                return stream(full, *args, timeout=timeout, **kwargs)
        else:
            # No Python frame between the caller and the client's call.
            remote = functools.partial(client._call, full, timeout, idempotent)

        remote.__name__ = attr
        remote.__doc__ = info.doc
        # Cached on the instance: later lookups skip __getattr__.
        self.__dict__[attr] = remote
        return remote

    def __repr__(self) -> str:
        return f"<proxy {self._name}>"
