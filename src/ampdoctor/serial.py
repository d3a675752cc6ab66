"""Records to plain JSON data and back, guided by the type hints; versioned loading. No torch here."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Optional, TypeVar, Union

from .records import FrozenMap

T = TypeVar("T")


def _encode_float(v: float) -> Union[float, str]:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return v


def to_plain(obj: Any) -> Any:
    """Dataclasses → dicts, tuples → lists, non-finite floats → strings (strict JSON has none)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, float):
        return _encode_float(obj)
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    return obj


_NON_FINITE = ("nan", "inf", "-inf")  # how to_plain writes the floats strict JSON has not


def _expect(data: Any, kind: Union[type, tuple[type, ...]], what: str) -> None:
    # A saved report is a file like any other: a value of the wrong type is refused here, not carried into a
    # renderer (an "integer" holding markup ends up in the HTML) or into an AttributeError far from the cause.
    if not isinstance(data, kind) or (kind is not bool and isinstance(data, bool)):
        raise TypeError(f"expected {what}, found {type(data).__name__} {data!r:.80}")


def from_plain(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from :func:`to_plain` output, guided by the type hints; a value of another
    type than the hint raises TypeError (ValueError for a float string or a Literal that is not one)."""
    origin = typing.get_origin(tp)
    if origin is Union or (hasattr(types, "UnionType") and isinstance(tp, types.UnionType)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if data is None:
            return None
        return from_plain(args[0], data)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        _expect(data, dict, f"an object for {tp.__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {f.name: from_plain(hints[f.name], data[f.name]) for f in dataclasses.fields(tp) if f.name in data}
        return tp(**kwargs)
    if origin is list:
        _expect(data, list, "a list")
        (item,) = typing.get_args(tp)
        return [from_plain(item, v) for v in data]
    if origin is tuple:
        _expect(data, list, "a list")
        items = typing.get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:
            return tuple(from_plain(items[0], v) for v in data)
        if len(data) != len(items):
            raise ValueError(f"expected {len(items)} items, found {len(data)}")
        return tuple(from_plain(a, v) for a, v in zip(items, data))
    if origin is dict or origin is FrozenMap:
        _expect(data, dict, "an object")
        _, value_tp = typing.get_args(tp)
        mapping = {k: from_plain(value_tp, v) for k, v in data.items()}
        return FrozenMap(mapping) if origin is FrozenMap else mapping
    if origin is Literal:
        if data not in typing.get_args(tp):
            raise ValueError(f"{data!r} is not one of {', '.join(map(repr, typing.get_args(tp)))}")
        return data
    if tp is float:
        if isinstance(data, str):
            if data not in _NON_FINITE:
                raise ValueError(f"expected a number, found {data!r:.80}")
            return math.nan if data == "nan" else float(data)
        _expect(data, (int, float), "a number")
        return float(data)
    if tp is int:
        # an integral float is kept as it came (a count written as 3.0 still equals 3)
        if isinstance(data, float) and data.is_integer():
            return data
        _expect(data, int, "an integer")
    elif tp is str:
        _expect(data, str, "a string")
    elif tp is bool:
        _expect(data, bool, "true or false")
    return data


def load_versioned(cls: type[T], data: dict[str, Any], ours: str, kind: str) -> T:
    """Rebuild a saved report, refusing a newer major ``schema_version`` (a newer minor only adds fields)."""
    from .errors import AmpDoctorError

    version = str(data.get("schema_version", ""))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise AmpDoctorError(f"not an ampdoctor {kind}: schema_version {version!r}") from None
    if major > int(ours.split(".")[0]):
        raise AmpDoctorError(
            f"{kind} schema_version {version} is newer than this ampdoctor reads ({ours}); "
            "upgrade ampdoctor (pip install -U ampdoctor)"
        )
    try:
        loaded: T = from_plain(cls, data)
    except (KeyError, TypeError, ValueError) as exc:
        raise AmpDoctorError(f"malformed ampdoctor {kind}: {exc}") from exc
    return loaded


def json_object(text: str, kind: str) -> dict[str, Any]:
    """Parse JSON text that must hold one object."""
    import json

    from .errors import AmpDoctorError

    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AmpDoctorError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise AmpDoctorError(f"not an ampdoctor {kind}: expected a JSON object")
    return data


R = TypeVar("R", bound="SavedReport")


class SavedReport:
    """JSON for a report record: ``to_json`` of its ``to_dict``, and ``from_json`` / ``from_dict`` through
    :func:`load_versioned` (a newer major ``schema_version`` is refused). Subclasses name their schema."""

    SCHEMA: ClassVar[str]
    KIND: ClassVar[str]  # what the error messages call it: "report", "scan report"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = to_plain(self)
        return data

    def to_json(self, indent: Optional[int] = None) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls: type[R], data: dict[str, Any]) -> R:
        return load_versioned(cls, data, cls.SCHEMA, cls.KIND)

    @classmethod
    def from_json(cls: type[R], text: str) -> R:
        return cls.from_dict(json_object(text, cls.KIND))
