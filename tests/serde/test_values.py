"""Round trips of plain Python values and registered user types."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest

from tensorwire import serde
from tensorwire.errors import ConfigError, DecodeError, EncodeError

from ._helpers import roundtrip

VALUES: list[Any] = [
    None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**64) - 1, 10**400,
    0.0, -0.0, 1.5, math.inf, 1 + 2j, complex(0, -0.0), "", "héllo ☃", b"", b"x" * 5000,
    bytearray(b"ab"), bytearray(b"y" * 5000), [], [1, [2, [3]]], (), (1,), (1, (2, (3,)), [4]),
    {}, {"a": 1}, {1: "int", 2.5: "float", None: 0, False: "f", b"k": 1, (1, "x"): "tuple"},
    {"nested": {"deep": [({"t": (1, 2)},)]}},
]  # fmt: skip


@pytest.mark.parametrize("threshold", [0, 1024])
@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_roundtrip(value: Any, threshold: int) -> None:
    out = roundtrip(value, inline_threshold=threshold)
    assert out == value
    assert type(out) is type(value)
    if isinstance(value, dict):
        assert [type(k) for k in out] == [type(k) for k in value]


def test_nan() -> None:
    assert math.isnan(roundtrip(math.nan))


def test_tuple_stays_tuple_inside_lists() -> None:
    out = roundtrip([(1, 2), [(3,)], {"k": ((),)}])
    assert out == [(1, 2), [(3,)], {"k": ((),)}]
    assert type(out[0]) is tuple and type(out[1][0]) is tuple and type(out[2]["k"][0]) is tuple


@pytest.mark.parametrize("threshold", [0, 1024])
def test_memoryview(threshold: int) -> None:
    data = np.arange(3000, dtype=np.uint8)
    mv = memoryview(data)
    header, buffers = serde.Encoder(inline_threshold=threshold).encode(mv)
    out = serde.decode(header, buffers)
    assert type(out) is memoryview
    assert out.tobytes() == data.tobytes()
    if buffers:
        assert np.shares_memory(np.frombuffer(buffers[0], dtype=np.uint8), data)


def test_strided_memoryview_is_compacted() -> None:
    mv = memoryview(bytes(range(100)))[::3]
    assert roundtrip(mv, inline_threshold=0).tobytes() == bytes(range(100))[::3]


def test_large_bytes_go_out_of_band() -> None:
    data = b"z" * 10_000
    header, buffers = serde.encode({"blob": data})
    assert len(header) < 100
    assert len(buffers) == 1 and bytes(buffers[0]) == data


@pytest.mark.parametrize(
    ("value", "needle", "path"),
    [
        ({"a": [1, object()]}, "builtins.object", "value['a'][1]"),
        ([{"x": {1, 2}}], "builtins.set", "value[0]['x']"),
        ({"params": (1, 2, lambda: 0)}, "function", "value['params'][2]"),
        ({frozenset(): 1}, "unsupported dict key type builtins.frozenset", "value.keys()"),
        ({"e": __import__("enum").IntEnum("E", "A").A}, "subclasses of builtins", "value['e']"),
        ([__import__("collections").OrderedDict()], "subclasses of builtins", "value[0]"),
    ],
)
def test_unsupported_types_name_type_and_path(value: Any, needle: str, path: str) -> None:
    with pytest.raises(EncodeError) as info:
        serde.encode(value)
    assert needle in str(info.value)
    assert path in str(info.value)


def test_depth_limit_on_encode() -> None:
    value: Any = 1
    for _ in range(20):
        value = [value]
    enc = serde.Encoder(limits=serde.Limits(max_depth=10))
    with pytest.raises(EncodeError, match="max_depth=10"):
        enc.encode(value)
    serde.Encoder(limits=serde.Limits(max_depth=20)).encode(value)


def test_self_referential_list() -> None:
    lst: list[Any] = []
    lst.append(lst)
    with pytest.raises(EncodeError, match="max_depth"):
        serde.encode(lst)


def test_header_limit_on_encode() -> None:
    enc = serde.Encoder(limits=serde.Limits(max_header_bytes=100))
    with pytest.raises(EncodeError, match="max_header_bytes=100"):
        enc.encode("x" * 200)


def test_lone_surrogate_refused() -> None:
    with pytest.raises(EncodeError, match="cannot encode"):
        serde.encode("\ud800")


@pytest.mark.parametrize(
    "kwargs",
    [{"inline_threshold": -1}, {"inline_threshold": 1.5}],
)
def test_bad_encoder_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        serde.Encoder(**kwargs)


@pytest.mark.parametrize("kwargs", [{"max_depth": 0}, {"max_depth": 501}, {"max_buffers": -1}])
def test_bad_limits(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        serde.Limits(**kwargs)


def test_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        serde.Encoder(None)  # type: ignore[misc]
    with pytest.raises(TypeError):
        serde.Decoder(None)  # type: ignore[misc]


# -- registered types ----------------------------------------------------------


class Point:
    def __init__(self, x: float, y: float) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    __hash__ = None  # type: ignore[assignment]


@dataclasses.dataclass
class Batch:
    name: str
    data: np.ndarray[Any, Any]
    step: int = 0
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@pytest.fixture
def registry() -> serde.TypeRegistry:
    reg = serde.TypeRegistry()
    reg.register(Point, name="Point", encode=lambda p: (p.x, p.y), decode=lambda v: Point(*v))
    reg.register(Batch)
    return reg


def _rt(value: Any, reg: serde.TypeRegistry) -> Any:
    header, buffers = serde.Encoder(registry=reg).encode(value)
    return serde.Decoder(registry=reg).decode(header, buffers)


def test_registered_class(registry: serde.TypeRegistry) -> None:
    assert _rt({"p": [Point(1, 2)]}, registry) == {"p": [Point(1, 2)]}


def test_registered_dataclass_with_array(registry: serde.TypeRegistry) -> None:
    batch = Batch("b", np.arange(1000.0), step=3, meta={"k": Point(0, 1)})
    out = _rt(batch, registry)
    assert type(out) is Batch and out.name == "b" and out.step == 3
    assert out.meta == {"k": Point(0, 1)}
    np.testing.assert_array_equal(out.data, batch.data)


def test_unregistered_on_either_side(registry: serde.TypeRegistry) -> None:
    with pytest.raises(EncodeError, match="Point"):
        serde.Encoder(registry=serde.TypeRegistry()).encode(Point(1, 2))
    header, buffers = serde.Encoder(registry=registry).encode(Point(1, 2))
    with pytest.raises(DecodeError, match="unknown registered type name 'Point'"):
        serde.Decoder(registry=serde.TypeRegistry()).decode(header, buffers)


def test_registered_decode_errors_become_decode_error(registry: serde.TypeRegistry) -> None:
    header, buffers = serde.Encoder(registry=registry).encode(Batch("b", np.zeros(1)))
    other = serde.TypeRegistry()
    other.register(Batch, decode=lambda v: 1 / 0, encode=lambda b: None)
    with pytest.raises(DecodeError, match="ZeroDivisionError"):
        serde.Decoder(registry=other).decode(header, buffers)


def test_dataclass_decode_rejects_unknown_fields(registry: serde.TypeRegistry) -> None:
    sender = serde.TypeRegistry()
    sender.register(
        Batch, name=f"{Batch.__module__}.Batch", encode=lambda b: {"evil": 1}, decode=lambda v: v
    )
    header, buffers = serde.Encoder(registry=sender).encode(Batch("b", np.zeros(1)))
    with pytest.raises(DecodeError, match="unknown fields"):
        serde.Decoder(registry=registry).decode(header, buffers)


def test_register_errors() -> None:
    reg = serde.TypeRegistry()
    with pytest.raises(ConfigError, match="not a dataclass"):
        reg.register(Point)
    with pytest.raises(ConfigError, match="both"):
        reg.register(Point, encode=lambda p: 0)
    reg.register(Batch)
    with pytest.raises(ConfigError, match="already registered"):
        reg.register(Batch, name="other")
    with pytest.raises(ConfigError, match="already registered"):
        reg.register(Point, name=f"{Batch.__module__}.{Batch.__qualname__}",
                     encode=lambda p: 0, decode=lambda v: v)  # fmt: skip
    with pytest.raises(ConfigError, match="non-empty"):
        reg.register(Point, name="", encode=lambda p: 0, decode=lambda v: v)


def test_encode_function_errors_are_encode_errors() -> None:
    reg = serde.TypeRegistry()
    reg.register(Point, encode=lambda p: 1 / 0, decode=lambda v: v)
    with pytest.raises(EncodeError, match="ZeroDivisionError"):
        serde.Encoder(registry=reg).encode([Point(1, 2)])


def test_module_level_register_uses_default_registry() -> None:
    class Local:
        pass

    serde.register(Local, name="tests.Local", encode=lambda o: None, decode=lambda v: Local())
    assert Local in serde.default_registry
    assert type(serde.decode(*serde.encode(Local()))) is Local


def test_fast_path_nested_big_bytes_go_out_of_band() -> None:
    # Small values are packed in C first; a bin found in the result sends the
    # value through the walk, so nested big bytes still travel out of band.
    header, buffers = serde.encode({"a": [b"x" * 5000]})
    assert len(buffers) == 1 and len(header) < 100
    assert serde.decode(header, buffers) == {"a": [b"x" * 5000]}


def test_fast_path_nested_bytes_likes_keep_their_type() -> None:
    out = roundtrip([{"k": bytearray(b"ab")}, (memoryview(b"cd"),)])
    assert type(out[0]["k"]) is bytearray and out[0]["k"] == b"ab"
    assert type(out[1]) is tuple
    assert type(out[1][0]) is memoryview and out[1][0].tobytes() == b"cd"


@pytest.mark.parametrize(
    "value",
    [((((((1,),),),),),), {"k": [1] * 40, (1, (2,)): "tuple key"}, [2**70, (1 + 1j,)]],
)
def test_fast_path_fallbacks(value: Any) -> None:
    out = roundtrip(value)
    assert out == value and repr(out) == repr(value)


def test_reentrant_decode_from_registered_type() -> None:
    # A registered decode function may use the same Decoder (state is saved).
    reg = serde.TypeRegistry()
    enc = serde.Encoder(registry=reg)
    dec = serde.Decoder(registry=reg)

    class Envelope:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

    def encode_env(e: Envelope) -> Any:
        header, buffers = enc.encode(e.inner)
        return [header, [bytes(b) for b in buffers]]

    reg.register(
        Envelope, name="Envelope", encode=encode_env, decode=lambda v: dec.decode(v[0], v[1])
    )
    inner = {"x": np.arange(500.0)}
    header, buffers = enc.encode({"env": Envelope(inner), "y": np.arange(400.0)})
    out = dec.decode(header, buffers)
    np.testing.assert_array_equal(out["env"]["x"], inner["x"])
    np.testing.assert_array_equal(out["y"], np.arange(400.0))


def test_buffer_limits() -> None:
    value = [np.zeros(1000) for _ in range(5)]
    small = serde.Limits(max_buffers=4)
    with pytest.raises(EncodeError, match="max_buffers=4"):
        serde.Encoder(limits=small).encode(value)
    header, buffers = serde.encode(value)
    with pytest.raises(DecodeError, match="max_buffers=4"):
        serde.Decoder(limits=small).decode(header, buffers)


def test_module_level_functions_are_per_thread() -> None:
    import threading

    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(200):
                value = {"seed": seed, "i": i, "a": np.full(300, seed, dtype="i8"), "t": (i,)}
                out = serde.decode(*serde.encode(value))
                assert out["seed"] == seed and out["t"] == (i,)
                assert (out["a"] == seed).all()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize(
    "value",
    [
        [[7], {}],
        [["key", 1.5, None, True], {"flag": False}],
        [[np.arange(1000.0)], {"b": b"x" * 5000}],  # buffers out of band
        [[((((((1,),),),),),)], {}],  # tuples deeper than the fast path takes
        [[2**70], {"c": (1 + 1j,)}],
    ],
    ids=repr,
)
def test_encode_nested_makes_what_encode_makes(value: Any) -> None:
    enc = serde.Encoder()
    header, buffers = enc.encode_nested(value)
    expected_header, expected_buffers = enc.encode(value)
    assert header == expected_header
    assert [bytes(memoryview(b)) for b in buffers] == [
        bytes(memoryview(b)) for b in expected_buffers
    ]
    out = serde.decode(header, buffers)
    assert repr(out) == repr(value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([[object()], {}], "builtins.object"),
        ([["x" * 200], {}], "max_header_bytes=100"),
    ],
)
def test_encode_nested_raises_what_encode_raises(value: Any, match: str) -> None:
    enc = serde.Encoder(limits=serde.Limits(max_header_bytes=100))
    with pytest.raises(EncodeError, match=match):
        enc.encode(value)
    with pytest.raises(EncodeError, match=match):
        enc.encode_nested(value)


_ARGUMENTS: list[tuple[tuple[Any, ...], dict[Any, Any]]] = [
    ((7,), {}),
    ((), {}),
    (("key", 1.5, None, True), {"flag": False}),
    ((np.arange(1000.0),), {"b": b"x" * 5000}),  # buffers out of band
    ((((((((1,),),),),),),), {}),
    ((2**70, [1, (2,)]), {"c": (1 + 1j,), (1, 2): "tuple key"}),
]


@pytest.mark.parametrize(("args", "kwargs"), _ARGUMENTS, ids=repr)
def test_encode_arguments_makes_what_encode_frames_makes(args: tuple[Any, ...],
                                                         kwargs: dict[Any, Any]) -> None:
    """A call's arguments, ``[list(args), kwargs]``, written without the two
    lists: the same frames."""
    enc = serde.Encoder()
    frames = enc.encode_arguments(args, kwargs)
    expected = enc.encode_frames([list(args), kwargs])
    assert frames[0] == expected[0]
    assert [bytes(memoryview(b)) for b in frames[1:]] == [
        bytes(memoryview(b)) for b in expected[1:]]
    assert repr(serde.decode(frames[0], frames[1:])) == repr([list(args), kwargs])


@pytest.mark.parametrize(
    ("args", "kwargs", "limits", "match"),
    [
        ((1, object()), {}, serde.Limits(), r"builtins.object: .* at value\[0\]\[1\]$"),
        ((1,), {"k": [object()]}, serde.Limits(),
         r"builtins.object: .* at value\[1\]\['k'\]\[0\]$"),
        ((1,), {object(): 1}, serde.Limits(), r"dict key type builtins.object at value\[1\]"),
        (("x" * 200,), {}, serde.Limits(max_header_bytes=100), "max_header_bytes=100"),
        (([[1]],), {}, serde.Limits(max_depth=3), "max_depth=3"),
        ((), {"k": [[1]]}, serde.Limits(max_depth=3), "max_depth=3"),
    ],
)
def test_encode_arguments_raises_what_encode_frames_raises(
        args: tuple[Any, ...], kwargs: dict[Any, Any], limits: serde.Limits, match: str) -> None:
    enc = serde.Encoder(limits=limits)
    with pytest.raises(EncodeError, match=match) as expected:
        enc.encode_frames([list(args), kwargs])
    with pytest.raises(EncodeError, match=match) as raised:
        enc.encode_arguments(args, kwargs)
    assert str(raised.value) == str(expected.value)
    # The encoder is whole after the error.
    assert enc.encode_arguments((7,), {}) == enc.encode_frames([[7], {}])


@pytest.mark.parametrize(
    "value", [0, 7, -1, 2**63, 2**64 - 1, -(2**63), 2**64, -(2**63) - 1, 2**70, 1.5,
              float("inf"), True, False, None],
)
def test_scalars_roundtrip_with_their_type(value: Any) -> None:
    header, buffers = serde.encode(value)
    assert buffers == []
    out = serde.decode(header, buffers)
    assert type(out) is type(value) and out == value


def test_scalar_beyond_a_tiny_header_limit_is_refused() -> None:
    enc = serde.Encoder(limits=serde.Limits(max_header_bytes=12))
    assert serde.decode(*enc.encode(1)) == 1  # a one-byte packing fits
    with pytest.raises(EncodeError, match="max_header_bytes=12"):
        enc.encode(1.5)
