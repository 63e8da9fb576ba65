"""The process's UCX state for ucx://: options, context, worker and progress.

UCX takes most settings from ``UCX_*`` environment variables, read when the
library loads and when a context is created, and ``import ucxx`` sets some of
them itself. So :func:`acquire` applies ``UCXOptions.ucx_environment()`` to
``os.environ`` once per process, right before ucxx is first imported, and
refuses (``ConfigError``) a later call that asks for different settings.

We use ucxx's synchronous core (``ucxx._lib.libucxx``) with a context and a
worker of our own rather than its asyncio layer (the global
``ucxx.core._ctx``): that layer waits for every request by polling it with
``await asyncio.sleep(0)``, so a receive posted on an idle connection spins a
core, and its "blocking" mode does not re-arm the worker after an event.
Instead :class:`Runtime` drives the worker from the event loop the way UCX's
wakeup API is meant to be used: progress, then ``ucp_worker_arm``; when the
worker is armed the loop sleeps on its epoll descriptor until UCX has news,
so an idle connection costs nothing. Completed requests are found after each
progress and their callbacks run on the loop. That loop runs several times
per message, so it is compiled (``_ucx_progress.Progress``).

After a completion the runtime keeps polling for a short window
(``UCXOptions.spin``) before it sleeps, since in a ping-pong the answer
usually comes within it and a poll costs far less than a wake-up.
:class:`SpinGate` decides that, and two things about it matter (issue 22,
"millisecond mode"): the window is timed with ``time.perf_counter``, not
``loop.time()``, which on uvloop is libuv's cached millisecond clock, so a
200 µs window polled until the next millisecond boundary; and a window
that passes with no answer closes the next ones for a while, because then
the peer did not run while we held the CPU (both processes on one CPU, the
usual placement on a host whose cores are busy), and polling on only takes
the CPU it needs. With both, two processes on one CPU took about 2 ms per
tiny call: each side polled until the millisecond ticked over.

UCX does not announce every completion on that descriptor: requests that
an endpoint's close cancels complete in a later progress with no event, and
under load (a greedy peer, busy cores) a receive now and then completes with
the worker armed and no wake-up, over shared memory and TCP alike. So while
requests are in flight and the worker sleeps, a watchdog progresses it
anyway: 2 ms after activity, doubling while its passes find nothing (an idle
connection costs about two wake-ups a second), back to 2 ms at the next
activity or when a pass finds a completion. With a fixed 0.5 s it did
catch them, but a missed receive then held a call for half a second.

The runtime is reference counted: listeners and connections hold it, and when
the last one is gone the worker and context are destroyed, so a process (or
a test suite, with one event loop per test) leaves no UCX state behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, TransportError, UnsupportedTransportError
from ._spin_gate import SpinGate
from ._ucx_progress import PROGRESS_ROUNDS, Progress
from .config import UCXOptions

__all__ = ("Runtime", "SpinGate", "acquire", "active_runtime", "applied_environment")

logger = logging.getLogger(__name__)

#: While requests are in flight and the worker sleeps on its descriptor,
#: progress anyway after this long (seconds): a safety net for completions
#: UCX signals no event for (a missed wake-up, or requests an endpoint's close
#: cancels). The delay doubles, up to _WATCHDOG_MAX_S, while these passes
#: find nothing, and is back to _WATCHDOG_FIRST_S at the next activity.
_WATCHDOG_FIRST_S = 0.002
_WATCHDOG_MAX_S = 0.5

#: The UCX environment applied in this process (None until the first use).
_applied_env: dict[str, str] | None = None
#: The live runtime, if any (the process has at most one UCX worker).
_runtime: Runtime | None = None
#: Buffers of requests UCX had not finished when its worker was destroyed.
#: A peer may still write into them (CMA and RDMA write straight into this
#: process's memory; a matched receive of a large message cannot be
#: cancelled), so they are never freed, or reused by the buffer pool.
_abandoned: list[Any] = []


def applied_environment() -> dict[str, str] | None:
    """The ``UCX_*`` settings ucx:// applied to this process, if any yet."""
    return None if _applied_env is None else dict(_applied_env)


def _apply_environment(options: UCXOptions) -> None:
    """Put ``options`` into ``os.environ`` before ucxx is first imported.

    Raises:
        ConfigError: UCX was already set up in this process with other options.
    """
    global _applied_env
    wanted = options.ucx_environment()
    if _applied_env is not None:
        if wanted != _applied_env:
            raise ConfigError(
                "UCX options are fixed once per process, when ucx:// is first used: "
                f"this process runs with {_applied_env}, a later call asked for {wanted}"
            )
        return
    if "ucxx" in sys.modules:
        # Someone imported ucxx before us: options UCX reads at load time may
        # not apply; those read when a context is created (UCX_TLS,
        # UCX_RNDV_SCHEME, ...) still do.
        logger.debug("ucxx was imported before ucx:// first ran; applying %s late", wanted)
    # UCX warns on stdout about variables it does not know, and ucxx sets one
    # (UCX_MEMTYPE_CACHE) that UCX >= 1.19 no longer has.
    if "UCX_WARN_UNUSED_ENV_VARS" not in os.environ and "UCX_WARN_UNUSED_ENV_VARS" not in wanted:
        os.environ["UCX_WARN_UNUSED_ENV_VARS"] = "n"
    os.environ.update(wanted)
    _applied_env = wanted


def _import_ucxx() -> Any:
    try:
        import ucxx._lib.libucxx as ucx_api
    except ImportError as exc:
        raise UnsupportedTransportError(
            f"ucx:// needs the ucxx package (pip install ucxx-cu12): {exc}"
        ) from exc
    return ucx_api


def active_runtime() -> Runtime | None:
    """The live runtime, if a ucx:// listener or connection exists."""
    return _runtime


def acquire(options: UCXOptions) -> Runtime:
    """The process's UCX runtime on the running loop, with one more reference.

    Call :meth:`Runtime.release` once for each successful call.

    Raises:
        ConfigError: other UCX options than the process already runs with, or
            a progress mode this transport does not drive.
        UnsupportedTransportError: ucxx is not installed.
        TransportError: UCX could not start, or ucx:// is in use on another
            event loop.
    """
    global _runtime
    if options.progress_mode not in ("blocking", "polling"):
        raise ConfigError(
            f"ucx:// drives UCX from the event loop and supports the 'blocking' and "
            f"'polling' progress modes, not {options.progress_mode!r}"
        )
    loop = asyncio.get_running_loop()
    _apply_environment(options)
    runtime = _runtime
    if runtime is not None and runtime.loop is not loop:
        if not runtime.loop.is_closed():
            raise TransportError(
                "ucx:// is already in use on another event loop; UCX runs on one loop per process"
            )
        # The loop that owned it was closed with connections left open.
        runtime.destroy()
        runtime = None
    if runtime is not None and (runtime.progress_mode, runtime.spin) != (
        options.progress_mode, options.spin
    ):
        raise ConfigError(
            f"ucx:// is running in progress mode {runtime.progress_mode!r} with spin "
            f"{runtime.spin}; {options.progress_mode!r} with spin {options.spin} was asked "
            "while it is in use"
        )
    if runtime is None:
        runtime = Runtime(loop, options.progress_mode, options.spin)
        _runtime = runtime
    runtime.refs += 1
    return runtime


class Runtime:
    """A UCX context and worker, progressed by an asyncio event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, progress_mode: str,
                 spin: float) -> None:
        self.api = _import_ucxx()
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        self.Array = Array
        self.Tag = Tag
        self.TagMaskFull = TagMaskFull
        self.loop = loop
        self.progress_mode = progress_mode
        self.spin = spin
        self.refs = 0
        api = self.api
        try:
            self.context = api.UCXContext({}, feature_flags=(api.Feature.TAG, api.Feature.WAKEUP))
            self.worker = api.UCXWorker(self.context)
            self.worker.init_blocking_progress_mode()
            self._fd: int | None = self.worker.epoll_file_descriptor
        except Exception as exc:
            raise translate(self, exc, "cannot start UCX") from exc
        self.address: bytes = self.worker.address.tobytes()
        self.cuda_support: bool = bool(self.context.cuda_support)
        self.spin_gate = SpinGate(spin)
        self._progress = Progress(self.worker, loop, progress_mode == "polling",
                                  self.spin_gate, self._arm_watchdog, self._near_watchdog)
        #: ``watch(request, keep, callback, answered_soon=False)``: call
        #: ``callback(request)`` on the loop once ``request`` completes;
        #: ``keep`` (its buffer) stays referenced until then; a request the
        #: peer answers at once opens a spin window (Progress.watch).
        self.watch = self._progress.watch
        #: ``kick()``: progress the worker soon, after posting a request.
        self.kick: Callable[[], None] = self._progress.kick
        #: ``posted()``: a request was posted that UCX completed at once.
        self.posted: Callable[[], None] = self._progress.posted
        self._watchdog: asyncio.TimerHandle | None = None
        #: The delay the next (or the pending) watchdog pass is set for.
        self.watchdog_delay = _WATCHDOG_FIRST_S
        self._in_watchdog = False
        self._passes_seen = 0
        #: Watchdog passes that found completed requests: completions UCX
        #: raised no event for (or raised it just as the pass ran).
        self.watchdog_finds = 0
        self._ids: set[int] = set()
        assert self._fd is not None
        loop.add_reader(self._fd, self._progress.run)
        logger.debug("UCX worker started (progress mode %s)", progress_mode)
        self.kick()

    # -- lifetime --------------------------------------------------------------

    def release(self) -> None:
        """Drop one reference; the last one destroys the worker and context."""
        self.refs -= 1
        if self.refs <= 0:
            self.destroy()

    def destroy(self) -> None:
        """Tear the worker and context down (endpoints must be closed first)."""
        global _runtime
        if _runtime is self:
            _runtime = None
        if self._fd is None:
            return
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)
        self._fd = None
        progress = self._progress
        progress.stop()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        # Let cancelled requests finish so UCX no longer writes into buffers
        # we are about to drop; the buffers of those that do not are kept.
        for _ in range(PROGRESS_ROUNDS):
            if not progress.waiting:
                break
            progress.progress()
        unfinished = progress.abandon()
        if unfinished:
            _abandoned.extend(unfinished)
            logger.warning(
                "UCX worker stopped with %d transfer(s) unfinished; their %d bytes of buffers "
                "stay allocated for the process's life, since a peer may still write into them",
                len(unfinished), sum(getattr(keep, "nbytes", 0) for keep in unfinished),
            )
        del self.worker
        del self.context
        logger.debug("UCX worker stopped")

    @property
    def alive(self) -> bool:
        """False once destroyed."""
        return self._fd is not None

    def new_id(self) -> int:
        """A 32-bit connection id, unique among this worker's connections."""
        while True:
            cid = secrets.randbits(32)
            if cid and cid not in self._ids:
                self._ids.add(cid)
                return cid

    def free_id(self, cid: int) -> None:
        """Return a connection id."""
        self._ids.discard(cid)

    # -- progress ---------------------------------------------------------------

    def _arm_watchdog(self) -> None:
        """The worker was armed with requests in flight (after every pass
        that ends asleep, so this stays cheap)."""
        if self._watchdog is None and not self._in_watchdog:
            self._schedule_watchdog()

    def _near_watchdog(self) -> None:
        """Activity after a quiet spell (the first post or completion), with
        the next pass far off: a completion missed now would wait for it."""
        self.watchdog_delay = _WATCHDOG_FIRST_S
        if self._watchdog is not None and not self._in_watchdog:
            self._watchdog.cancel()
            self._schedule_watchdog()

    def _schedule_watchdog(self) -> None:
        self._passes_seen = self._progress.passes
        self._watchdog = self.loop.call_later(self.watchdog_delay, self._on_watchdog)

    def _on_watchdog(self) -> None:
        """Progress, unless a pass ran since the last look (it found what
        had completed: progress and the scan are worker-wide). The next look
        comes soon after activity or a find, later (doubling) after neither."""
        self._watchdog = None
        progress = self._progress
        if progress.passes != self._passes_seen:
            self.watchdog_delay = _WATCHDOG_FIRST_S
        else:
            completed = progress.completions
            self._in_watchdog = True
            try:
                progress.run()
            finally:
                self._in_watchdog = False
            if progress.completions != completed:
                self.watchdog_finds += 1
                self.watchdog_delay = _WATCHDOG_FIRST_S
                logger.debug("UCX watchdog pass found %d completion(s) no event announced",
                             progress.completions - completed)
            else:
                self.watchdog_delay = min(2 * self.watchdog_delay, _WATCHDOG_MAX_S)
        progress.quiet = self.watchdog_delay > _WATCHDOG_FIRST_S
        if progress.waiting and self._fd is not None:
            self._schedule_watchdog()


def translate(runtime: Runtime | None, exc: BaseException, what: str) -> TransportError:
    """A tensorwire error for a UCX (or buffer) exception."""
    from ..errors import ConnectionClosedError

    if isinstance(exc, TransportError):
        return exc
    closed_names = (
        "UCXCanceledError",
        "UCXCloseError",
        "UCXConnectionResetError",
        "UCXEndpointTimeoutError",
        "UCXNotConnectedError",
        "UCXUnreachableError",
    )
    name = ucx_error_name(exc)
    error: TransportError
    if name in closed_names:
        error = ConnectionClosedError(f"{what}: {name}: {exc}")
    else:
        error = TransportError(f"{what}: {name}: {exc}")
    error.__cause__ = exc
    return error


def ucx_error_name(exc: BaseException) -> str:
    """The UCX exception's name without the binding's prefix (``UCXX...`` -> ``UCX...``)."""
    name = type(exc).__name__
    return "UCX" + name[4:] if name.startswith("UCXX") else name
