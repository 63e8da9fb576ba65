"""The UCX requests a runtime waits for, compiled: after every worker
progress the whole list is scanned for completed requests, so this runs
several times per message (issue 22).

Each entry is a request, the buffer it reads or writes (kept referenced
until UCX lets go of it) and the callback to call with the request once
it is complete.
"""

import logging

logger = logging.getLogger("tensorwire.transports._ucx_runtime")


cdef class _Entry:
    # One waited request; a small object instead of a tuple so the scan
    # reads typed fields.
    cdef readonly object request
    cdef readonly object keep
    cdef readonly object callback

    def __cinit__(self, object request, object keep, object callback):
        self.request = request
        self.keep = keep
        self.callback = callback


cdef class PendingRequests:
    """Requests in flight and what to call when each completes."""

    cdef list _entries

    def __cinit__(self):
        self._entries = []

    def __len__(self):
        return len(self._entries)

    def __bool__(self):
        return len(self._entries) != 0

    def add(self, object request, object keep, object callback):
        """Wait for ``request``; ``keep`` stays referenced until it completes."""
        self._entries.append(_Entry(request, keep, callback))

    def collect(self, object gate):
        """Take the completed requests out (one pass over the list), tell
        ``gate`` (a SpinGate) once that some completed, then call their
        callbacks in the order they were added; the number that completed.
        A failing callback is logged, not raised: the others still run."""
        cdef list entries = self._entries
        cdef list done = None
        cdef list waiting = None
        cdef _Entry entry
        cdef Py_ssize_t i, n = len(entries)
        if n == 0:
            return 0
        for i in range(n):
            entry = <_Entry>entries[i]
            if entry.request.completed:
                if done is None:
                    # The first completion: what came before is still waiting.
                    done = []
                    waiting = entries[:i]
                done.append(entry)
            elif done is not None:
                waiting.append(entry)
        if done is None:
            return 0
        self._entries = waiting
        gate.completed()
        for entry in done:
            try:
                entry.callback(entry.request)
            except Exception:
                logger.exception("UCX completion callback failed")
        return len(done)

    def abandon(self):
        """Call every callback with None and forget the requests; the
        buffers of those UCX had not finished (they must stay allocated)."""
        cdef list entries = self._entries
        cdef _Entry entry
        self._entries = []
        unfinished = [entry.keep for entry in entries if not entry.request.completed]
        for entry in entries:
            entry.callback(None)
        return unfinished
