"""Server-side update rules: SGD, Adam, Adagrad, or pure aggregation.

Pure array arithmetic, no I/O, with the module of the chunk (NumPy, or CuPy
for a chunk on the GPU). The formulas are PyTorch's (``torch.optim.SGD``,
``Adam``, ``Adagrad`` with their default flags), so a model trained through
the parameter server behaves like the same model trained in one process.

Every update is *out of place*: ``step`` returns new arrays and never writes
into the old ones. A shard may still be sending the old parameters to a
worker (the codec sends views of them, no copy), and a checkpoint may be
writing them from another thread; neither sees a half-updated tensor.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from ..errors import ConfigError
from ._arrays import array_module

__all__ = ("SGD", "Adagrad", "Adam", "Aggregate", "Optimizer", "optimizer_from_wire")

Array = np.ndarray[Any, Any]
State = dict[str, Array]


def _check(owner: object, name: str, value: float, *, low: float = 0.0,
           high: float | None = None, strict: bool = False) -> None:
    bad = value <= low if strict else value < low
    if high is not None:
        bad = bad or value >= high
    if bad or not np.isfinite(value):
        raise ConfigError(f"{type(owner).__name__}.{name} is out of range: {value!r}")


def _scaled(grad: Array, scale: float, dtype: np.dtype[Any]) -> Array:
    """``scale * grad`` in ``dtype``; ``grad`` itself (not a copy) when scale is 1."""
    if scale == 1.0:
        return grad.astype(dtype, copy=False)
    scaled: Array = array_module(grad).multiply(grad, scale, dtype=dtype)
    return scaled


class Optimizer(abc.ABC):
    """An update rule a shard applies to each chunk it holds.

    Subclasses are frozen dataclasses; ``kind`` names them on the wire.
    """

    kind: ClassVar[str]

    #: When False the shard keeps the summed gradient instead of parameters.
    updates_parameters: ClassVar[bool] = True

    def init_state(self, param: Array) -> State:
        """Fresh per-chunk state (momentum buffers, moments) for ``param``."""
        return {}

    @abc.abstractmethod
    def step(self, param: Array, grad: Array, state: State, step: int, *,
             scale: float = 1.0) -> tuple[Array, State]:
        """The new parameters and state after one update with ``scale * grad``.

        ``step`` counts updates from 1. ``scale`` folds the shard's averaging
        into the update instead of a pass of its own. Never writes into its
        arguments.
        """

    def to_wire(self) -> dict[str, Any]:
        """A plain dict that travels through the codec and into checkpoints."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {"kind": self.kind, **fields}


@dataclasses.dataclass(frozen=True, slots=True)
class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov and L2 weight decay.

    ``torch.optim.SGD`` with ``dampening=0``: ``g = grad + weight_decay * p``;
    with momentum ``buf = momentum * buf + g`` (``buf = g`` at the first
    step) and ``g = buf`` (Nesterov: ``g + momentum * buf``);
    ``p = p - lr * g``.
    """

    kind: ClassVar[str] = "sgd"
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check(self, "lr", self.lr)
        _check(self, "momentum", self.momentum)
        _check(self, "weight_decay", self.weight_decay)
        if self.nesterov and self.momentum == 0:
            raise ConfigError("SGD: Nesterov momentum needs momentum > 0")

    def step(self, param: Array, grad: Array, state: State, step: int, *,
             scale: float = 1.0) -> tuple[Array, State]:
        if not self.momentum and not self.weight_decay:
            # The common case in two passes: p - lr * scale * grad.
            new = array_module(param).multiply(grad, -self.lr * scale, dtype=param.dtype)
            new += param
            return new, state
        g = _scaled(grad, scale, param.dtype)
        if self.weight_decay:
            g = g + self.weight_decay * param
        if self.momentum:
            buf = g.copy() if "momentum" not in state else self.momentum * state["momentum"] + g
            state = {"momentum": buf.astype(param.dtype, copy=False)}
            g = g + self.momentum * buf if self.nesterov else buf
        return (param - self.lr * g).astype(param.dtype, copy=False), state


@dataclasses.dataclass(frozen=True, slots=True)
class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction and L2 weight decay.

    ``torch.optim.Adam``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``p = p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)``.
    """

    kind: ClassVar[str] = "adam"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check(self, "lr", self.lr)
        _check(self, "beta1", self.beta1, high=1.0)
        _check(self, "beta2", self.beta2, high=1.0)
        _check(self, "eps", self.eps, strict=True)
        _check(self, "weight_decay", self.weight_decay)

    def init_state(self, param: Array) -> State:
        xp = array_module(param)
        return {"m": xp.zeros_like(param), "v": xp.zeros_like(param)}

    def step(self, param: Array, grad: Array, state: State, step: int, *,
             scale: float = 1.0) -> tuple[Array, State]:
        g = _scaled(grad, scale, param.dtype)
        if self.weight_decay:
            g = g + self.weight_decay * param
        m = self.beta1 * state["m"] + (1 - self.beta1) * g
        v = self.beta2 * state["v"] + (1 - self.beta2) * (g * g)
        m_hat = m / (1 - self.beta1**step)
        v_hat = v / (1 - self.beta2**step)
        new = param - self.lr * m_hat / (array_module(param).sqrt(v_hat) + self.eps)
        return new.astype(param.dtype, copy=False), {
            "m": m.astype(param.dtype, copy=False), "v": v.astype(param.dtype, copy=False)}


@dataclasses.dataclass(frozen=True, slots=True)
class Adagrad(Optimizer):
    """Adagrad (Duchi et al., 2011) with L2 weight decay.

    ``torch.optim.Adagrad`` (no learning-rate decay): ``s = s + g^2``,
    ``p = p - lr * g / (sqrt(s) + eps)``.
    """

    kind: ClassVar[str] = "adagrad"
    lr: float = 1e-2
    eps: float = 1e-10
    weight_decay: float = 0.0
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        _check(self, "lr", self.lr)
        _check(self, "eps", self.eps, strict=True)
        _check(self, "weight_decay", self.weight_decay)
        _check(self, "initial_accumulator", self.initial_accumulator)

    def init_state(self, param: Array) -> State:
        return {"sum": array_module(param).full_like(param, self.initial_accumulator)}

    def step(self, param: Array, grad: Array, state: State, step: int, *,
             scale: float = 1.0) -> tuple[Array, State]:
        g = _scaled(grad, scale, param.dtype)
        if self.weight_decay:
            g = g + self.weight_decay * param
        total = state["sum"] + g * g
        new = param - self.lr * g / (array_module(param).sqrt(total) + self.eps)
        return new.astype(param.dtype, copy=False), {"sum": total.astype(param.dtype, copy=False)}


@dataclasses.dataclass(frozen=True, slots=True)
class Aggregate(Optimizer):
    """No server-side update: a pull returns the summed gradient of the last
    step and each worker applies its own update (synchronous mode only)."""

    kind: ClassVar[str] = "aggregate"
    updates_parameters: ClassVar[bool] = False

    def step(self, param: Array, grad: Array, state: State, step: int, *,
             scale: float = 1.0) -> tuple[Array, State]:
        # A copy even at scale 1: the gradient may be the received frame, or
        # over inproc:// the worker's own array, which it will reuse.
        return array_module(param).array(_scaled(grad, scale, param.dtype), copy=True), state


_KINDS: dict[str, type[Optimizer]] = {
    cls.kind: cls for cls in (SGD, Adam, Adagrad, Aggregate)
}


def optimizer_from_wire(wire: Mapping[str, Any]) -> Optimizer:
    """Rebuild an optimizer from :meth:`Optimizer.to_wire`.

    Raises:
        ConfigError: unknown kind or invalid fields.
    """
    fields = dict(wire)
    kind = fields.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"unknown optimizer {kind!r}; known: {sorted(_KINDS)}")
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ConfigError(f"optimizer {kind!r}: {exc}") from None
