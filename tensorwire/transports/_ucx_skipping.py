"""Skipping a refused ucx:// message (``Connection.refuse_oversized``):
its frames are received and dropped, so the next message matches as usual.

A part of :class:`~._ucx_connection.UCXConnection`, in a module of its own:
the connection's state it works on is declared below for the type checker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import LimitExceededError, TensorwireError
from ._delivery import call_consumer
from ._limit_checks import refused_head
from ._ucx_messages import Announced
from ._ucx_runtime import Runtime, translate, ucx_error_name
from .config import TransportConfig

__all__ = ("RefusedSkipping",)

logger = logging.getLogger(__name__)


class RefusedSkipping:
    """The refused-message skipping of :class:`UCXConnection`."""

    if TYPE_CHECKING:
        _rt: Runtime | None
        _config: TransportConfig
        _loop: asyncio.AbstractEventLoop
        _header_view: memoryview
        _tag_frame_in: Any
        _peer_address: str
        _error: TensorwireError | None
        _busy: bool
        _frames_left: int
        _received: int
        _peer_sent: int | None
        _last_activity: float | None
        _on_refused: Callable[[LimitExceededError], None] | None
        _skipping: LimitExceededError | None
        _skip_head: bytearray | None
        bytes_received: int
        messages_received: int

        def _post_recv(self, rt: Runtime, array: Any, tag: Any) -> Any: ...
        def _fail(self, error: TensorwireError) -> None: ...
        def _pump(self) -> None: ...
        def _peer_done(self) -> None: ...

    def _skip(self, error: LimitExceededError) -> bool:
        """Take the refused message's frames without keeping them: UCX
        consumes a message received into too small a buffer (it reports
        truncation), the sender's side completes normally, and the next
        message matches as usual. False: the message cannot be skipped."""
        rt = self._rt
        try:
            announced = Announced(self._header_view, self._config.limits, check=False)
        except TensorwireError:
            return False  # malformed, or too many frames
        if rt is None:
            return False
        infos = announced.infos
        keep = refused_head([info.nbytes for info in infos], self._config.limits)
        if keep is not None:
            inline = announced.inline.get(0)
            if inline is not None:
                error.head = bytes(inline)
                keep = None
            elif keep == 0:
                error.head = b""
                keep = None
            elif infos[0].device != "cpu":
                keep = None
        head = bytearray(keep) if keep else None
        self._skipping = error
        self.bytes_received += sum(info.nbytes for info in infos)
        left = 0
        for info in infos:
            if info.index in announced.inline or not info.nbytes:
                continue
            buffer = head if info.index == 0 and head is not None else bytearray(1)
            array = rt.Array(buffer)
            request = self._post_recv(rt, array, self._tag_frame_in)
            if request is None:
                return True  # failed the connection
            if request.completed:
                if not self._skipped_frame(request):
                    return True
            else:
                left += 1
                rt.watch(request, array, self._on_skipped_frame)
        if head is not None:
            self._skip_head = head
        if left:
            self._busy = True
            self._frames_left = left
        else:
            self._skip_finished()
        return True

    def _skipped_frame(self, request: Any) -> bool:
        try:
            request.check_error()
        except Exception as exc:
            if ucx_error_name(exc) != "UCXMessageTruncatedError":
                self._fail(translate(self._rt, exc, f"receive from {self._peer_address} failed"))
                return False
        return True

    def _on_skipped_frame(self, request: Any) -> None:
        if self._error is not None or request is None or not self._skipped_frame(request):
            return
        self._last_activity = self._loop.time()
        self._frames_left -= 1
        if self._frames_left == 0:
            self._busy = False
            self._skip_finished()
            self._pump()

    def _skip_finished(self) -> None:
        error, self._skipping = self._skipping, None
        assert error is not None
        head, self._skip_head = self._skip_head, None
        if head is not None:
            error.head = bytes(head)
        self._received += 1
        self.messages_received += 1
        logger.info("skipped a message from %s: %s", self._peer_address, error)
        assert self._on_refused is not None
        failure = call_consumer(self._on_refused, error, "refusal handler", self._peer_address)
        if failure is not None:
            self._fail(failure)
            return
        if self._peer_sent is not None and self._received >= self._peer_sent:
            self._peer_done()
