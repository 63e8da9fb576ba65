"""Start N local processes as the ranks of one group (what ``tensorwire launch`` runs).

Like torchrun on one host: each child gets the environment
:meth:`Group.from_env` reads (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, and ``TENSORWIRE_MASTER`` pointing at a rendezvous
this launcher serves) and the rest of what torchrun sets (``GROUP_RANK``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, and ``MASTER_ADDR`` / ``MASTER_PORT``
naming a free port on loopback), so one script runs under either launcher
and can also call ``torch.distributed.init_process_group()`` for the parts
it keeps on gloo or NCCL. Its output lines are prefixed with its rank, SIGINT
and SIGTERM are passed on to every child, and when one child fails the
others are stopped at once, so a broken job never hangs.

A group whose rank failed is broken for good, as an NCCL communicator is.
What re-forms it is a restart, as torchrun's ``--max-restarts`` does: with
``max_restarts`` the launcher stops every rank, serves a fresh rendezvous
and starts all ranks again, with ``TENSORWIRE_RESTART_COUNT`` (and
torchrun's ``TORCHELASTIC_RESTART_COUNT``) telling them which attempt this
is, so they resume from their own checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from ..errors import ConfigError
from ._runtime import serve_rendezvous
from .config import GroupConfig

__all__ = ("LaunchResult", "launch")

logger = logging.getLogger(__name__)

#: A longer line is passed on in pieces.
_LONGEST_LINE = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    """How the ranks ended.

    Attributes:
        returncodes: each rank's exit status in the last attempt (negative:
            killed by that signal).
        failed_rank: the first rank seen to fail in the last attempt, or
            ``None``. When one rank's failure makes the others fail within
            moments, which is seen first is a matter of timing: the launcher
            prints every failed rank.
        restarts: how many times every rank was started again.
    """

    returncodes: tuple[int, ...]
    failed_rank: int | None
    restarts: int = 0

    @property
    def exit_code(self) -> int:
        """0 when every rank succeeded, else the first failure's status (as a shell reports it)."""
        if self.failed_rank is None:
            return 0
        code = self.returncodes[self.failed_rank]
        return 128 - code if code < 0 else code


async def launch(
    argv: Sequence[str],
    processes: int,
    *,
    listen: str | None = None,
    env: Mapping[str, str] | None = None,
    output: TextIO | None = None,
    grace: float = 5.0,
    config: GroupConfig | None = None,
    max_restarts: int = 0,
) -> LaunchResult:
    """Run ``argv`` as ``processes`` ranks of one group on this host.

    Args:
        argv: the command of each rank, e.g. ``[sys.executable, "train.py"]``.
        processes: how many ranks.
        listen: ``TENSORWIRE_LISTEN`` for the ranks (their data transport).
        env: the children's base environment (default: this process's).
        output: where the prefixed lines go (default: standard output).
        grace: seconds a stopped rank gets after SIGTERM before SIGKILL.
        config: the rendezvous's settings (its heartbeat timeout).
        max_restarts: how often a failed job is started again, all ranks
            together (a signal passed on to the ranks never restarts them).

    Raises:
        ConfigError: no command, fewer than one process, or a negative
            ``max_restarts``.
    """
    if not argv:
        raise ConfigError("launch needs a command to run")
    if not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"launch needs at least one process, got {processes!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    out = output or sys.stdout
    base = dict(os.environ if env is None else env)
    base.update(WORLD_SIZE=str(processes), LOCAL_WORLD_SIZE=str(processes),
                ROLE_WORLD_SIZE=str(processes), GROUP_RANK="0",
                TORCHELASTIC_MAX_RESTARTS=str(max_restarts), TENSORWIRE_MASTER_HOSTED="1")
    if listen:
        base["TENSORWIRE_LISTEN"] = listen
    signalled: list[int] = []
    restarts = 0
    while True:
        base.update(TENSORWIRE_RESTART_COUNT=str(restarts),
                    TORCHELASTIC_RESTART_COUNT=str(restarts))
        result = await _attempt(argv, processes, base, out, grace, config, signalled)
        result = dataclasses.replace(result, restarts=restarts)
        if result.failed_rank is None or signalled or restarts == max_restarts:
            return result
        restarts += 1
        out.write(f"[launch] restarting all {processes} ranks "
                  f"(restart {restarts} of {max_restarts})\n")
        out.flush()


async def _attempt(argv: Sequence[str], processes: int, base: dict[str, str], out: TextIO,
                   grace: float, config: GroupConfig | None,
                   signalled: list[int]) -> LaunchResult:
    """Start every rank once, with a rendezvous of its own, and supervise them."""
    server, master = await serve_rendezvous("tcp://127.0.0.1:0", processes, config=config)
    # torch.distributed's store (env://) listens at MASTER_PORT on rank 0;
    # tensorwire's rendezvous is TENSORWIRE_MASTER, so the two never collide.
    torch_master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    children: list[asyncio.subprocess.Process] = []
    loop = asyncio.get_running_loop()
    try:
        for rank in range(processes):
            children.append(await asyncio.create_subprocess_exec(
                *argv, env={**base, **torch_master, "TENSORWIRE_MASTER": master,
                            "RANK": str(rank), "LOCAL_RANK": str(rank),
                            "ROLE_RANK": str(rank)},
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            ))
        forwarded = _forward_signals(loop, children, signalled)
        try:
            return await _supervise(children, out, grace)
        finally:
            for signum in forwarded:
                loop.remove_signal_handler(signum)
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
                await child.wait()
        await server.close(grace=0)


def _free_port() -> int:
    """A port the kernel just gave out on loopback (torchrun --standalone does the same).

    Another process could take it before rank 0's torch store binds it; the
    kernel hands out ephemeral ports in turn, so that is rare.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _forward_signals(loop: asyncio.AbstractEventLoop,
                     children: list[asyncio.subprocess.Process],
                     signalled: list[int]) -> list[int]:
    def forward(signum: int) -> None:
        signalled.append(signum)
        logger.info("passing signal %d on to %d ranks", signum, len(children))
        for child in children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signum)

    installed: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, forward, signum)
        except (NotImplementedError, RuntimeError, ValueError):
            continue  # not the main thread, or no signals here: nothing to pass on
        installed.append(signum)
    return installed


async def _supervise(children: list[asyncio.subprocess.Process], out: TextIO,
                     grace: float) -> LaunchResult:
    async def relay(rank: int, child: asyncio.subprocess.Process) -> None:
        # By chunks, not readline(): a line longer than the stream's limit
        # would end the relay and leave the child blocked on a full pipe.
        assert child.stdout is not None
        pending = b""
        while chunk := await child.stdout.read(1 << 16):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if len(pending) > _LONGEST_LINE:
                lines.append(pending)
                pending = b""
            for line in lines:
                out.write(f"[rank {rank}] {line.decode(errors='replace').rstrip()}\n")
            out.flush()
        if pending:
            out.write(f"[rank {rank}] {pending.decode(errors='replace').rstrip()}\n")
            out.flush()

    relays = [asyncio.ensure_future(relay(r, c)) for r, c in enumerate(children)]
    waits = {asyncio.ensure_future(c.wait()): r for r, c in enumerate(children)}
    failed: int | None = None
    pending = set(waits)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in sorted(done, key=waits.__getitem__):
            rank, code = waits[task], task.result()
            if code == 0:
                continue
            out.write(f"[launch] rank {rank} exited with status {code}\n")
            out.flush()
            if failed is None:
                failed = rank
                await _stop(children, grace)
    await asyncio.gather(*relays, return_exceptions=True)
    codes = tuple(c.returncode if c.returncode is not None else -1 for c in children)
    return LaunchResult(codes, failed)


async def _stop(children: list[asyncio.subprocess.Process], grace: float) -> None:
    running = [c for c in children if c.returncode is None]
    for child in running:
        with contextlib.suppress(ProcessLookupError):
            child.terminate()
    try:
        await asyncio.wait_for(asyncio.gather(*(c.wait() for c in running)), grace)
    except TimeoutError:
        for child in running:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
