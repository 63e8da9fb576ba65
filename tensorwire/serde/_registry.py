"""Registry of user types, by class (for encoding) and by wire name (decoding)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, DecodeError

#: Longest type name on the wire; names travel in every header that uses them.
MAX_NAME_LEN = 255


@dataclass(frozen=True, slots=True)
class RegisteredType:
    """One registration: the class, its wire name and its two functions."""

    cls: type
    name: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


def _dataclass_functions(
    cls: type,
) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """Field-wise functions: a dict of the ``init`` fields, rebuilt by ``cls(**d)``.

    A dict (not a positional list) so that peers can add fields with defaults;
    rebuilding through ``__init__`` runs the class's own ``__post_init__`` checks.
    """
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
    allowed = frozenset(names)

    def encode(obj: Any) -> dict[str, Any]:
        return {name: getattr(obj, name) for name in names}

    def decode(value: Any) -> Any:
        if type(value) is not dict:
            raise DecodeError(f"dataclass {cls.__qualname__}: expected a dict of fields")
        unknown = [k for k in value if type(k) is not str or k not in allowed]
        if unknown:
            raise DecodeError(f"dataclass {cls.__qualname__}: unknown fields {unknown!r}")
        return cls(**value)

    return encode, decode


class TypeRegistry:
    """Maps user classes to wire names and encode/decode functions.

    ``encode(obj)`` must return an encodable value (anything :func:`encode`
    takes, arrays included); ``decode(value)`` gets that value back and returns
    the object. The decoder calls ``decode`` with values from the network:
    validate them there.
    """

    __slots__ = ("_by_name", "_by_type")

    def __init__(self) -> None:
        self._by_type: dict[type, RegisteredType] = {}
        self._by_name: dict[str, RegisteredType] = {}

    def register(
        self,
        cls: type,
        *,
        name: str | None = None,
        encode: Callable[[Any], Any] | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> None:
        """Register ``cls`` under ``name`` (default ``module.QualName``).

        Dataclasses may leave out ``encode`` and ``decode``: their ``init``
        fields travel as a dict and the class is rebuilt with ``cls(**fields)``.

        Raises:
            ConfigError: ``cls`` is not a class, the name is empty, too long or
                taken, ``cls`` is already registered, or the functions are
                missing for a class that is not a dataclass.
        """
        if not isinstance(cls, type):
            raise ConfigError(f"register() needs a class, got {cls!r}")
        if name is None:
            name = f"{cls.__module__}.{cls.__qualname__}"
        if type(name) is not str or not name or len(name.encode()) > MAX_NAME_LEN:
            raise ConfigError(f"type name must be a non-empty str of <= {MAX_NAME_LEN} bytes")
        if (encode is None) != (decode is None):
            raise ConfigError("give both encode and decode, or neither (dataclasses)")
        if encode is None or decode is None:
            if not dataclasses.is_dataclass(cls):
                raise ConfigError(f"{cls.__qualname__} is not a dataclass: give encode and decode")
            encode, decode = _dataclass_functions(cls)
        if cls in self._by_type:
            raise ConfigError(f"{cls.__qualname__} is already registered")
        if name in self._by_name:
            raise ConfigError(f"type name {name!r} is already registered")
        entry = RegisteredType(cls, name, encode, decode)
        self._by_type[cls] = entry
        self._by_name[name] = entry

    def for_type(self, cls: type) -> RegisteredType | None:
        """The registration of ``cls`` or of its nearest registered base class."""
        entry = self._by_type.get(cls)
        if entry is None:
            for base in cls.__mro__[1:]:
                entry = self._by_type.get(base)
                if entry is not None:
                    break
        return entry

    def for_name(self, name: str) -> RegisteredType | None:
        """The registration with wire name ``name``, if any."""
        return self._by_name.get(name)

    def __contains__(self, cls: object) -> bool:
        return cls in self._by_type


#: The registry that :func:`register`, :func:`encode`, :func:`decode` and
#: ``Encoder()``/``Decoder()`` without ``registry=`` use. Like ``copyreg``, the
#: one piece of process-wide state of the codec: registering is an explicit,
#: import-time-free action of the application.
default_registry = TypeRegistry()


def register(
    cls: type,
    *,
    name: str | None = None,
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
) -> None:
    """Register a user type in the default registry; see :meth:`TypeRegistry.register`.

    Raises:
        ConfigError: as :meth:`TypeRegistry.register`.
    """
    default_registry.register(cls, name=name, encode=encode, decode=decode)
