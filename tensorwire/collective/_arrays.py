"""What collectives need of an array: a flat view, its bytes, a reduction.

NumPy arrays, CuPy arrays and torch tensors (CPU or CUDA) all become a
:class:`Flat`: a one-dimensional view of the caller's memory (never a copy)
with the array module that computes on it. CuPy and torch are imported only
when such an array is passed.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from ..errors import InvalidArgument

__all__ = ("BITWISE", "Flat", "ReduceOp", "c_ordered", "check_op", "flatten", "output",
           "same_memory")


class ReduceOp(enum.Enum):
    """How ``allreduce``, ``reduce`` and ``reduce_scatter`` combine values."""

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    #: Bitwise and, or, exclusive or: integer and bool dtypes only.
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


_UFUNC = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.PRODUCT: "multiply",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}

#: torch's functions for the reductions, where they beat NumPy's (16-bit floats).
_TORCH_FUNC = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.PRODUCT: "mul",
}

#: The reductions that need an integer (or bool) dtype.
BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})


class Flat:
    """A flat, contiguous view of a caller's array and how to compute on it."""

    __slots__ = ("array", "device", "order", "original", "shape", "xp")

    def __init__(self, array: Any, xp: Any, original: Any, shape: tuple[int, ...],
                 order: str, device: str) -> None:
        self.array = array
        self.xp = xp
        self.original = original
        self.shape = shape
        self.order = order
        self.device = device

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    @property
    def size(self) -> int:
        return int(self.array.size)

    @property
    def itemsize(self) -> int:
        return int(self.array.dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def describe(self) -> str:
        """``<f4[3, 4]C@cpu``: what every rank must agree on."""
        return f"{self.array.dtype.str}{list(self.shape)}{self.order}@{self.device}"

    def empty(self, count: int) -> Any:
        """A new flat array of ``count`` items of this dtype, on this device."""
        return self.xp.empty(count, dtype=self.array.dtype)

    def allocate(self, shape: tuple[int, ...]) -> Flat:
        """A new C-ordered array of ``shape``, of the caller's kind, dtype and device."""
        if _module_of(self.original) == "torch":
            import torch

            tensor = torch.empty(shape, dtype=self.original.dtype, device=self.original.device)
            return flatten(tensor)
        return flatten(self.xp.empty(shape, dtype=self.array.dtype))

    def frame(self, part: Any) -> Any:
        """``part`` (a slice of a flat array) as a uint8 frame, no copy."""
        return part.view(self.xp.uint8)

    def reduce_into(self, op: ReduceOp, dst: Any, src: Any, *, src_first: bool = False) -> None:
        """``dst = op(dst, src)`` in place, or ``op(src, dst)`` with ``src_first``.

        The order of the operands does not change a value, but it can change
        its bits: which NaN's sign and payload survives an addition, which
        zero ``minimum(0.0, -0.0)`` returns. Ranks that combine the same
        partial results in the same order get the same bits.

        Returns once the reduction has run, also on a GPU, where the kernel
        would otherwise still read ``src`` while the next message lands in
        it (the algorithms receive segment after segment into one scratch).
        """
        if op in _TORCH_FUNC and self.device == "cpu" and _module_of(self.original) == "torch" \
                and str(self.original.dtype) in ("torch.float16", "torch.bfloat16"):
            # NumPy computes on float16 (and ml_dtypes on bfloat16) element by
            # element, ~20x slower than torch's vectorized kernels on the same
            # memory: a compressed gradient bucket is reduced in these types.
            self._torch_reduce_into(op, dst, src, src_first)
            return
        ufunc = getattr(self.xp, _UFUNC[op])
        if src_first:
            ufunc(src, dst, out=dst)
        else:
            ufunc(dst, src, out=dst)
        self.sync()

    def _torch_reduce_into(self, op: ReduceOp, dst: Any, src: Any, src_first: bool) -> None:
        import torch

        dtype = self.original.dtype

        def view(part: Any) -> Any:
            return torch.from_numpy(part.view(np.uint8)).view(dtype)

        out, other = view(dst), view(src)
        func = getattr(torch, _TORCH_FUNC[op])
        if src_first:
            func(other, out, out=out)
        else:
            func(out, other, out=out)

    def divide(self, part: Any, by: int) -> None:
        """``part /= by`` in place (``ReduceOp.AVG``); returns once it has run."""
        self.xp.divide(part, by, out=part)
        self.sync()

    def sync(self) -> None:
        """Wait for device work on the data, so a send reads finished values."""
        if self.device == "cuda":
            self.xp.cuda.get_current_stream().synchronize()

    def result(self) -> Any:
        """What an in-place operation returns: the caller's own object."""
        return self.original


def _module_of(x: Any) -> str:
    return type(x).__module__.partition(".")[0]


def flatten(x: Any, *, writable: bool = True, name: str = "array") -> Flat:
    """A :class:`Flat` view of ``x`` (NumPy, CuPy or torch), without copying.

    Raises:
        InvalidArgument: ``x`` is not an array, not contiguous, or read-only
            where the operation writes to it.
    """
    module = _module_of(x)
    if isinstance(x, np.ndarray):
        return _from_numpy(x, x, writable, name, "cpu")
    if module == "torch":
        return _from_torch(x, writable, name)
    if module == "cupy":
        return _from_cupy(x, x, name)
    raise InvalidArgument(
        f"{name} must be a NumPy array, a CuPy array or a torch tensor, got {type(x).__name__}"
    )


def _order(x: Any, name: str) -> str:
    if x.flags.c_contiguous:
        return "C"
    if x.flags.f_contiguous:
        return "F"
    raise InvalidArgument(f"{name} must be contiguous (C or Fortran order)")


def _from_numpy(x: np.ndarray[Any, Any], original: Any, writable: bool, name: str,
                device: str) -> Flat:
    order = _order(x, name)
    if writable and not x.flags.writeable:
        raise InvalidArgument(f"{name} is read-only and this operation writes to it")
    if x.dtype.hasobject or x.dtype.fields is not None:
        raise InvalidArgument(f"{name} must have a numeric dtype, got {x.dtype}")
    flat = x.reshape(-1, order="A") if order == "C" else x.ravel(order="F")
    return Flat(flat, np, original, tuple(x.shape), order, device)


def _from_cupy(x: Any, original: Any, name: str) -> Flat:
    import cupy

    order = _order(x, name)
    flat = x.reshape(-1) if order == "C" else x.ravel(order="F")
    # The operation reads the array from the host's side of the stream:
    # what was queued before the call must have finished.
    cupy.cuda.get_current_stream().synchronize()
    return Flat(flat, cupy, original, tuple(x.shape), order, "cuda")


def _from_torch(x: Any, writable: bool, name: str) -> Flat:
    import torch

    if not x.is_contiguous():
        raise InvalidArgument(f"{name} must be a contiguous tensor")
    tensor = x.detach()
    if tensor.is_cuda:
        import cupy

        torch.cuda.current_stream(tensor.device).synchronize()
        return _from_cupy(cupy.asarray(tensor), x, name)
    if tensor.dtype == torch.bfloat16:
        # NumPy has no bfloat16; ml_dtypes gives it arithmetic on the same bytes.
        import ml_dtypes

        array = tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        array = tensor.numpy()
    return _from_numpy(array, x, writable, name, "cpu")


def check_op(op: ReduceOp | str, flat: Flat) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` that can reduce ``flat``.

    Raises:
        InvalidArgument: an unknown reduction, AVG of integers, or a bitwise
            reduction of floating-point values.
    """
    try:
        op = ReduceOp(op)
    except ValueError:
        raise InvalidArgument(f"unknown reduction {op!r}") from None
    if op is ReduceOp.AVG and flat.dtype.kind not in "fc" and flat.dtype.name != "bfloat16":
        raise InvalidArgument(f"ReduceOp.AVG needs a floating dtype, got {flat.dtype}")
    if op in BITWISE and flat.dtype.kind not in "iub":
        raise InvalidArgument(f"ReduceOp.{op.name} needs an integer or bool dtype, "
                              f"got {flat.dtype}")
    return op


def c_ordered(flat: Flat, operation: str) -> Flat:
    """``flat`` if its array is C-ordered: operations that stack or split
    arrays along their first axis index them in C order.

    Raises:
        InvalidArgument: a Fortran-ordered array.
    """
    if flat.order != "C" and len(flat.shape) > 1:
        raise InvalidArgument(f"{operation} needs C-ordered arrays (np.ascontiguousarray)")
    return flat


def output(like: Flat, out: Any, shape: tuple[int, ...]) -> Flat:
    """``out``, or a new array of ``like``'s kind, checked as a C-ordered ``shape`` result.

    Raises:
        InvalidArgument: ``out`` has another shape, dtype or order.
    """
    target = like.allocate(shape) if out is None else flatten(out, name="out")
    if target.shape != shape or target.dtype != like.dtype or target.order != "C":
        raise InvalidArgument(f"out must be a C-ordered {like.dtype} array of shape {shape}")
    return target


def same_memory(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` start at the same address."""
    try:
        if hasattr(a, "__cuda_array_interface__"):
            return bool(a.__cuda_array_interface__["data"][0]
                        == b.__cuda_array_interface__["data"][0])
        return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])
    except (AttributeError, KeyError):
        return False
