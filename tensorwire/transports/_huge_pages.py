"""Large receive buffers backed by transparent huge pages (THP).

A frame received into 4 KiB pages costs a page fault and a TLB entry per
4 KiB; into 2 MiB pages, 512 times fewer. Issue 22 measured raw ucxx moving
64 MiB one way at 23.4 GB/s into huge-page-backed buffers and at 10.4 GB/s
with huge pages off. The kernel backs an anonymous mapping with huge pages
only where a 2 MiB-aligned 2 MiB range of it is asked for them
(``madvise(MADV_HUGEPAGE)``, when THP is in ``madvise`` mode) or always
(``always`` mode); :func:`huge_page_empty` maps such a range and asks.

The mode is the kernel's (``/sys/kernel/mm/transparent_hugepage/enabled``)
and :func:`transparent_huge_pages` reports it, so that a benchmark can state
which applied to its figures.
"""

from __future__ import annotations

import functools
import mmap
from typing import Any, Literal

import numpy as np

__all__ = ("HUGE_PAGE_BYTES", "huge_page_empty", "transparent_huge_pages")

#: The size (and alignment) of a transparent huge page on x86-64 and arm64
#: with 4 KiB base pages; buffers from this size on are backed by them.
HUGE_PAGE_BYTES = 2 << 20

_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

ThpMode = Literal["always", "madvise", "never", "unavailable"]


@functools.cache
def transparent_huge_pages() -> ThpMode:
    """Which transparent huge page mode the kernel applies to this process's
    large receive buffers.

    ``"always"``: every large anonymous mapping may get huge pages;
    ``"madvise"``: those that ask for them do (the receive buffers ask);
    ``"never"``: none do; ``"unavailable"``: the kernel has no THP (or no
    ``/sys`` to tell). Read once per process: the mode is the machine's.
    """
    try:
        with open(_THP_ENABLED, encoding="ascii") as file:
            text = file.read()
    except OSError:
        return "unavailable"
    # The file lists every mode with the one in force in brackets:
    # "always [madvise] never".
    modes: tuple[ThpMode, ...] = ("always", "madvise", "never")
    for mode in modes:
        if f"[{mode}]" in text:
            return mode
    return "unavailable"


def huge_page_empty(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A writable uint8 array of ``nbytes`` that starts on a 2 MiB boundary,
    its memory advised to be backed by huge pages (contents undefined).

    The array owns its memory through its base (an anonymous ``mmap``),
    which is unmapped when the last view of it is gone.
    """
    whole = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    # The mapping starts on a (4 KiB) page boundary; one huge page of slack
    # lets the buffer start on a 2 MiB boundary, which THP requires.
    # Private: a shared anonymous mapping is shmem, which follows
    # shmem_enabled instead and never gets huge pages from madvise.
    mapping = mmap.mmap(-1, whole + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mapping, dtype=np.uint8)
    offset = -raw.ctypes.data % HUGE_PAGE_BYTES
    if whole and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, whole)
    return raw[offset : offset + nbytes]
