"""The ``tensorwire`` command.

::

    tensorwire info [--json]                      # versions, transports, UCX devices, GPUs
    tensorwire serve app:Store --listen tcp://0.0.0.0:7000
    tensorwire ls tcp://host:7000                 # services and methods
    tensorwire call tcp://host:7000 Store.get '"w"'
    tensorwire call tcp://host:7000 Store.scan prefix='"w"'   # a stream: JSON lines
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
import functools
import json
import logging
import os
import platform
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import _cli_rpc
from ._version import __version__
from .errors import (
    ConfigError,
    ConnectionClosedError,
    NotFound,
    RemoteError,
    TensorwireError,
    TransportError,
    Unauthenticated,
    Unavailable,
    UnsupportedTransportError,
)

__all__ = ("main",)

#: Exit status after the reader of standard output went away (``| head``):
#: 128 + SIGPIPE, what the shell reports for a command the signal ended.
_BROKEN_PIPE = 128 + signal.SIGPIPE


def _add_common_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """``--log-level`` and ``--verbose``, before the command or after it.

    After it (``defaults=False``) they default to SUPPRESS, so that a
    subcommand's parser leaves what the top level parsed alone.
    """
    parser.add_argument("--log-level", metavar="LEVEL",
                        default=(os.environ.get("TENSORWIRE_LOG", "WARNING") if defaults
                                 else argparse.SUPPRESS),
                        help="logging level (DEBUG, INFO, WARNING, ...; default: "
                             "$TENSORWIRE_LOG or WARNING)")
    parser.add_argument("--verbose", action="store_true",
                        default=False if defaults else argparse.SUPPRESS,
                        help="show the traceback of an error, not only its line")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tensorwire",
        description="tensorwire: asyncio RPC for distributed training. Show what a machine "
                    "can use, host and call services, launch ranks, measure links.")
    parser.add_argument("--version", action="version",
                        version=f"tensorwire {__version__} (Python "
                                f"{platform.python_version()}, {sys.executable})")
    _add_common_options(parser, defaults=True)
    common = argparse.ArgumentParser(add_help=False)
    _add_common_options(common, defaults=False)
    commands = parser.add_subparsers(dest="command", required=True)
    # Every subcommand takes the common options too.
    add_parser = functools.partial(commands.add_parser, parents=[common])

    info = add_parser("info", help="versions, OS, usable transports, UCX library and devices, "
                                   "GPUs and CUDA, environment: for a bug report")
    info.add_argument("--json", action="store_true", help="as JSON, for machines")

    serve_services = add_parser("serve", help="host service classes (module:Class)")
    serve_services.add_argument("services", nargs="+", metavar="MODULE:CLASS",
                                help="classes to host, each made with no arguments")
    serve_services.add_argument("--listen", action="append", metavar="URL",
                                help="address to listen on (repeatable; default "
                                     "tcp://127.0.0.1:0)")
    _cli_rpc.add_server_options(serve_services)

    call = add_parser("call", help="call a method with JSON arguments; print the result as "
                                   "JSON, a stream's items as JSON lines")
    call.add_argument("address", metavar="URL")
    call.add_argument("method", metavar="SERVICE.METHOD")
    call.add_argument("args", nargs="*", metavar="ARG",
                      help="an argument as JSON (\"text\", 3, [1, 2]); NAME=JSON for a "
                           "keyword argument; @ for a stream of JSON lines from standard "
                           "input")
    call.add_argument("--kwargs", metavar="OBJECT",
                      help='keyword arguments as one JSON object, e.g. {"key": "w"}')
    call.add_argument("--timeout", type=float, default=30.0,
                      help="the call's deadline in seconds (default 30; inf: none)")
    _cli_rpc.add_client_options(call)

    ls = add_parser("ls", help="list a server's services and methods")
    ls.add_argument("address", metavar="URL")
    _cli_rpc.add_client_options(ls)

    bench = add_parser("bench", help="size sweeps: transport, RPC, allreduce, "
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

    launch = add_parser("launch", help="run N local ranks of a program with the "
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

    ps = add_parser("ps", help="parameter server")
    ps_commands = ps.add_subparsers(dest="ps_command", required=True)
    serve = ps_commands.add_parser("serve", help="run one parameter-server shard",
                                   parents=[common])
    serve.add_argument("--listen", action="append", required=True, metavar="URL",
                       help="address to listen on (repeatable), e.g. tcp://0.0.0.0:7000")
    serve.add_argument("--checkpoint-dir", type=Path, metavar="DIR",
                       help="write checkpoints here and restore the newest at start")
    serve.add_argument("--checkpoint-interval", type=float, metavar="SECONDS",
                       help="checkpoint periodically")
    serve.add_argument("--checkpoint-every", type=int, metavar="UPDATES",
                       help="checkpoint after this many applied pushes")
    serve.add_argument("--keep", type=int, default=2, help="checkpoint files to keep")

    add_parser("demo", help="train a classifier through the parameter server (2 shards, 3 "
                            "worker processes); other options go to the demo (tensorwire "
                            "demo --help-demo lists them)")
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
    if args.plot:
        _bench.check_plot(args.plot)
    series: dict[str, list[_bench.Row]] = {}
    if args.connect:
        series[args.connect] = asyncio.run(_bench_sweep(args.what, args.connect, sizes))
    else:
        urls = _bench_urls(args)
        schemes = [f"{url.partition('://')[0]}://" for url in urls]
        for url, scheme in zip(urls, schemes, strict=True):
            # Named by scheme, or by address where two share one.
            series[scheme if schemes.count(scheme) == 1 else url] = _bench_local(args, url,
                                                                                sizes)
    _print_bench(args, series)
    if args.plot:
        _bench.plot(series, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _print_bench(args: argparse.Namespace, series: dict[str, list[Any]]) -> None:
    """All transports' figures: one JSON document, one CSV table, or a table each."""
    from . import _bench

    if args.json:
        print(_bench.format_json(series))
    elif args.csv:
        print(_bench.format_csv(series), end="")
    else:
        for name, rows in series.items():
            extra = f", {args.nproc} ranks" if args.what == "allreduce" else ""
            print(f"# {args.what} over {name}{extra}")
            print(_bench.format_table(rows))


async def _bench_sweep(what: str, address: str, sizes: list[int]) -> list[Any]:
    from . import _bench

    progress = _bench.Progress(len(sizes), f"{what} {address}")
    try:
        if what == "ps":
            return await _bench.sweep_ps(address.split(","), sizes, progress)
        sweep = _bench.sweep_p2p if what == "p2p" else _bench.sweep_rpc
        return await sweep(address, sizes, progress)
    finally:
        progress.close()


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
            [sys.executable, "-m", "tensorwire", "bench", "allreduce", "--as-rank",
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
        progress = _bench.Progress(len(sizes), f"allreduce, {group.world_size} ranks",
                                   shown=group.rank == 0)
        try:
            rows = await _bench.sweep_allreduce(group, sizes, progress)
        finally:
            progress.close()
    finally:
        await group.close()
    if group.rank != 0:
        return 0
    if args.as_rank:  # to the command that launched the ranks (_bench_local)
        print(json.dumps([dataclasses.asdict(r) for r in rows]), flush=True)
    else:
        args.nproc = group.world_size
        listen = os.environ.get("TENSORWIRE_LISTEN", "tcp://")
        _print_bench(args, {f"{listen.partition('://')[0]}://": rows})
    return 0


def _launch(args: argparse.Namespace) -> int:
    from .collective import launch

    argv = [sys.executable, args.program] if args.program.endswith(".py") else [args.program]
    result = asyncio.run(launch([*argv, *args.args], args.nproc, listen=args.listen,
                                max_restarts=args.max_restarts))
    return result.exit_code


def _hint(exc: BaseException, args: argparse.Namespace) -> str:
    address = getattr(args, "address", None)
    text = str(exc).lower()
    if isinstance(exc, UnsupportedTransportError):
        return ("for ucx:// install the UCX extra: pip install 'tensorwire[ucx-cu12]' "
                "(or ucx-cu13, matching your CUDA)")
    if isinstance(exc, Unauthenticated):
        return "the server wants its shared secret: --secret-file FILE or --secret-env VAR"
    if "certificate_verify_failed" in text or "certificate verify failed" in text:
        return "trust the server's CA with --tls-ca FILE"
    if isinstance(exc, Unavailable | ConnectionClosedError):
        where = f" at {address}" if address else ""
        return f"is a tensorwire server running{where}? check the host and port"
    if isinstance(exc, NotFound) and "service" in str(exc):
        return "tensorwire ls URL lists what the server hosts"
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
    except BrokenPipeError:
        # The reader went away (`| head`): what it took is all it wanted.
        # Python would complain again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _BROKEN_PIPE
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
        return asyncio.run(_cli_rpc.serve_services(args, _until_stopped))
    if args.command == "call":
        return asyncio.run(_cli_rpc.call(args))
    if args.command == "ls":
        return asyncio.run(_cli_rpc.ls(args))
    if args.command == "launch":
        return _launch(args)
    if args.command == "bench":
        return _bench(args)
    if args.command == "ps":
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(args))
        return 0
    from . import demo

    demo.main(["--help" if a == "--help-demo" else a for a in extra], prog="tensorwire demo")
    return 0
