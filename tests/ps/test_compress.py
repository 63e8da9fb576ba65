"""Gradient compressors: round trips, error bounds, error feedback."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

from tensorwire import ps, serde
from tensorwire.errors import ConfigError, InvalidArgument
from tensorwire.ps import _compress as ps_compress
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


FP8 = [("fp8_e4m3", "float8_e4m3fn", 448.0, 3), ("fp8_e5m2", "float8_e5m2", 57344.0, 2)]


@pytest.mark.parametrize(("name", "fmt", "fmax", "mantissa"), FP8)
def test_fp8_matches_ml_dtypes_with_a_per_chunk_scale(name: str, fmt: str, fmax: float,
                                                      mantissa: int) -> None:
    import ml_dtypes

    # Entries spanning nine decades, so the format's subnormals are used too.
    g = grad(4096) * np.float32(10.0) ** np.linspace(-8, 1, 4096, dtype=np.float32)
    out = round_trip(compressor_for(name), g)
    assert out.dtype == np.float32
    scale = np.abs(g).max() / fmax
    fp8 = getattr(ml_dtypes, fmt)
    expected = ((g / scale).astype(fp8).astype(np.float64) * scale).astype(np.float32)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=0)
    # Relative error at most half a step of the mantissa wherever the scaled
    # value is normal; below that, at most half the smallest subnormal.
    tiny = float(ml_dtypes.finfo(fp8).smallest_normal) * scale
    subnormal = float(ml_dtypes.finfo(fp8).smallest_subnormal) * scale
    normal = np.abs(g) >= tiny
    rel = np.abs(out - g)[normal] / np.abs(g)[normal]
    assert rel.max() <= 2.0 ** -(mantissa + 1) * 1.0001
    assert np.abs(out - g)[~normal].max() <= subnormal / 2 * 1.0001
    # The largest entry is exact: it defines the scale.
    peak = np.abs(g).argmax()
    assert out[peak] == pytest.approx(g[peak], rel=1e-6)


@pytest.mark.parametrize(("name", "fmt", "fmax", "mantissa"), FP8)
def test_fp8_rounding_is_ml_dtypes_bit_for_bit(name: str, fmt: str, fmax: float,
                                               mantissa: int) -> None:
    # The fast path rounds through a table (round to odd first); every
    # representable value, every tie between two neighbours and the floats
    # just beside each tie must come out as ml_dtypes' own cast.
    import ml_dtypes

    fp8 = getattr(ml_dtypes, fmt)
    values = np.arange(256, dtype=np.uint8).view(fp8).astype(np.float64)
    values = np.unique(values[np.isfinite(values)])
    ties = ((values[1:] + values[:-1]) / 2).astype(np.float32)
    x = np.concatenate([values.astype(np.float32), ties,
                        np.nextafter(ties, np.float32(np.inf)),
                        np.nextafter(ties, np.float32(-np.inf)),
                        grad(10_000) * np.float32(fmax / 4),
                        np.float32([1e-30, -1e-38, 1e-45, -0.0])])
    codes = ps_compress._float32_to_fp8(x, fmt)
    np.testing.assert_array_equal(codes, x.astype(fp8).view(np.uint8))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_payload_is_one_byte_per_entry_and_a_scale(name: str) -> None:
    n = 1 << 16
    payload = compressor_for(name).compress(grad(n))
    assert set(payload) == {"data", "scale"}
    assert payload["data"].dtype == np.uint8 and payload["data"].nbytes == n
    assert isinstance(payload["scale"], float)
    # On the wire: the codes out of band, the scale a float64 in a small header.
    header, buffers = serde.encode(payload)
    assert sum(memoryview(b).nbytes for b in buffers) == n
    assert len(header) < 64


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_zeros_empty_subnormals_and_other_dtypes(name: str) -> None:
    compressor = compressor_for(name)
    zeros = np.zeros(7, np.float32)
    payload = compressor.compress(zeros)
    assert payload["scale"] == 1.0
    np.testing.assert_array_equal(round_trip(compressor, zeros), zeros)
    assert round_trip(compressor, np.zeros(0, np.float32)).size == 0
    # A chunk whose peak is a float32 subnormal: 1/scale overflows float32,
    # yet the values come back with fp8's relative precision.
    tiny = np.float32([1e-40, -3e-41, 2e-42, 0.0])
    out = round_trip(compressor, tiny)
    np.testing.assert_allclose(out, tiny, rtol=0.13, atol=2e-45)
    assert out[0] == np.float32(1e-40)
    # Near float32's largest value nothing overflows.
    huge = np.float32([3.4e38, -1e38, 1.0])
    np.testing.assert_allclose(round_trip(compressor, huge)[:2], huge[:2], rtol=0.13)
    for dtype in (np.float16, np.float64):
        g = grad(300).astype(dtype)
        out = round_trip(compressor, g)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, g, rtol=0.13, atol=float(np.abs(g).max()) * 2.0**-16)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_refuses_inf_and_nan(name: str) -> None:
    for bad in (np.inf, -np.inf, np.nan):
        with pytest.raises(InvalidArgument, match="inf or NaN"):
            compressor_for(name).compress(np.float32([1.0, bad, 2.0]))


def test_fp8_bad_payloads_are_invalid_arguments() -> None:
    f32 = np.dtype(np.float32)
    for payload in ({"codec": "fp8_e4m3", "data": np.zeros(3, np.float32), "scale": 1.0},
                    {"codec": "fp8_e4m3", "data": np.zeros(3, np.uint8), "scale": float("nan")},
                    {"codec": "fp8_e5m2", "data": np.zeros(3, np.uint8), "scale": -1.0},
                    {"codec": "fp8_e5m2", "data": np.zeros(3, np.uint8)},
                    {"codec": "fp8_e5m2", "data": np.zeros(4, np.uint8), "scale": 1.0}):
        with pytest.raises(InvalidArgument):
            decompress(payload, 3, f32)


@pytest.mark.parametrize("name", ["int8", "topk", "fp8_e4m3", "fp8_e5m2"])
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


def test_a_chunks_residual_follows_it_to_another_link_class() -> None:
    from tensorwire.ps._compress import LinkFeedback

    feedback = LinkFeedback({"local": "int8", "remote": "fp8"})
    g = np.random.default_rng(2).standard_normal(400).astype(np.float32)
    sent = decompress(feedback.compress("k", g, "remote"), 400, np.dtype(np.float32))
    held = feedback.by_link["remote"].residuals["k"].copy()
    np.testing.assert_allclose(sent + held, g, rtol=1e-5, atol=1e-6)
    # To a class that keeps residuals: it continues there.
    feedback.moved("k", "remote", "local")
    assert "k" not in feedback.by_link["remote"].residuals
    np.testing.assert_array_equal(feedback.by_link["local"].residuals["k"], held)
    # To one that keeps none: added to the chunk's next gradient, once.
    lossless = LinkFeedback({"local": None, "remote": "int8"})
    lossless.compress("k", g, "remote")
    held = lossless.by_link["remote"].residuals["k"].copy()
    lossless.moved("k", "remote", "local")
    zeros = np.zeros(400, np.float32)
    first = decompress(lossless.compress("k", zeros, "local"), 400, np.dtype(np.float32))
    np.testing.assert_array_equal(first, held)
    second = decompress(lossless.compress("k", zeros, "local"), 400, np.dtype(np.float32))
    np.testing.assert_array_equal(second, zeros)
    lossless.moved("j", "local", "remote")  # nothing held: nothing moves
    lossless.clear()
    assert not lossless.by_link and not lossless.carry


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


def test_compressor_names() -> None:
    assert isinstance(compressor_for("fp8"), ps_compress.FP8E4M3)
    assert compressor_for("fp8").name == "fp8_e4m3"
    assert isinstance(compressor_for("fp8_e5m2"), ps_compress.FP8E5M2)
    assert isinstance(compressor_for(None), ps.NoCompression)


def test_compression_per_link_class() -> None:
    spec = {"local": None, "remote": "fp8"}
    assert isinstance(compressor_for(spec, link="local"), ps.NoCompression)
    assert isinstance(compressor_for(spec, link="remote"), ps_compress.FP8E4M3)
    # Without a link: "remote", as for a plain name.
    assert isinstance(compressor_for(spec), ps_compress.FP8E4M3)
    assert isinstance(compressor_for("int8", link="local"), ps.Int8)
    # A missing class gets no compression.
    assert isinstance(compressor_for({"remote": "fp16"}, link="local"), ps.NoCompression)
    assert isinstance(compressor_for({}, link="remote"), ps.NoCompression)
    topk = ps.TopK(ratio=0.1)
    assert compressor_for({"remote": topk}) is topk
    with pytest.raises(ConfigError, match="'inter_host'"):
        compressor_for({"remote": "fp8", "inter_host": "fp8"})
    # Every entry is checked, not only the one asked for.
    with pytest.raises(ConfigError, match="lz4"):
        compressor_for({"local": "lz4", "remote": "fp8"}, link="remote")
    with pytest.raises(ConfigError):
        compressor_for({"remote": {"remote": "fp8"}})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match="link class"):
        compressor_for("fp8", link="rack")


def test_psconfig_takes_a_per_link_mapping() -> None:
    spec = {"local": "none", "remote": "fp8_e5m2"}
    config = ps.PSConfig(compression=spec)
    spec["remote"] = "lz4"  # the config keeps its own copy
    assert config.compression == {"local": "none", "remote": "fp8_e5m2"}
    assert isinstance(compressor_for(config.compression, link="remote"), ps_compress.FP8E5M2)
    assert ps.PSConfig(compression=None).compression is None
    with pytest.raises(ConfigError, match="'rack'"):
        ps.PSConfig(compression={"rack": "fp8"})
    with pytest.raises(ConfigError, match="lz4"):
        ps.PSConfig(compression={"local": "lz4"})


def test_error_feedback_never_writes_into_the_gradient_or_a_payload() -> None:
    class Halving(ps.Compressor):
        """Lossy, and its payload is a view of its input."""

        name: ClassVar[str] = "test-halving-view"
        error_feedback: ClassVar[bool] = True

        def compress(self, grad: np.ndarray) -> dict[str, Any]:
            return {"data": grad, "keep": 0.5}

        @staticmethod
        def decompress(payload: dict[str, Any], size: int, dtype: np.dtype[Any]) -> np.ndarray:
            out: np.ndarray = np.asarray(payload["data"]) * payload["keep"]
            return out

    for compressor in (Halving(), compressor_for("int8"), compressor_for("fp8")):
        feedback = ps.ErrorFeedback(compressor)
        g = grad(64)
        original = g.copy()
        sent = []
        for _ in range(3):
            payload = feedback.compress("k", g)
            sent.append(payload)
        np.testing.assert_array_equal(g, original)
        total = sum(type(compressor).decompress(p, 64, np.dtype(np.float32)) for p in sent)
        np.testing.assert_allclose(total + feedback.residuals["k"], 3 * original, rtol=1e-5,
                                   atol=1e-5)
