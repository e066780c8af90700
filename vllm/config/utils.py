"""Helpers shared by the config dataclasses: building from dicts, hashing, human-readable sizes."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from typing import Any

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


@dataclasses.dataclass(frozen=True)
class Range:
    """An inclusive range of token counts [start, end] that a graph is compiled for."""

    start: int
    end: int

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and self.start <= n <= self.end

    def is_single_size(self) -> bool:
        """A range of one size: compiled with static shapes (a `compile_sizes` entry)."""
        return self.start == self.end

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"

    @property
    def tag(self) -> str:
        """Short name used in file names: "size_16" or "range_1_2048"."""
        if self.is_single_size():
            return f"size_{self.start}"
        return f"range_{self.start}_{self.end}"


def compile_ranges(endpoints: list[int] | None, max_num_batched_tokens: int) -> list[Range]:
    """[1, e0], [e0+1, e1], ..., [e_last+1, max_num_batched_tokens] for endpoints strictly
    between 1 and max_num_batched_tokens (others are ignored)."""
    points = sorted({e for e in (endpoints or []) if 1 < e < max_num_batched_tokens})
    ranges, start = [], 1
    for end in [*points, max_num_batched_tokens]:
        ranges.append(Range(start, end))
        start = end + 1
    return ranges


@functools.cache
def _validation_error_class() -> type:
    from pydantic_core import ValidationError

    class ConfigValidationError(ValidationError):
        """A config's invalid or contradictory settings: pydantic's `ValidationError` (what
        upstream's pydantic configs raise; a `ValueError` too), printed as our one-line
        message rather than pydantic's report."""

        def __str__(self) -> str:
            return str(self.errors(include_url=False)[0]["ctx"]["error"])

    return ConfigValidationError


def as_validation_error(config_name: str, exc: ValueError) -> ValueError:
    """`exc` as a `ConfigValidationError` of `config_name` with the same message (itself when it
    already is a pydantic ValidationError)."""
    cls = _validation_error_class()
    if isinstance(exc, cls.__mro__[1]):
        return exc
    return cls.from_exception_data(config_name, [
        {"type": "value_error", "loc": (), "input": None, "ctx": {"error": exc}}])


def raises_validation_error(post_init: Callable[..., None]) -> Callable[..., None]:
    """Decorate a config's `__post_init__`: a ValueError it raises leaves as a pydantic
    ValidationError with the same message (see `as_validation_error`)."""

    @functools.wraps(post_init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            post_init(self, *args, **kwargs)
        except ValueError as exc:
            error = as_validation_error(type(self).__name__, exc)
            if error is exc:
                raise
            raise error.with_traceback(exc.__traceback__) from None

    return wrapper


def parse_human_size(value: Any, what: str = "size") -> int:
    """Parse 4GiB, 512MB, 80m, 2k, 1024 into an integer count (bytes or items)."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a number like 4GiB or 1024, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(
            f"{what}: cannot parse {value!r}; use a number with an optional unit "
            "(k, M, G, KiB, MiB, GiB, e.g. 4GiB)")
    number = float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    return int(number)


def closest_key(key: str, valid: list[str]) -> str:
    """A 'did you mean' hint, or a list of the valid keys when nothing is close."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return "valid keys: " + ", ".join(sorted(valid))


def directory_problem(path: str) -> str | None:
    """Why `path` cannot be used as a directory to write into (it is a file, lies below one,
    or the nearest existing directory is not writable), or None. Creates nothing."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "it is a file, not a directory"
        existing = path
    else:
        existing = os.path.dirname(path)
        while existing and not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if existing and not os.path.isdir(existing):
            return f"it cannot be created: {existing!r} is a file"
    if existing and not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing!r} is not writable"
    return None


def check_bool_fields(obj: Any, path: str) -> None:
    """Every field of dataclass `obj` declared `bool` or `bool | None` holds a bool (or None):
    a ValueError naming `path.field` and the bad value otherwise (a string such as "maybe"
    from a command line would be truthy)."""
    for f in dataclasses.fields(obj):
        if f.type not in ("bool", "bool | None", bool):
            continue
        value = getattr(obj, f.name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{path}.{f.name} must be true or false, got {value!r}")


def config_from_dict(cls: type, data: dict, path: str, nested: dict[str, type] | None = None):
    """Build dataclass `cls` from a dict, rejecting unknown keys with the closest valid key."""
    if not isinstance(data, dict):
        raise ValueError(f"{path} must be a JSON object, got {data!r}")
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"Unknown key '{path}.{key}': {closest_key(key, names)}")
        sub = (nested or {}).get(key)
        if sub is not None and isinstance(value, dict):
            value = config_from_dict(sub, value, f"{path}.{key}")
        kwargs[key] = value
    return cls(**kwargs)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def to_jsonable(value: Any) -> Any:
    """A JSON-serialisable view of a config value (enums by name, dataclasses as dicts)."""
    return _jsonable(value)


def hash_fields(obj: Any, exclude: tuple[str, ...] = ()) -> str:
    """SHA-256 of a dataclass's init fields, except `exclude`, in a stable JSON encoding."""
    data = {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if f.name not in exclude and not f.name.startswith("_")}
    text = json.dumps(data, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
