"""Gradient compressors: round trips, error bounds, error feedback."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from tensorwire import ps, serde
from tensorwire.errors import ConfigError, InvalidArgument
from tensorwire.ps._compress import compressor_for, decompress


def grad(n: int = 1000, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def round_trip(compressor: ps.Compressor, g: np.ndarray) -> np.ndarray:
    """Compress, send through the codec as the wire would, decode."""
    payload = compressor.compress(g)
    payload["codec"] = compressor.name
    header, buffers = serde.encode(payload)
    return decompress(serde.decode(header, buffers), g.size, g.dtype)


def test_none_is_exact() -> None:
    g = grad()
    np.testing.assert_array_equal(round_trip(compressor_for("none"), g), g)


def test_fp16_is_within_half_precision() -> None:
    g = grad()
    np.testing.assert_allclose(round_trip(compressor_for("fp16"), g), g, rtol=2**-11)


def test_bf16_matches_ml_dtypes_rounding() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    g = np.concatenate([grad(), np.float32([0.0, -0.0, np.inf, -np.inf, 1e-40, 3.4e38])])
    expected = g.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(round_trip(compressor_for("bf16"), g), expected)


def test_bf16_keeps_nan() -> None:
    out = round_trip(compressor_for("bf16"), np.float32([np.nan, 1.0]))
    assert np.isnan(out[0]) and out[1] == 1.0


def test_int8_error_is_at_most_half_a_step() -> None:
    g = grad()
    out = round_trip(compressor_for("int8"), g)
    step = np.abs(g).max() / 127
    assert np.abs(out - g).max() <= step / 2 + 1e-7
    assert out.dtype == np.float32


def test_int8_of_zeros_and_refuses_nan() -> None:
    np.testing.assert_array_equal(round_trip(compressor_for("int8"), np.zeros(5, np.float32)), 0)
    with pytest.raises(InvalidArgument):
        compressor_for("int8").compress(np.float32([1.0, np.nan]))


def test_topk_keeps_the_largest_entries() -> None:
    g = grad()
    out = round_trip(ps.TopK(ratio=0.05), g)
    kept = np.flatnonzero(out)
    assert len(kept) == 50
    np.testing.assert_array_equal(out[kept], g[kept])
    assert np.abs(g[kept]).min() >= np.abs(np.delete(g, kept)).max()
    assert np.count_nonzero(round_trip(ps.TopK(ratio=1e-9), g)) == 1


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_error_feedback_tracks_the_true_sum(name: str) -> None:
    compressor = ps.TopK(ratio=0.1) if name == "topk" else compressor_for(name)
    feedback = ps.ErrorFeedback(compressor)
    rng = np.random.default_rng(1)
    true_sum = np.zeros(500, np.float32)
    sent_sum = np.zeros(500, np.float32)
    plain_sum = np.zeros(500, np.float32)
    for _ in range(100):
        g = rng.standard_normal(500).astype(np.float32) + 0.5
        true_sum += g
        payload = feedback.compress("k", g)
        sent_sum += decompress(payload, 500, np.dtype(np.float32))
        plain = compressor.compress(g)
        plain_sum += compressor.decompress(plain, 500, np.dtype(np.float32))
    residual = feedback.residuals["k"]
    # What was sent plus what is still held back is exactly what came in.
    np.testing.assert_allclose(sent_sum + residual, true_sum, rtol=1e-4, atol=1e-3)
    with_feedback = np.abs(sent_sum - true_sum).mean()
    without = np.abs(plain_sum - true_sum).mean()
    assert with_feedback < without / 2
    # The held-back part stays bounded instead of growing with the step count.
    assert np.abs(residual).max() < 0.1 * np.abs(true_sum).max()


def test_lossless_compressors_keep_no_residual() -> None:
    feedback = ps.ErrorFeedback(compressor_for("fp16"))
    feedback.compress("k", grad())
    assert feedback.residuals == {}


def test_a_custom_compressor_registers_and_decodes() -> None:
    class Halves(ps.Compressor):
        name: ClassVar[str] = "test-halves"

        def compress(self, grad: np.ndarray) -> dict[str, Any]:
            return {"data": grad / 2}

        @staticmethod
        def decompress(payload: dict[str, Any], size: int, dtype: np.dtype[Any]) -> np.ndarray:
            out: np.ndarray = np.asarray(payload["data"]) * 2
            return out

    ps.register_compressor(Halves)
    ps.register_compressor(Halves)  # again: harmless
    g = grad()
    np.testing.assert_allclose(round_trip(Halves(), g), g)
    with pytest.raises(ConfigError):
        ps.register_compressor(type("Other", (Halves,), {"decompress": staticmethod(
            lambda payload, size, dtype: payload["data"])}))


def test_bad_payloads_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument):
        decompress({"codec": "zstd-magic"}, 3, np.dtype(np.float32))
    with pytest.raises(InvalidArgument):
        decompress({"codec": "none", "data": np.zeros(4, np.float32)}, 3, np.dtype(np.float32))
    with pytest.raises(InvalidArgument):
        decompress({"codec": "topk", "index": np.uint32([7]), "values": np.float32([1])}, 3,
                   np.dtype(np.float32))
    with pytest.raises(InvalidArgument):
        decompress({"codec": "int8"}, 3, np.dtype(np.float32))


def test_unknown_compression_name() -> None:
    with pytest.raises(ConfigError):
        compressor_for("lz4")
    with pytest.raises(ConfigError):
        ps.TopK(ratio=0)
