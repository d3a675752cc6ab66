"""Hashable, NaN-aware building blocks of the records: a frozen mapping, and equality that treats NaN as NaN."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


def _nan_key(value: Any) -> Any:
    """NaN as one canonical object, so that two NaNs compare (and hash) equal inside a record."""
    return math.nan if isinstance(value, float) and value != value else value


class FrozenMap(Mapping[K, V], Generic[K, V]):
    """A read-only, hashable mapping for records (JSON: an object)."""

    __slots__ = ("_data",)

    def __init__(self, items: Any = ()) -> None:
        self._data: dict[K, V] = dict(items)

    def __getitem__(self, key: K) -> V:
        return self._data[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset((k, _nan_key(v)) for k, v in self._data.items()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return len(self) == len(other) and all(
            k in other and (_nan_key(v) is _nan_key(other[k]) or v == other[k]) for k, v in self._data.items()
        )

    def __repr__(self) -> str:
        return f"FrozenMap({self._data!r})"


class NanEq:
    """Equality and hash over the compared fields, a NaN equal to a NaN (records of measured values).

    Python 3.13 compares dataclass fields one by one (``nan == nan`` is False); a tuple of canonical NaNs
    compares equal on every version.
    """

    __slots__ = ()

    def _key(self) -> tuple[Any, ...]:
        names = [f.name for f in dataclasses.fields(self) if f.compare]  # type: ignore[arg-type]
        return tuple(_nan_key(getattr(self, name)) for name in names)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key())
