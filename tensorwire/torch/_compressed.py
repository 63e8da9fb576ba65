"""A compressed allreduce with error feedback, for the DDP hook.

Two ways, by codec:

- ``fp16`` / ``bf16`` are a cast: the corrected gradient is cast down and
  *reduced in that precision* by the group's own algorithms (ring, tree,
  hierarchical), so every message is half the size (as torch's
  ``fp16_compress_hook``). The sum of a few ranks' half-precision values
  stays well inside fp16's range for gradients.
- every other codec (``int8``, ``fp8``, ``topk``) has payloads that do not
  add up: each rank's payload is allgathered and every rank decodes all of
  them and adds them in rank order (so all ranks get the same bits).

Both keep error feedback per bucket (Seide et al. 2014; Stich et al. 2018):
what compression dropped from a step's gradient is added to the next
step's, so the sum of what is applied tracks the sum of true gradients.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..collective import Algorithm, Group, ReduceOp
from ..ps import Compressor, ErrorFeedback
from ..ps._compress import decompress

__all__ = ("CompressedAllreduce",)

Array = np.ndarray[Any, Any]

#: Codecs that are a cast to a smaller float type, reduced as such.
_CASTS = ("fp16", "bf16")


class CompressedAllreduce:
    """Average float32 buckets over a group through ``codec``, keeping residuals."""

    def __init__(self, codec: Compressor, *, algorithm: Algorithm = "auto",
                 timeout: float | None = None) -> None:
        self.codec = codec
        self.algorithm: Algorithm = algorithm
        self.timeout = timeout
        self._feedback = ErrorFeedback(codec)
        self._residuals: dict[int, torch.Tensor] = {}
        self._low: dict[int, torch.Tensor] = {}

    async def run(self, group: Group, index: int, bucket: torch.Tensor) -> torch.Tensor:
        """Average ``bucket`` (a contiguous CPU float tensor) in place; returns
        it (the hook copies a CUDA bucket to host memory first)."""
        grad = bucket.detach().numpy()
        if self.codec.name in _CASTS:
            total = await self._cast_reduce(group, index, grad)
        else:
            total = await self._gather_reduce(group, index, grad)
        np.divide(total, group.world_size, out=grad, casting="unsafe")  # total may be grad
        return bucket

    async def _cast_reduce(self, group: Group, index: int, grad: Array) -> Array:
        # In torch: its casts and 16-bit arithmetic are vectorized, NumPy's
        # go element by element (several times slower on a large bucket).
        # Every step reuses the bucket's residual and 16-bit buffer, in
        # place: fresh tensors of a large bucket's size cost more in page
        # faults than the halved bytes save on the wire.
        g = torch.from_numpy(grad)
        residual = self._residuals.get(index)
        low = self._low.get(index)
        if residual is None or low is None or residual.shape != g.shape:
            # The first step, or DDP rebuilt its buckets: the old residual
            # belongs to another layout.
            residual = self._residuals[index] = g.clone()
            low = self._low[index] = torch.empty(
                g.shape, dtype=torch.float16 if self.codec.name == "fp16" else torch.bfloat16)
        else:
            residual.add_(g)  # the corrected gradient
        low.copy_(residual)
        residual.sub_(low)  # what the cast dropped waits for the next step
        await group.allreduce(low, ReduceOp.SUM, algorithm=self.algorithm,
                              timeout=self.timeout)
        g.copy_(low)
        return grad

    async def _gather_reduce(self, group: Group, index: int, grad: Array) -> Array:
        # ErrorFeedback keeps residuals only for codecs that ask for it;
        # every codec here is lossy, and a plain float copy is cheap.
        key = f"bucket{index}"
        residual = self._feedback.residuals.get(key)
        if residual is not None and residual.shape != grad.shape:
            # DDP rebuilt its buckets after the first step: the old residual
            # belongs to another layout.
            del self._feedback.residuals[key]
        payload = self._feedback.compress(key, grad)
        keys = sorted(k for k in payload if k != "codec")
        # Every allgather of the bucket is queued before the first await, so
        # that buckets in flight together queue theirs in the same order on
        # every rank.
        pending = {}
        for key in keys:
            value = payload[key]
            array = (np.ascontiguousarray(value) if isinstance(value, np.ndarray)
                     else np.array([value], dtype=np.float64))
            pending[key] = group.allgather(array, algorithm=self.algorithm,
                                           timeout=self.timeout)
        parts = {key: await future for key, future in pending.items()}
        total = np.zeros_like(grad)
        for rank in range(group.world_size):
            theirs: dict[str, Any] = {"codec": payload["codec"]}
            for key in keys:
                got = parts[key][rank]
                theirs[key] = got if isinstance(payload[key], np.ndarray) else float(got[0])
            total += decompress(theirs, grad.size, grad.dtype)
        return total
