"""``tensorwire serve``, ``ls`` and ``call``: their options and what they do.

The secret and the TLS settings come from files or the environment, never
from the command line alone (a command line is visible to every user of
the host in ``ps``). Arguments of ``call`` are JSON: positional, as
``NAME=JSON`` or as one ``--kwargs`` object; ``@`` in an argument's place
streams JSON lines from standard input, as grpcurl's ``-d @`` does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib
import json
import os
import re
import ssl
import stat
import sys
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from .errors import ConfigError

__all__ = ("add_client_options", "add_server_options", "call", "load", "ls",
           "serve_services")

_KEYWORD = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)
#: An argument that stands for a stream of JSON lines from standard input.
STDIN = "@"


def _add_secret_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--secret-file", type=Path, metavar="FILE",
                       help="the shared secret, read from FILE (one trailing newline is "
                            "dropped)")
    group.add_argument("--secret-env", metavar="VAR",
                       help="the shared secret, read from the environment variable VAR")


def add_client_options(parser: argparse.ArgumentParser) -> None:
    """The secret and TLS options of a command that connects (``call``, ``ls``)."""
    _add_secret_options(parser)
    parser.add_argument("--tls", action="store_true",
                        help="connect with TLS, checking the server against the system's CAs")
    parser.add_argument("--tls-ca", type=Path, metavar="FILE",
                        help="connect with TLS, trusting the CA certificates in FILE (PEM)")
    parser.add_argument("--tls-cert", type=Path, metavar="FILE",
                        help="TLS: present this client certificate (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE",
                        help="TLS: the client certificate's private key (default: in "
                             "--tls-cert's file)")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="TLS: the name the server certificate must carry (default: "
                             "the URL's host)")


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The secret and TLS options of ``serve``."""
    _add_secret_options(parser)
    parser.add_argument("--tls-cert", type=Path, metavar="FILE",
                        help="serve tcp:// with TLS, with this certificate chain (PEM)")
    parser.add_argument("--tls-key", type=Path, metavar="FILE",
                        help="TLS: the certificate's private key (default: in --tls-cert's "
                             "file)")
    parser.add_argument("--tls-ca", type=Path, metavar="FILE",
                        help="TLS: require client certificates signed by the CAs in FILE")


def _secret(args: argparse.Namespace) -> bytes | None:
    if args.secret_file is not None:
        try:
            data: bytes = args.secret_file.read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read --secret-file {args.secret_file}: "
                              f"{exc.strerror}") from None
        # `echo secret > file` leaves a newline that is no part of the secret.
        return data.removesuffix(b"\n").removesuffix(b"\r")
    if args.secret_env is not None:
        value = os.environ.get(args.secret_env)
        if value is None:
            raise ConfigError(f"--secret-env: the environment variable {args.secret_env} "
                              "is not set")
        return os.fsencode(value)
    return None


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path | None) -> None:
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the certificate {cert}"
                          f"{f' with the key {key}' if key else ''}: {exc}") from None


def _load_ca(context: ssl.SSLContext, ca: Path) -> None:
    try:
        context.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the CA certificates {ca}: {exc}") from None


def _client_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not (args.tls or args.tls_ca or args.tls_cert):
        if args.tls_key or args.tls_server_name:
            raise ConfigError("--tls-key and --tls-server-name need TLS: add --tls or "
                              "--tls-ca")
        return None
    if not args.address.startswith("tcp://"):
        raise ConfigError(f"TLS is for tcp:// addresses, not {args.address}")
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if args.tls_ca is not None:
        _load_ca(context, args.tls_ca)
    if args.tls_cert is not None:
        _load_chain(context, args.tls_cert, args.tls_key)
    elif args.tls_key is not None:
        raise ConfigError("--tls-key needs --tls-cert")
    return context


def _server_tls(args: argparse.Namespace, listen: list[str]) -> ssl.SSLContext | None:
    if args.tls_cert is None:
        if args.tls_key or args.tls_ca:
            raise ConfigError("--tls-key and --tls-ca need --tls-cert, the server's "
                              "certificate")
        return None
    if not all(url.startswith("tcp://") for url in listen):
        raise ConfigError("TLS is for tcp:// addresses; --listen gave "
                          + ", ".join(u for u in listen if not u.startswith("tcp://")))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_chain(context, args.tls_cert, args.tls_key)
    if args.tls_ca is not None:
        _load_ca(context, args.tls_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_config(args: argparse.Namespace, timeout: float | None = None) -> Any:
    """A ``ClientConfig`` from the command's options."""
    from .rpc import ClientConfig
    from .transports import TransportConfig

    transport = TransportConfig(ssl_client=_client_tls(args),
                                ssl_server_hostname=args.tls_server_name)
    options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    return ClientConfig(secret=_secret(args), transport=transport, **options)


# -- serve -------------------------------------------------------------------


def load(spec: str) -> Any:
    """``module:Class`` -> an instance, importing from the working directory too.

    Raises:
        ConfigError: the spec is malformed, the module cannot be imported (or
            runs an event loop while it is imported), the class is missing or
            cannot be made with no arguments.
    """
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"expected MODULE:CLASS, got {spec!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    problem = None
    # A module that runs asyncio.run(main()) when imported leaves main()'s
    # coroutine unawaited: the warning about it says nothing the error below
    # does not.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            problem = f"cannot import {module_name!r}: {exc}"
        except RuntimeError as exc:
            if "running event loop" not in str(exc):
                problem = f"importing {module_name!r} failed: RuntimeError: {exc}"
            else:
                problem = (f"importing {module_name!r} ran its program ({exc}): put "
                           "the program's start under `if __name__ == \"__main__\":`, so that "
                           "serve can import the module")
        except (Exception, SystemExit) as exc:
            problem = f"importing {module_name!r} failed: {type(exc).__name__}: {exc}"
        if problem is not None:
            gc.collect()  # the unawaited coroutine goes while the warning is ignored
            raise ConfigError(problem)
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no {class_name!r}") from None
    try:
        return cls()
    except Exception as exc:
        raise ConfigError(f"cannot make {spec} with no arguments: {type(exc).__name__}: "
                          f"{exc}") from exc


async def serve_services(args: argparse.Namespace,
                         until_stopped: Callable[[], Awaitable[None]]) -> int:
    """Host the classes of ``args.services`` until ``until_stopped()`` returns."""
    from .rpc import Server, ServerConfig
    from .transports import TransportConfig

    listen = list(args.listen or ["tcp://127.0.0.1:0"])
    config = ServerConfig(secret=_secret(args),
                          transport=TransportConfig(ssl_server=_server_tls(args, listen)))
    server = Server([load(spec) for spec in args.services], config=config)
    for address in await server.start(*listen):
        print(f"listening on {address}", flush=True)
    await until_stopped()
    # Calls in flight get the server's shutdown grace; new ones are refused.
    await server.close()
    return 0


# -- ls ----------------------------------------------------------------------


async def ls(args: argparse.Namespace) -> int:
    """Print the services and methods a server hosts."""
    from .rpc import connect

    async with connect(args.address, config=client_config(args)) as client:
        services = await client.services()
    for service in services:
        print(service["name"] + (f"  -- {service['doc'].splitlines()[0]}"
                                 if service["doc"] else ""))
        for method in service["methods"]:
            kind = " (stream)" if method["streaming"] else ""
            doc = f"  -- {method['doc'].splitlines()[0]}" if method["doc"] else ""
            print(f"  {method['name']}{method['signature']}{kind}{doc}")
    return 0


# -- call --------------------------------------------------------------------


def _json(text: str, what: str) -> Any:
    if text == STDIN:
        return _StdinStream()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} must be JSON ({exc}); quote strings: '\"text\"'") from None


def parse_arguments(texts: list[str], kwargs_json: str | None
                    ) -> tuple[list[Any], dict[str, Any]]:
    """Positional JSON, ``NAME=JSON`` and a ``--kwargs`` object -> (args, kwargs).

    Raises:
        ConfigError: a value that is not JSON, a positional argument after a
            keyword one, a name given twice, or more than one ``@``.
    """
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if kwargs_json is not None:
        given = None if kwargs_json == STDIN else _json(kwargs_json, "--kwargs")
        if not isinstance(given, dict):
            raise ConfigError("--kwargs must be a JSON object, e.g. '{\"key\": \"w\"}'")
        kwargs.update(given)
    keyword_seen = False
    for text in texts:
        keyword = _KEYWORD.match(text)
        if keyword is not None:
            keyword_seen = True
            name, value = keyword.groups()
            if name in kwargs:
                raise ConfigError(f"the argument {name!r} is given twice")
            if value == STDIN:
                # The protocol streams one positional argument (rpc.md).
                raise ConfigError(f"{text}: a stream from standard input goes in a "
                                  "positional place: give @ alone")
            kwargs[name] = _json(value, f"the value of {name}=")
        elif keyword_seen:
            raise ConfigError(f"positional argument {text!r} after a keyword argument")
        else:
            args.append(_json(text, "arguments"))
    if sum(isinstance(v, _StdinStream) for v in [*args, *kwargs.values()]) > 1:
        raise ConfigError("standard input can feed one argument: give @ once")
    return args, kwargs


class _StdinStream:
    """JSON lines from standard input, one item per line; blank lines skip."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    async def _items(self) -> AsyncIterator[Any]:
        number = 0
        async for line in _stdin_lines():
            number += 1
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"standard input, line {number}: not JSON ({exc})") from None


async def _stdin_lines() -> AsyncIterator[str]:
    fd = sys.stdin.fileno()
    if stat.S_ISREG(os.fstat(fd).st_mode):
        # A file never blocks, and the event loop cannot watch one.
        for line in sys.stdin:
            yield line
        return
    # A pipe or terminal, read without blocking the loop (a thread blocked
    # in read() would hold the command open after the call ended).
    reader = asyncio.StreamReader()
    # The pipe transport makes the descriptor non-blocking, and a duplicate
    # shares that with the shell's terminal: set it back when done.
    blocking = os.get_blocking(fd)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(os.dup(fd), "rb"))
    try:
        while line := await reader.readline():
            yield line.decode()
    finally:
        transport.close()
        os.set_blocking(fd, blocking)


def _jsonable(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.size <= 64:
            return value.tolist()
        return {"array": str(value.dtype), "shape": list(value.shape),
                "first": value.ravel()[:8].tolist()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes | bytearray | memoryview):
        return {"bytes": len(value)}
    return repr(value)


async def _is_stream(client: Any, method: str) -> bool:
    """Whether the server says ``method`` is a streaming one (an unknown
    method is called as unary, to get the server's own NOT_FOUND)."""
    service, _, name = method.rpartition(".")
    for found in await client.services():
        if found["name"] == service:
            return any(m["name"] == name and m["streaming"] for m in found["methods"])
    return False


async def call(args: argparse.Namespace) -> int:
    """Call a method; print a unary result as JSON, a stream's items as JSON lines."""
    from .rpc import connect

    values, kwargs = parse_arguments(args.args, args.kwargs)
    config = client_config(args, timeout=args.timeout)
    async with connect(args.address, config=config) as client:
        if await _is_stream(client, args.method):
            # An async generator: closed on the way out, which cancels the
            # call when the loop ends early (a reader that went away).
            items = cast(AsyncGenerator[Any, None], client.stream(
                args.method, *values, timeout=args.timeout, **kwargs))
            async with contextlib.aclosing(items):
                async for item in items:
                    print(json.dumps(item, default=_jsonable), flush=True)
        else:
            result = await client.call(args.method, *values, timeout=args.timeout, **kwargs)
            print(json.dumps(result, default=_jsonable, indent=2), flush=True)
    return 0
