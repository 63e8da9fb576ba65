"""The ``tensorwire`` command.

::

    tensorwire ps serve --listen tcp://0.0.0.0:7000 --checkpoint-dir /ckpt/shard0
    tensorwire demo

This is an entry point: it may read the environment and print; the library
does neither.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import runpy
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ("main",)

DEMO = Path(__file__).resolve().parents[1] / "examples" / "ps_train.py"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tensorwire", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default="WARNING",
                        help="logging level (DEBUG, INFO, WARNING, ...)")
    commands = parser.add_subparsers(dest="command", required=True)

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
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await shard.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "demo":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
