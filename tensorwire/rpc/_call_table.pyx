# cython: language_level=3
"""Calls in flight by call id, compiled: ``CallTable``, a hash table from a
call id (a nonzero 64-bit int) to what waits for the call (the client's
``UnaryCall`` or stream record, the server's call record).

Every message of a call looks its call up, and every call is added and
removed once: with a dict each of these boxes the id in a fresh Python int
and compares it with the key's. Here the ids are C integers in a C array
(open addressing, linear probing, deletion by shifting back: no
tombstones), and the values sit in a Python list beside it, so that the
garbage collector sees them as it sees a dict's. C callers use ``find``,
``put``, ``has`` and ``remove``; Python callers the dict methods the RPC
and its tests use (``get``, ``pop``, ``in``, ``len``, ``[]``, ``del``,
``values``, ``items``).

A server's call ids come from its peer: the slot of an id is a hash keyed
by a random salt of each table, so that a peer cannot choose ids that all
land on one run of slots (which would make every lookup a scan).
"""

cimport cython
from cpython.mem cimport PyMem_Calloc, PyMem_Free
from libc.stdint cimport uint64_t

import os

#: The fewest slots a table has; it doubles when half full, and halves
#: when under an eighth full.
cdef Py_ssize_t _MIN_CAPACITY = 16
#: 2**64 / the golden ratio: consecutive ids land far apart.
cdef uint64_t _FIBONACCI = 0x9E3779B97F4A7C15ULL
#: One past the largest call id.
cdef object _ID_END = 1 << 64


@cython.final
cdef class CallTable:
    """Call id -> waiter (see the module)."""

    # Its fields are declared in _call_table.pxd: size, _capacity (a power
    # of two), _shift, _salt, _keys (0: a free slot), _values.

    def __cinit__(self):
        self._salt = int.from_bytes(os.urandom(8), "little")
        self._allocate(_MIN_CAPACITY)

    def __dealloc__(self):
        PyMem_Free(self._keys)

    cdef void _allocate(self, Py_ssize_t capacity) except *:
        """Fresh, empty slots: ``capacity`` of them (a power of two); the
        table is unchanged if they cannot be had."""
        cdef list values = [None] * capacity
        cdef uint64_t *keys = <uint64_t *>PyMem_Calloc(capacity, sizeof(uint64_t))
        if keys == NULL:
            raise MemoryError()
        PyMem_Free(self._keys)
        self._keys = keys
        self._values = values
        self._capacity = capacity
        self._shift = 64
        while capacity > 1:
            capacity >>= 1
            self._shift -= 1
        self.size = 0

    cdef inline Py_ssize_t _home(self, uint64_t call_id) noexcept:
        """The slot where ``call_id``'s search starts."""
        return <Py_ssize_t>(((call_id ^ self._salt) * _FIBONACCI) >> self._shift)

    cdef Py_ssize_t _probe(self, uint64_t call_id) noexcept:
        """The slot holding ``call_id`` (not 0), or else the free slot that
        ends its search (where it would go)."""
        cdef Py_ssize_t mask = self._capacity - 1
        cdef Py_ssize_t at = self._home(call_id)
        while self._keys[at] != call_id and self._keys[at] != 0:
            at = (at + 1) & mask
        return at

    cdef Py_ssize_t _slot(self, uint64_t call_id) noexcept:
        """The slot holding ``call_id`` (not 0), or -1."""
        cdef Py_ssize_t at = self._probe(call_id)
        return at if self._keys[at] == call_id else -1

    cdef object find(self, uint64_t call_id):
        """What waits for ``call_id``, or None."""
        cdef Py_ssize_t at = self._slot(call_id) if call_id else -1
        return None if at < 0 else self._values[at]

    cdef bint has(self, uint64_t call_id) noexcept:
        return call_id != 0 and self._slot(call_id) >= 0

    cdef void put(self, uint64_t call_id, object waiter) except *:
        """``call_id`` -> ``waiter``, replacing what it had.

        Raises:
            ValueError: ``call_id`` is 0 (no call's).
        """
        if call_id == 0:
            raise ValueError("call id 0 is no call's")
        cdef Py_ssize_t at = self._probe(call_id)
        if self._keys[at] == call_id:
            self._values[at] = waiter
            return
        self._keys[at] = call_id
        self._values[at] = waiter
        self.size += 1
        if 2 * self.size > self._capacity:
            self._rehash(2 * self._capacity)

    cdef object remove(self, uint64_t call_id):
        """Take ``call_id`` out; what waited for it, or None."""
        cdef Py_ssize_t at = self._slot(call_id) if call_id else -1
        if at < 0:
            return None
        waiter = self._values[at]
        self._free(at)
        self.size -= 1
        if 8 * self.size < self._capacity and self._capacity > _MIN_CAPACITY:
            self._rehash(self._capacity // 2)
        return waiter

    cdef void _free(self, Py_ssize_t at) except *:
        """Empty slot ``at``, moving back the entries after it that would
        otherwise no longer be found from their home slot."""
        cdef Py_ssize_t mask = self._capacity - 1
        cdef Py_ssize_t hole = at, home
        cdef list values = self._values
        while True:
            at = (at + 1) & mask
            if self._keys[at] == 0:
                break
            home = self._home(self._keys[at])
            # The entry stays if its home lies cyclically in (hole, at].
            if (home > hole and home <= at) if hole <= at else (home > hole or home <= at):
                continue
            self._keys[hole] = self._keys[at]
            values[hole] = values[at]
            hole = at
        self._keys[hole] = 0
        values[hole] = None

    cdef void _rehash(self, Py_ssize_t capacity) except *:
        """Move every entry into ``capacity`` fresh slots."""
        cdef uint64_t *keys = self._keys
        cdef list values = self._values
        cdef Py_ssize_t i, old = self._capacity
        self._keys = NULL
        try:
            self._allocate(capacity)
        except BaseException:
            self._keys = keys
            raise
        try:
            for i in range(old):
                if keys[i]:
                    self.put(keys[i], values[i])
        finally:
            PyMem_Free(keys)

    # -- as a dict, for Python callers -----------------------------------------

    def __len__(self):
        return self.size

    def __bool__(self):
        return self.size > 0

    def __contains__(self, call_id):
        return type(call_id) is int and 0 < call_id < _ID_END and self.has(call_id)

    def __getitem__(self, call_id):
        cdef Py_ssize_t at = self._slot(call_id) if call_id in self else -1
        if at < 0:
            raise KeyError(call_id)
        return self._values[at]

    def __setitem__(self, call_id, waiter):
        self.put(call_id, waiter)

    def __delitem__(self, call_id):
        if call_id not in self:
            raise KeyError(call_id)
        self.remove(call_id)

    def get(self, call_id, default=None):
        """What waits for ``call_id``, or ``default``."""
        if call_id not in self:
            return default
        return self.find(call_id)

    def pop(self, call_id, default=None):
        """Take ``call_id`` out: what waited for it, or ``default``."""
        if call_id not in self:
            return default
        return self.remove(call_id)

    def keys(self):
        """The call ids, as a list (a copy: the table may change while
        the caller goes through it)."""
        return [self._keys[i] for i in range(self._capacity) if self._keys[i]]

    def values(self):
        """What waits, as a list (a copy, as ``keys``)."""
        return [self._values[i] for i in range(self._capacity) if self._keys[i]]

    def items(self):
        """``(call id, waiter)`` pairs, as a list (a copy, as ``keys``)."""
        return [(self._keys[i], self._values[i]) for i in range(self._capacity) if self._keys[i]]

    def __iter__(self):
        return iter(self.keys())

    def clear(self):
        """Forget every call."""
        self._allocate(_MIN_CAPACITY)

    def longest_run(self):
        """The most slots a lookup reads: the longest run of occupied slots
        plus the free one that ends it (a diagnostic: with a hash that does
        its work, a few at most)."""
        cdef Py_ssize_t i, run = 0, longest = 0
        # Twice round, for a run that wraps past the last slot.
        for i in range(2 * self._capacity):
            if self._keys[i & (self._capacity - 1)]:
                run += 1
                if run > longest:
                    longest = run
            else:
                run = 0
        return min(longest, self._capacity) + 1

    def __repr__(self):
        return f"CallTable({dict(self.items())!r})"
