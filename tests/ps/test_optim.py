"""Server-side optimizers against NumPy references and against torch.optim."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tensorwire import ps
from tensorwire.errors import ConfigError
from tensorwire.ps._optim import optimizer_from_wire

STEPS = 6


def data(seed: int = 0) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    param = rng.standard_normal(50)
    grads = [rng.standard_normal(50) for _ in range(STEPS)]
    return param, grads


def run(opt: ps.Optimizer, param: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    state = opt.init_state(param)
    for t, grad in enumerate(grads, 1):
        before = param.copy()
        param, state = opt.step(param, grad, state, t)
        assert param is not before
    return param


def sgd_reference(p: np.ndarray, grads: list[np.ndarray], lr: float, momentum: float,
                  wd: float, nesterov: bool) -> np.ndarray:
    p = p.copy()
    buf = None
    for g in grads:
        d = g + wd * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * d
    return p


def adam_reference(p: np.ndarray, grads: list[np.ndarray], lr: float, b1: float, b2: float,
                   eps: float, wd: float) -> np.ndarray:
    p = p.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        d = g + wd * p
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def adagrad_reference(p: np.ndarray, grads: list[np.ndarray], lr: float, eps: float,
                      wd: float, init: float) -> np.ndarray:
    p = p.copy()
    s = np.full_like(p, init)
    for g in grads:
        d = g + wd * p
        s = s + d * d
        p = p - lr * d / (np.sqrt(s) + eps)
    return p


@pytest.mark.parametrize(("momentum", "wd", "nesterov"),
                         [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.01, True),
                          (0.5, 0.1, False)])
def test_sgd_matches_reference(momentum: float, wd: float, nesterov: bool) -> None:
    param, grads = data()
    got = run(ps.SGD(lr=0.1, momentum=momentum, weight_decay=wd, nesterov=nesterov),
              param, grads)
    np.testing.assert_allclose(got, sgd_reference(param, grads, 0.1, momentum, wd, nesterov),
                               rtol=1e-12)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_matches_reference(wd: float) -> None:
    param, grads = data(1)
    got = run(ps.Adam(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=wd), param, grads)
    np.testing.assert_allclose(got, adam_reference(param, grads, 0.01, 0.8, 0.99, 1e-6, wd),
                               rtol=1e-12)


def test_adagrad_matches_reference() -> None:
    param, grads = data(2)
    got = run(ps.Adagrad(lr=0.05, weight_decay=0.01, initial_accumulator=0.1), param, grads)
    np.testing.assert_allclose(got, adagrad_reference(param, grads, 0.05, 1e-10, 0.01, 0.1),
                               rtol=1e-12)


def torch_run(name: str, kwargs: dict[str, Any], param: np.ndarray,
              grads: list[np.ndarray]) -> np.ndarray:
    torch = pytest.importorskip("torch")
    tensor = torch.tensor(param.copy(), requires_grad=True)
    opt = getattr(torch.optim, name)([tensor], **kwargs)
    for g in grads:
        tensor.grad = torch.tensor(g)
        opt.step()
    result: np.ndarray = tensor.detach().numpy()
    return result


@pytest.mark.parametrize(("ours", "name", "kwargs"), [
    (ps.SGD(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True), "SGD",
     {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True}),
    (ps.Adam(lr=0.01, weight_decay=0.02), "Adam", {"lr": 0.01, "weight_decay": 0.02}),
    (ps.Adagrad(lr=0.05), "Adagrad", {"lr": 0.05}),
])
def test_matches_torch_optim(ours: ps.Optimizer, name: str, kwargs: dict[str, Any]) -> None:
    param, grads = data(3)
    np.testing.assert_allclose(run(ours, param, grads), torch_run(name, kwargs, param, grads),
                               rtol=1e-10, atol=1e-12)


def test_float32_stays_float32() -> None:
    param = np.ones(4, np.float32)
    for opt in (ps.SGD(lr=0.1, momentum=0.9), ps.Adam(), ps.Adagrad()):
        state = opt.init_state(param)
        new, state = opt.step(param, np.full(4, 0.5, np.float32), state, 1)
        assert new.dtype == np.float32
        assert all(a.dtype == np.float32 for a in state.values())


def test_aggregate_returns_the_gradient() -> None:
    param = np.ones(3)
    new, _ = ps.Aggregate().step(param, np.arange(3.0), {}, 1)
    np.testing.assert_array_equal(new, [0, 1, 2])


@pytest.mark.parametrize("opt", [ps.SGD(lr=0.1, momentum=0.9, nesterov=True),
                                 ps.Adam(lr=3e-4), ps.Adagrad(), ps.Aggregate()])
def test_wire_round_trip(opt: ps.Optimizer) -> None:
    assert optimizer_from_wire(opt.to_wire()) == opt


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        ps.SGD(lr=-1)
    with pytest.raises(ConfigError):
        ps.SGD(lr=0.1, nesterov=True)
    with pytest.raises(ConfigError):
        ps.Adam(beta1=1.0)
    with pytest.raises(ConfigError):
        ps.Adagrad(eps=0)
    with pytest.raises(ConfigError):
        optimizer_from_wire({"kind": "lamb"})
    with pytest.raises(ConfigError):
        optimizer_from_wire({"kind": "sgd", "lr": 0.1, "betas": 3})


@pytest.mark.parametrize("opt", [ps.SGD(lr=0.1), ps.SGD(lr=0.1, momentum=0.9, weight_decay=0.1),
                                 ps.Adam(lr=0.01, weight_decay=0.1), ps.Adagrad(),
                                 ps.Aggregate()])
def test_scale_is_the_same_as_a_scaled_gradient(opt: ps.Optimizer) -> None:
    param, grads = data(4)
    state_a = state_b = opt.init_state(param)
    a = b = param
    for t, g in enumerate(grads, 1):
        a, state_a = opt.step(a, g, state_a, t, scale=1 / 3)
        b, state_b = opt.step(b, g / 3, state_b, t)
    np.testing.assert_allclose(a, b, rtol=1e-12)
    assert a.dtype == param.dtype
