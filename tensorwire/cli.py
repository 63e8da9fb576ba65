"""The ``tensorwire`` command.

::

    tensorwire info [--json]                      # versions, transports, UCX devices, GPUs
    tensorwire serve app:Store --listen tcp://0.0.0.0:7000
    tensorwire ls tcp://host:7000                 # services and methods
    tensorwire call tcp://host:7000 Store.get '"w"'
    tensorwire launch -n 4 train.py --epochs 3    # local ranks, torchrun-style
    tensorwire ps serve --listen tcp://0.0.0.0:7000 --checkpoint-dir /ckpt/shard0
    tensorwire demo

This is an entry point: it may read the environment (``TENSORWIRE_LOG``) and
print; the library does neither. Errors are one line with a hint;
``--verbose`` adds the traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import runpy
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import (
    ConfigError,
    ConnectionClosedError,
    NotFound,
    RemoteError,
    TensorwireError,
    TransportError,
    Unavailable,
    UnsupportedTransportError,
)

__all__ = ("main",)

DEMO = Path(__file__).resolve().parents[1] / "examples" / "ps_train.py"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorwire", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default=os.environ.get("TENSORWIRE_LOG", "WARNING"),
                        help="logging level (DEBUG, INFO, WARNING, ...; default: "
                             "$TENSORWIRE_LOG or WARNING)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the traceback of an error, not only its line")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="versions, usable transports, UCX devices, GPUs")
    info.add_argument("--json", action="store_true", help="as JSON, for machines")

    serve_services = commands.add_parser("serve", help="host service classes (module:Class)")
    serve_services.add_argument("services", nargs="+", metavar="MODULE:CLASS",
                                help="classes to host, each made with no arguments")
    serve_services.add_argument("--listen", action="append", metavar="URL",
                                help="address to listen on (repeatable; default "
                                     "tcp://127.0.0.1:0)")

    call = commands.add_parser("call", help="call a method with JSON arguments, print the "
                                            "result as JSON")
    call.add_argument("address", metavar="URL")
    call.add_argument("method", metavar="SERVICE.METHOD")
    call.add_argument("args", nargs="*", metavar="JSON", help='e.g. \'"key"\' 3 \'[1, 2]\'')
    call.add_argument("--timeout", type=float, default=30.0, help="seconds (default 30)")

    ls = commands.add_parser("ls", help="list a server's services and methods")
    ls.add_argument("address", metavar="URL")

    bench = commands.add_parser("bench", help="size sweeps: transport, RPC, allreduce, "
                                              "parameter server")
    bench.add_argument("what", choices=["p2p", "rpc", "allreduce", "ps"])
    bench.add_argument("--sizes", help="bytes, e.g. 8,1K,4M (default 8 B to 64 MiB)")
    bench.add_argument("--listen", action="append", metavar="URL",
                       help="transport to measure (repeatable; default tcp:// and, where "
                            "usable, ucx:// on loopback)")
    bench.add_argument("--connect", metavar="URL",
                       help="p2p/rpc: measure against a peer another host serves; ps: the "
                            "shards, comma-separated")
    bench.add_argument("--serve", action="store_true",
                       help="p2p/rpc: be the peer (on the one --listen address)")
    bench.add_argument("-n", "--nproc", type=int, default=2, help="allreduce: local ranks")
    output = bench.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true")
    output.add_argument("--csv", action="store_true")
    bench.add_argument("--plot", metavar="PNG", help="draw bandwidth and latency to this file")
    bench.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)

    launch = commands.add_parser("launch", help="run N local ranks of a program with the "
                                                "environment Group.from_env() reads")
    launch.add_argument("-n", "--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc",
                        type=int, required=True, help="how many ranks (torchrun's spelling too)")
    launch.add_argument("--listen", metavar="URL",
                        help="the ranks' data transport (default tcp://0.0.0.0:0)")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="start every rank again after a failure, up to N times "
                             "(the ranks read TENSORWIRE_RESTART_COUNT)")
    launch.add_argument("program", help="a .py file (run with this Python) or a command")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="the program's arguments")

    ps = commands.add_parser("ps", help="parameter server")
    ps_commands = ps.add_subparsers(dest="ps_command", required=True)
    serve = ps_commands.add_parser("serve", help="run one parameter-server shard")
    serve.add_argument("--listen", action="append", required=True, metavar="URL",
                       help="address to listen on (repeatable), e.g. tcp://0.0.0.0:7000")
    serve.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                       help="write checkpoints here and restore the newest at start")
    serve.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                       help="checkpoint periodically")
    serve.add_argument("--checkpoint-every", type=int, metavar="UPDATES",
                       help="checkpoint after this many applied pushes")
    serve.add_argument("--keep", type=int, default=2, help="checkpoint files to keep")

    commands.add_parser("demo", help="train a classifier through the parameter server "
                                     "(2 shards, 3 worker processes); other options go to "
                                     "examples/ps_train.py (tensorwire demo --help-demo)")
    return parser


async def _until_stopped() -> None:
    """Wait for SIGINT or SIGTERM: a server's way to end cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


async def _serve(args: argparse.Namespace) -> None:
    from . import ps

    config = ps.ShardConfig(checkpoint_dir=args.checkpoint_dir,
                            checkpoint_interval=args.checkpoint_interval,
                            checkpoint_every=args.checkpoint_every,
                            keep_checkpoints=args.keep)
    shard = await ps.serve(*args.listen, config=config)
    restored = shard.shard.restored_from
    if restored is not None:
        print(f"restored {restored}", flush=True)
    for address in shard.addresses:
        print(f"listening on {address}", flush=True)
    await _until_stopped()
    await shard.close()


def _info(args: argparse.Namespace) -> int:
    from ._info import format_text, gather

    info = gather()
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def _load(spec: str) -> Any:
    """``module:Class`` -> an instance, importing from the working directory too."""
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"expected MODULE:CLASS, got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r}: {exc}") from exc
    try:
        cls = getattr(module, class_name)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no {class_name!r}") from None
    return cls()


async def _serve_services(args: argparse.Namespace) -> int:
    from .rpc import Server

    server = Server([_load(spec) for spec in args.services])
    for address in await server.start(*(args.listen or ["tcp://127.0.0.1:0"])):
        print(f"listening on {address}", flush=True)
    await _until_stopped()
    # Calls in flight get the server's shutdown grace; new ones are refused.
    await server.close()
    return 0


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


async def _call(args: argparse.Namespace) -> int:
    from .rpc import connect

    try:
        values = [json.loads(text) for text in args.args]
    except json.JSONDecodeError as exc:
        raise ConfigError(f"arguments must be JSON ({exc}); quote strings: '\"text\"'") from None
    async with connect(args.address, timeout=args.timeout) as client:
        result = await client.call(args.method, *values, timeout=args.timeout)
    print(json.dumps(result, default=_jsonable, indent=2))
    return 0


async def _ls(args: argparse.Namespace) -> int:
    from .rpc import connect

    async with connect(args.address) as client:
        services = await client.services()
    for service in services:
        print(service["name"] + (f"  -- {service['doc'].splitlines()[0]}"
                                 if service["doc"] else ""))
        for method in service["methods"]:
            kind = " (stream)" if method["streaming"] else ""
            doc = f"  -- {method['doc'].splitlines()[0]}" if method["doc"] else ""
            print(f"  {method['name']}{method['signature']}{kind}{doc}")
    return 0


def _bench_urls(args: argparse.Namespace) -> list[str]:
    if args.listen:
        return list(args.listen)
    import importlib.util

    urls = ["tcp://127.0.0.1:0"]
    if importlib.util.find_spec("ucxx") is not None:
        urls.append("ucx://127.0.0.1:0")
    return urls


def _bench(args: argparse.Namespace) -> int:
    from . import _bench

    try:
        sizes = _bench.parse_sizes(args.sizes) if args.sizes else _bench.DEFAULT_SIZES
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if args.what == "allreduce" and (args.as_rank or "RANK" in os.environ
                                      or "SLURM_PROCID" in os.environ
                                      or "OMPI_COMM_WORLD_RANK" in os.environ):
        return asyncio.run(_bench_rank(args, sizes))
    if args.serve:
        if args.what in ("allreduce", "ps"):
            raise ConfigError("--serve is for p2p and rpc; allreduce ranks run under a "
                              "launcher, shards under tensorwire ps serve")
        serve = _bench.serve_p2p if args.what == "p2p" else _bench.serve_rpc
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(serve(_bench_urls(args)[0],
                              lambda address: print(f"listening on {address}", flush=True)))
        return 0
    series: dict[str, list[_bench.Row]] = {}
    if args.connect:
        series[args.connect] = asyncio.run(_bench_sweep(args.what, args.connect, sizes))
    else:
        for url in _bench_urls(args):
            scheme = url.partition("://")[0]
            series[f"{scheme}://"] = _bench_local(args, url, sizes)
    for name, rows in series.items():
        if args.json:
            print(_bench.format_json(rows))
        elif args.csv:
            print(_bench.format_csv(rows), end="")
        else:
            extra = f", {args.nproc} ranks" if args.what == "allreduce" else ""
            print(f"# {args.what} over {name}{extra}")
            print(_bench.format_table(rows))
    if args.plot:
        try:
            _bench.plot(series, args.plot)
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


async def _bench_sweep(what: str, address: str, sizes: list[int]) -> list[Any]:
    from . import _bench

    progress = _bench.Progress(len(sizes))
    if what == "ps":
        return await _bench.sweep_ps(address.split(","), sizes, progress)
    sweep = _bench.sweep_p2p if what == "p2p" else _bench.sweep_rpc
    return await sweep(address, sizes, progress)


def _bench_local(args: argparse.Namespace, url: str, sizes: list[int]) -> list[Any]:
    """Run the sweep against peers started here."""
    import io
    import subprocess
    import threading

    from . import _bench

    sizes_arg = ",".join(str(s) for s in sizes)
    if args.what == "allreduce":
        from .collective import launch

        out = io.StringIO()
        result = asyncio.run(launch(
            [sys.executable, "-m", "tensorwire", "bench", "allreduce", "--as-rank", "--json",
             "--sizes", sizes_arg], args.nproc, listen=url, output=out))
        if result.exit_code != 0:
            raise TensorwireError(f"the allreduce ranks failed:\n{out.getvalue()[-2000:]}")
        found = [x for x in out.getvalue().splitlines() if x.startswith("[rank 0] [")]
        if len(found) != 1:
            raise TensorwireError(f"rank 0 printed no results:\n{out.getvalue()[-2000:]}")
        return [_bench.Row(**r) for r in json.loads(found[0].removeprefix("[rank 0] "))]
    serve = (["ps", "serve"] if args.what == "ps" else ["bench", args.what, "--serve"])
    peer = subprocess.Popen([sys.executable, "-m", "tensorwire", *serve, "--listen", url],
                            stdout=subprocess.PIPE, text=True)
    # A peer that hangs before saying where it listens is killed, which ends
    # the readline below.
    watchdog = threading.Timer(60, peer.kill)
    watchdog.start()
    try:
        assert peer.stdout is not None
        line = peer.stdout.readline()
        watchdog.cancel()
        if not line.startswith("listening on "):
            raise TensorwireError(f"the {args.what} peer on {url} did not start")
        return asyncio.run(_bench_sweep(args.what, line.split()[-1], sizes))
    finally:
        watchdog.cancel()
        peer.terminate()
        try:
            peer.wait(30)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
        if peer.stdout is not None:
            peer.stdout.close()


async def _bench_rank(args: argparse.Namespace, sizes: list[int]) -> int:
    from . import _bench
    from .collective import Group

    group = await Group.from_env()
    try:
        progress = _bench.Progress(len(sizes))
        progress.enabled = progress.enabled and group.rank == 0
        rows = await _bench.sweep_allreduce(group, sizes, progress)
    finally:
        await group.close()
    if group.rank == 0:
        print(json.dumps([dataclasses.asdict(r) for r in rows]) if args.json
              else _bench.format_table(rows), flush=True)
    return 0


def _launch(args: argparse.Namespace) -> int:
    from .collective import launch

    argv = [sys.executable, args.program] if args.program.endswith(".py") else [args.program]
    result = asyncio.run(launch([*argv, *args.args], args.nproc, listen=args.listen,
                                max_restarts=args.max_restarts))
    return result.exit_code


def _hint(exc: BaseException, args: argparse.Namespace) -> str:
    address = getattr(args, "address", None)
    if isinstance(exc, UnsupportedTransportError):
        return "for ucx:// install the UCX bindings: pip install ucxx-cu12"
    if isinstance(exc, Unavailable | ConnectionClosedError):
        where = f" at {address}" if address else ""
        return f"is a tensorwire server running{where}? check the host and port"
    if isinstance(exc, NotFound) and "service" in str(exc):
        return "tensorwire ls URL lists what the server hosts"
    text = str(exc).lower()
    if isinstance(exc, TransportError) and ("in use" in text or "cannot listen" in text
                                            or "bind" in text):
        return "the port is in use or the address is not this host's; try port 0"
    if isinstance(exc, RemoteError) and exc.remote_traceback:
        return "the remote traceback follows with --verbose"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.getLevelName(args.log_level.upper())
    if not isinstance(level, int):
        parser.error(f"unknown log level {args.log_level!r} (DEBUG, INFO, WARNING, ERROR)")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, extra)
    except KeyboardInterrupt:
        return 130
    except TensorwireError as exc:
        if args.verbose:
            traceback.print_exc()
            if isinstance(exc, RemoteError) and exc.remote_traceback:
                print(exc.remote_traceback, file=sys.stderr)
        hint = _hint(exc, args)
        print(f"tensorwire: error: {exc}" + (f"\n  hint: {hint}" if hint else ""),
              file=sys.stderr)
        return 1


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    if args.command == "info":
        return _info(args)
    if args.command == "serve":
        return asyncio.run(_serve_services(args))
    if args.command == "call":
        return asyncio.run(_call(args))
    if args.command == "ls":
        return asyncio.run(_ls(args))
    if args.command == "launch":
        return _launch(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "ps":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(args))
        return 0
    if not DEMO.exists():
        print(f"the demo ships with the source checkout; {DEMO} is missing", file=sys.stderr)
        return 1
    sys.argv = [str(DEMO), *("--help" if a == "--help-demo" else a for a in extra)]
    runpy.run_path(str(DEMO), run_name="__main__")
    return 0
