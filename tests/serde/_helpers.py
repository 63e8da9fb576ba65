from __future__ import annotations

from typing import Any

import numpy as np

from tensorwire import serde


def transport_buffers(buffers: list[Any]) -> list[np.ndarray[Any, Any]]:
    """What a transport hands the decoder: fresh, aligned, writable uint8 arrays."""
    out = []
    for buf in buffers:
        arr = np.empty(memoryview(buf).nbytes, dtype=np.uint8)
        arr[:] = np.frombuffer(buf, dtype=np.uint8)
        out.append(arr)
    return out


def roundtrip(value: Any, **kwargs: Any) -> Any:
    header, buffers = serde.Encoder(**kwargs).encode(value)
    return serde.Decoder().decode(header, transport_buffers(buffers))
