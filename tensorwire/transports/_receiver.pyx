"""The base of a message receiver that a connection calls without a Python
call (issue 22).

``Connection.deliver_to(receiver)`` takes any callable, called with each
message's frames. A receiver that is a ``MessageReceiver`` is also called
so, but the compiled transports hand it each message by a C call of its
``receive`` instead (the RPC connection driver, on every message of every
call).
"""

cdef class MessageReceiver:
    """A receiver of a connection's messages (see the module); a subclass
    implements ``receive``."""

    cdef void receive(self, list frames) except *:
        """Take one message, its frames in a list."""
        raise NotImplementedError(f"{type(self).__name__} does not implement receive()")

    def __call__(self, frames):
        """``receive(frames)``, for a caller in Python."""
        self.receive(frames if type(frames) is list else list(frames))
