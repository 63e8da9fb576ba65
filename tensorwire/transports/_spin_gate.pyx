# cython: language_level=3
"""When a connection's event loop keeps polling for the answer to what it
just sent, and when it sleeps: ``SpinGate``, compiled (it is asked on every
poll while a window is open). ucx:// polls its UCX worker so
(``_ucx_progress``), tcp:// its socket (``_stream_core``).

In a ping-pong the answer usually comes within a short window after the
last one, and a poll costs far less than a wake-up: a process that sleeps
between messages pays the kernel's (and a virtual machine's host's) wake-up
on every one (issue 22). So does each step of a large message's rendezvous
over ucx://: the receiver's go-ahead, then the sender's data, each follows
the other's post as soon as the peer sees it.
"""

import time

#: After a spin window passed with no answer, skip spinning after this many
#: completions, doubling (up to SPIN_SKIP_MAX) while windows keep failing.
SPIN_SKIP_FIRST = 2
SPIN_SKIP_MAX = 64
cdef int _SPIN_SKIP_FIRST = SPIN_SKIP_FIRST
cdef int _SPIN_SKIP_MAX = SPIN_SKIP_MAX


cdef int longer_skip(int skipping) noexcept:
    """The next skip run after a failed window: ``SPIN_SKIP_FIRST``, then
    twice the last, at most ``SPIN_SKIP_MAX``."""
    return min(max(2 * skipping, _SPIN_SKIP_FIRST), _SPIN_SKIP_MAX)


cdef class SpinGate:
    """Whether to keep polling for an answer, or sleep.

    :meth:`completed` (an answer came) opens a window of ``window`` seconds
    (by ``clock``), and so does :meth:`awaiting` (a request went out whose
    answer comes at once); :meth:`spinning` says whether it is still open.
    A window that closes with no completion in it is a failed spin: the
    answer did not come while we polled, most likely because the peer
    shares our CPU and could not run. Then the next windows of that kind
    stay shut: after a failure the gate skips ``SPIN_SKIP_FIRST``
    completions (or posts, for :meth:`awaiting`'s windows) before it tries
    again, twice as many after each further failure (at most
    ``SPIN_SKIP_MAX``), and a window that gets its answer resets that. So a
    pair that shares a CPU pays one failed window every ``SPIN_SKIP_MAX``
    calls, not one per call.

    The two kinds keep their own count because they fail for different
    reasons: a completion's window also fails when the application has
    nothing more to send for a while (a training step between messages), a
    post's only when the peer did not run.
    """

    # Its fields are declared in _spin_gate.pxd.

    def __init__(self, double window, clock=time.perf_counter):
        self.window = window
        self.clock = clock
        self.failed = 0
        self._opened = 0.0
        self._open = False
        self._by_post = False
        self._skip = 0
        self._skipping = 0
        self._post_skip = 0
        self._post_skipping = 0

    cpdef completed(self):
        """A request completed: the answer came; open a window from now."""
        if self._open:
            # It came within the window: spinning pays.
            if self._by_post:
                self._post_skipping = 0
            else:
                self._skipping = 0
        if self._skip:
            self._skip -= 1
            self._open = False
            return
        self._open = self.window > 0
        self._by_post = False
        self._opened = self.clock()

    cpdef awaiting(self):
        """A request was posted whose answer the peer sends as soon as it
        sees it (a rendezvous send waits for the receiver's go-ahead, a
        frame's receive for the sender's data): open a window from now."""
        if self._post_skip:
            self._post_skip -= 1
            return
        if self.window <= 0:
            return
        self._open = True
        self._by_post = True
        self._opened = self.clock()

    cpdef bint spinning(self):
        """True while the window is open: poll again rather than sleep."""
        if not self._open:
            return False
        if self.clock() - self._opened < self.window:
            return True
        self._open = False
        self.failed += 1
        if self._by_post:
            self._post_skipping = longer_skip(self._post_skipping)
            self._post_skip = self._post_skipping
        else:
            self._skipping = longer_skip(self._skipping)
            self._skip = self._skipping
        return False
