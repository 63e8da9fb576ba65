# cython: language_level=3
"""When a connection's event loop keeps polling for the answer to what it
just sent, and when it sleeps: ``SpinGate``, compiled (it is asked on every
poll while a window is open). ucx:// polls its UCX worker so
(``_ucx_progress``), tcp:// its socket (``_stream_core``).

In a ping-pong the answer usually comes within a short window after the
last one, and a poll costs far less than a wake-up: a process that sleeps
between messages pays the kernel's (and a virtual machine's host's) wake-up
on every one (issue 22).
"""

import time

#: After a spin window passed with no answer, skip spinning after this many
#: completions, doubling (up to SPIN_SKIP_MAX) while windows keep failing.
SPIN_SKIP_FIRST = 2
SPIN_SKIP_MAX = 64
cdef int _SPIN_SKIP_FIRST = SPIN_SKIP_FIRST
cdef int _SPIN_SKIP_MAX = SPIN_SKIP_MAX


cdef class SpinGate:
    """Whether to keep polling for an answer, or sleep.

    :meth:`completed` (an answer came) opens a window of ``window`` seconds
    (by ``clock``); :meth:`spinning` says whether it is still open. A window
    that closes with no completion in it is a failed spin: the answer did
    not come while we polled, most likely because the peer shares our CPU
    and could not run. Then the next windows stay shut: after a failure the
    gate skips ``SPIN_SKIP_FIRST`` completions before it tries again, twice
    as many after each further failure (at most ``SPIN_SKIP_MAX``), and a
    window that gets its answer resets that. So a pair that shares a CPU
    pays one failed window every ``SPIN_SKIP_MAX`` calls, not one per call.
    """

    # Its fields are declared in _spin_gate.pxd: window, clock, failed,
    # _opened, _open, _skip, _skipping.

    def __init__(self, double window, clock=time.perf_counter):
        self.window = window
        self.clock = clock
        self.failed = 0
        self._opened = 0.0
        self._open = False
        self._skip = 0
        self._skipping = 0

    cpdef completed(self):
        """A request completed: the answer came; open a window from now."""
        if self._open:
            self._skipping = 0  # it came within the window: spinning pays
        if self._skip:
            self._skip -= 1
            self._open = False
            return
        self._open = self.window > 0
        self._opened = self.clock()

    cpdef bint spinning(self):
        """True while the window is open: poll again rather than sleep."""
        if not self._open:
            return False
        if self.clock() - self._opened < self.window:
            return True
        self._open = False
        self.failed += 1
        self._skipping = min(max(2 * self._skipping, _SPIN_SKIP_FIRST), _SPIN_SKIP_MAX)
        self._skip = self._skipping
        return False
