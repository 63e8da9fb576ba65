"""Large receive buffers are backed by transparent huge pages where the
kernel offers them, and stay zero-copy: the decoded array is the buffer
the frame was received into."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tensorwire import serde
from tensorwire.transports import connect, listen, transparent_huge_pages
from tensorwire.transports._huge_pages import HUGE_PAGE_BYTES, huge_page_empty

from .test_conformance import echo

MiB = 1 << 20


def address(array: Any) -> int:
    return int(np.asarray(array).ctypes.data)


def anon_huge_kib(at: int) -> int:
    """AnonHugePages (kB) of the mapping of this process that holds ``at``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= at < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {at:#x}")


def huge_pages_offered() -> None:
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {mode!r} on this kernel")


def test_the_mode_is_the_one_the_kernel_marks() -> None:
    mode = transparent_huge_pages()
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        assert mode == "unavailable"
        return
    assert f"[{mode}]" in path.read_text()


def test_a_huge_page_buffer_is_aligned_writable_and_faults_in_huge_pages() -> None:
    huge_pages_offered()
    buffer = huge_page_empty(4 * MiB + 5)
    assert buffer.shape == (4 * MiB + 5,) and buffer.flags.writeable
    assert address(buffer) % HUGE_PAGE_BYTES == 0
    buffer[:] = 1
    assert anon_huge_kib(address(buffer)) >= 2048


async def test_a_large_frame_lands_in_huge_pages_and_decodes_in_place() -> None:
    huge_pages_offered()
    sent = np.arange(2 * MiB, dtype=np.float32)  # 8 MiB
    header, buffers = serde.encode(sent)
    listener = await listen("tcp://127.0.0.1:0", echo)
    try:
        async with await connect(listener.address) as conn:
            await conn.send([header, *buffers])
            frames = await conn.recv()
    finally:
        await listener.close()
    frame = frames[1]
    received = serde.decode(frames[0], frames[1:])
    np.testing.assert_array_equal(received, sent)
    # Zero-copy: the array is the receive buffer itself.
    assert address(received) == address(frame)
    assert address(frame) % HUGE_PAGE_BYTES == 0
    # Written by the receive: the kernel backed it with huge pages.
    assert anon_huge_kib(address(frame)) >= 2048
