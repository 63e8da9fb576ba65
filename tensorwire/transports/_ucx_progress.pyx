"""Driving a UCX worker from the event loop, compiled: progress, find the
completed requests, call their callbacks, then poll on a while
(``_spin_gate.SpinGate``) or arm the worker and sleep on its descriptor. This
runs several times per message, and once per poll while a window is open,
so its cost is the granularity at which an answer is seen (issue 22).

How and why the runtime progresses this way is told in _ucx_runtime.py's
docstring; this module holds the loop itself.
"""

from ._spin_gate cimport SpinGate

import logging

logger = logging.getLogger("tensorwire.transports._ucx_runtime")

#: A progress pass that ends with the worker still busy (``arm`` refused) is
#: followed by up to this many more before we yield to the loop.
PROGRESS_ROUNDS = 16
cdef int _PROGRESS_ROUNDS = PROGRESS_ROUNDS


cdef class _Entry:
    # One waited request: a small object instead of a tuple, so the scan
    # reads typed fields.
    cdef object request
    cdef object keep  # the request's buffer: UCX may use it until it completes
    cdef object callback

    def __cinit__(self, object request, object keep, object callback):
        self.request = request
        self.keep = keep
        self.callback = callback


cdef class Progress:
    """The progress loop of one worker on one event loop: the requests in
    flight, the spin gate, and whether a pass is scheduled.

    ``on_armed`` is called when the worker was armed with requests still
    in flight, and ``on_active`` at the first post or completion after the
    runtime set :attr:`quiet` (both for the runtime's watchdog)."""

    cdef object worker
    cdef object loop
    cdef object on_armed
    cdef object on_active
    #: Set by the runtime while its watchdog waits long; cleared (and
    #: ``on_active`` called) by the next post or completion.
    cdef public bint quiet
    cdef object _run  # this object's _run_scheduled(), bound once
    cdef list _entries
    cdef readonly SpinGate gate
    #: How many requests have completed so far (the runtime's watchdog
    #: tells by it whether its pass found any).
    cdef readonly Py_ssize_t completions
    #: How many passes (:meth:`run`) so far: whether the worker was
    #: progressed since the runtime's watchdog last looked.
    cdef readonly Py_ssize_t passes
    cdef bint polling
    cdef bint _scheduled
    cdef readonly bint stopped

    def __init__(self, worker, loop, bint polling, SpinGate gate, on_armed, on_active):
        self.worker = worker
        self.loop = loop
        self.polling = polling
        self.gate = gate
        self.on_armed = on_armed
        self.on_active = on_active
        self.quiet = False
        self._entries = []
        self._scheduled = False
        self.stopped = False
        self.completions = 0
        self.passes = 0
        self._run = self._run_scheduled

    @property
    def waiting(self):
        """How many requests are in flight."""
        return len(self._entries)

    def watch(self, request, keep, callback, bint answered_soon=False):
        """Call ``callback(request)`` on the loop once ``request`` completes.

        ``keep`` (the request's buffer) stays referenced until then: UCX may
        write into it until the request is complete or cancelled.
        ``answered_soon``: the peer completes it as soon as it sees it (a
        rendezvous send, a frame's receive), so the spin gate opens a window
        now (``SpinGate.awaiting``) rather than only at the next completion:
        each step of a large message's rendezvous would otherwise cost a
        wake-up.
        """
        self._entries.append(_Entry(request, keep, callback))
        if answered_soon:
            self.gate.awaiting()
        self.kick()

    cpdef kick(self):
        """Progress the worker soon (after posting a request)."""
        self._active()
        self._schedule()

    cpdef posted(self):
        """A request was posted that UCX completed at once (nothing to
        watch, no pass needed): still activity, for the watchdog."""
        self._active()

    cdef _active(self):
        if self.quiet:
            self.quiet = False
            self.on_active()

    cdef _schedule(self):
        if not self._scheduled and not self.stopped:
            self._scheduled = True
            self.loop.call_soon(self._run)

    cpdef progress(self):
        """One worker progress; then the completed requests are taken out
        (one pass over the list), the gate is told, and their callbacks run
        in the order they were watched. A failing callback is logged, not
        raised: the others still run."""
        self.worker.progress()
        cdef list entries = self._entries
        cdef list done = None
        cdef list waiting = None
        cdef _Entry entry
        cdef Py_ssize_t i, n = len(entries)
        for i in range(n):
            entry = <_Entry>entries[i]
            if entry.request.completed:
                if done is None:
                    # The first completion: what came before still waits.
                    done = []
                    waiting = entries[:i]
                done.append(entry)
            elif done is not None:
                waiting.append(entry)
        if done is None:
            return
        # Callbacks may watch new requests: they go to the new list.
        self._entries = waiting
        self.completions += len(done)
        self._active()
        self.gate.completed()
        for entry in done:
            try:
                entry.callback(entry.request)
            except Exception:
                logger.exception("UCX completion callback failed")

    def _run_scheduled(self):
        """The pass that kick() scheduled. Only it clears the flag: a pass
        the descriptor or the watchdog starts must not, or each would
        schedule one more while one is pending, and while a spin window is
        open the loop's queue filled with passes (hundreds per turn, every
        other callback behind them: a tiny RPC call took 0.4 ms with a 1 ms
        window instead of 0.1 ms)."""
        self._scheduled = False
        self.run()

    def run(self):
        """A pass: progress until the worker can be armed (then the loop
        sleeps on its descriptor), or poll again on the next loop turn
        while requests wait and the mode or the spin window says so."""
        cdef int rounds
        self.passes += 1
        if self.stopped:
            return
        try:
            for rounds in range(_PROGRESS_ROUNDS):
                self.progress()
                if self.stopped:
                    # A completion callback released the last reference.
                    return
                if self._entries and (self.polling or self.gate.spinning()):
                    # Polling trades a core for latency while requests wait.
                    break
                if self.worker.arm():
                    # Armed: the epoll descriptor wakes us when UCX has news.
                    if self._entries:
                        self.on_armed()
                    return
        except Exception:
            logger.exception("UCX progress failed")
        self._schedule()

    def stop(self):
        """No more passes (the worker is being destroyed)."""
        self.stopped = True

    def abandon(self):
        """The last step of the worker's teardown: call every callback with
        None and forget the requests; the buffers of those UCX had not
        finished (they must stay allocated).

        It also lets go of the worker and of ``on_armed`` (the runtime), so
        that the worker is destroyed when the runtime drops it, not by some
        later garbage collection (this object's bound ``run`` is a cycle),
        which could run in the middle of starting the next worker."""
        cdef list entries = self._entries
        cdef _Entry entry
        self.stopped = True
        self._entries = []
        self.worker = None
        self.on_armed = None
        self.on_active = None
        self.quiet = False
        self._run = None
        unfinished = [entry.keep for entry in entries if not entry.request.completed]
        for entry in entries:
            entry.callback(None)
        return unfinished
