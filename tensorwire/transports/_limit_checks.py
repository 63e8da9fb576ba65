"""Checking an announced message against ``Limits`` before anything is
allocated for it, and what is kept of a refused one."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LimitExceededError
from .config import Limits

__all__ = ("HEAD_MAX", "check_frame_count", "check_limits", "refused_head")

#: The largest first frame kept from a refused message (``LimitExceededError.head``).
HEAD_MAX = 64 * 1024


def refused_head(sizes: Sequence[int], limits: Limits) -> int | None:
    """The size of a refused message's first frame if it is to be kept."""
    if sizes and sizes[0] <= HEAD_MAX and sizes[0] <= limits.max_frame_bytes:
        return sizes[0]
    return None


def check_frame_count(nframes: int, limits: Limits) -> None:
    """Refuse a message announced with more frames than ``limits`` allow.

    Raises:
        LimitExceededError: too many frames.
    """
    if nframes > limits.max_frames:
        raise LimitExceededError(
            f"message of {nframes} frames exceeds the limit of {limits.max_frames}"
        )


def check_limits(sizes: Sequence[int], limits: Limits) -> None:
    """Refuse an announced message that exceeds ``limits``, before allocating.

    Raises:
        LimitExceededError: too many frames, a frame or the message too large.
    """
    check_frame_count(len(sizes), limits)
    total = 0
    for size in sizes:
        if size > limits.max_frame_bytes:
            raise LimitExceededError(
                f"frame of {size} bytes exceeds the limit of {limits.max_frame_bytes}"
            )
        total += size
    if total > limits.max_message_bytes:
        raise LimitExceededError(
            f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}"
        )
