# cython: language_level=3
"""Whether a connection's driver hands a long turn's output to the
transport in batches as it grows, or whole at the end of the turn:
``FlushGate``, compiled (``DriverCore.post_frames`` asks it for every
message past a batch).

A batch sent while the turn goes on lets the peer start on it while this
side works on the rest, when the two run at the same time (on two CPUs,
whole turns made the two ends take turns instead). Where the peer shares
this side's CPU, the batch buys nothing and costs a system call and a
wake-up of the peer more per turn (with 64 calls in flight and both ends
on one CPU, the server's writes were twice its reads). Two things say so:

- The kernel switched to the peer in the middle of our turn: the batch
  woke it onto our CPU, it answered part of the turn, and the two ends take
  twice the context switches and system calls for the same calls. A thread
  taken off its CPU while it still had work counts an involuntary context
  switch (``getrusage(RUSAGE_THREAD)``, ``ru_nivcsw``).
- The peer answered the early batch together with the rest: our next turn
  that posts is as long as the one that sent early, where a peer that
  started on the early batch at once splits its answers as we split ours.
  That is the peer that shares our CPU but did not take it from us (the
  kernel let our turn finish first), and a peer that answers a whole turn
  at once whatever we do.

Either shuts the early batches of the next long turns, as a failed spin
window shuts the next ones (``transports._spin_gate``): ``SKIP_FIRST``
long turns go whole, twice as many after each further such turn (at most
``SKIP_MAX``), and an early batch that the peer answered on its own, with
no switch, opens them again. A thread switched out for any other reason
(a busy host) shuts them too: where the CPUs are what is scarce, fewer and
larger writes are the cheaper way. Where the system does not count the
switches per thread, only the peer's answers shut them.
"""

from ..transports._spin_gate cimport longer_skip
from ..transports._spin_gate import SPIN_SKIP_FIRST, SPIN_SKIP_MAX


cdef extern from *:
    """
    #include <sys/resource.h>

    /* This thread's involuntary context switches so far; -1 where the
       system does not count them per thread. */
    static long tw_involuntary_switches(void) {
    #ifdef RUSAGE_THREAD
        struct rusage usage;
        if (getrusage(RUSAGE_THREAD, &usage) == 0)
            return usage.ru_nivcsw;
    #endif
        return -1;
    }
    """
    long tw_involuntary_switches() nogil


#: After a long turn was switched out following its early batch, this many
#: long turns go whole, doubling (up to SKIP_MAX) while it recurs: the spin
#: gate's backoff (``longer_skip``).
SKIP_FIRST = SPIN_SKIP_FIRST
SKIP_MAX = SPIN_SKIP_MAX


def involuntary_switches():
    """This thread's involuntary context switches so far; -1 where the
    system does not count them per thread."""
    return tw_involuntary_switches()


cdef class FlushGate:
    """Whether a long turn sends its batches early (see the module).

    :meth:`early` is asked for each message once a batch is waiting in the
    turn, :meth:`turn_ended` at the end of every turn that posted.

    Args:
        switches: what counts the thread's involuntary context switches
            (``involuntary_switches``, read in C, unless a test gives its own).
    """

    # Its fields are declared in _flush_gate.pxd.

    def __init__(self, switches=None):
        self._switches = switches
        self.switched = 0
        self.unsplit = 0
        self.held = 0
        self._sent_early = False
        self._held = False
        self._mark = -1
        self._judged = 0
        self._early_posts = 0
        self._skip = 0
        self._skipping = 0

    cdef long _count(self) except? -2:
        if self._switches is None:
            return tw_involuntary_switches()
        return self._switches()

    cpdef bint early(self, Py_ssize_t posted) except -1:
        """Whether the batch waiting in this turn goes now, when the turn
        has posted ``posted`` messages."""
        if self._held:
            return False
        if not self._sent_early:  # the turn's first batch
            if self._skip:
                self._held = True
                self.held += 1
                return False
            self._sent_early = True
            self._mark = self._count()
            self._early_posts = posted
        return True

    cpdef void turn_ended(self, Py_ssize_t posted) except *:
        """The turn that posted ``posted`` messages is over: did the last
        early batch pay (see the module)? This turn's own early batch, if
        it was not switched out, is judged by the next turn that posts."""
        held, self._held = self._held, False
        sent_early, self._sent_early = self._sent_early, False
        if held:
            self._skip -= 1
        judged, self._judged = self._judged, 0
        if judged:
            if posted >= judged:  # answered whole: the peer did not start early
                self.unsplit += 1
                self._shut()
            else:
                self._skipping = 0
        if not sent_early:
            return
        if self._mark >= 0 and self._count() > self._mark:
            self.switched += 1
            self._shut()
        elif posted > self._early_posts:
            self._judged = posted
        # else its first early batch was all it posted: no batch went
        # before the rest, nothing to judge.

    cdef void _shut(self) noexcept:
        """An early batch did not pay: the next long turns go whole."""
        self._skipping = longer_skip(self._skipping)
        self._skip = self._skipping
