"""Typed access to raw JSON objects with JSON-path error messages.

Every value that leaves this module has been checked against the type the caller asked for, and
every key of an object must be consumed by someone: :meth:`ObjectReader.finish` rejects the rest and
lists the keys it knows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from jctr.errors import UserError

_MISSING = object()


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or of the wrong type or range.

    The message starts with the JSON path of the offending value, e.g.
    ``layers[3].fc_param.num_output: expected a positive integer, got "abc"``.
    """

    def __init__(self, path: str, message: str, source: str | None = None):
        self.path = path
        self.source = source
        self.reason = message
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}")


class _Object(dict):
    """A parsed JSON/YAML object that remembers keys it met more than once."""

    twice: tuple[str, ...] = ()


def _object_of(pairs: list[tuple[str, Any]]) -> _Object:
    out = _Object(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        out.twice = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    return out


def refuse_repeated_keys(raw: Any, source: str | None, path: str = "") -> None:
    """A key given twice in one object is an error naming its JSON path (json and PyYAML keep
    the last one silently, so a setting the user wrote would be ignored)."""
    if isinstance(raw, dict):
        for key in getattr(raw, "twice", ()):
            raise ConfigError(join_path(path, key), "given twice in the same object (only "
                              "one would count); keep one", source)
        for key, value in raw.items():
            refuse_repeated_keys(value, source, join_path(path, key))
    elif isinstance(raw, list):
        for i, value in enumerate(raw):
            refuse_repeated_keys(value, source, join_path(path, i))


def json_from_text(text: str, source: str | None) -> Any:
    """A config file's JSON; a syntax error names the file, line and column, a key given twice
    its JSON path."""
    import json

    try:
        raw = json.loads(text, object_pairs_hook=_object_of)
    except json.JSONDecodeError as e:
        raise ConfigError(f"line {e.lineno} column {e.colno}", f"invalid JSON: {e.msg}",
                          source) from e
    refuse_repeated_keys(raw, source)
    return raw


def yaml_from_text(text: str, source: str | None) -> Any:
    """A config file's YAML (safe: plain data only), with the checks of
    :func:`json_from_text`."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        pairs = [(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep))
                 for k, v in node.value]
        return _object_of(pairs)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    try:
        raw = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError("<file>", f"invalid YAML: {e}", source) from None
    refuse_repeated_keys(raw, source)
    return raw


def describe(value: Any) -> str:
    """A short, JSON-looking rendering of a value for error messages."""
    if isinstance(value, str):
        return f'"{value}"' if len(value) < 60 else f'"{value[:57]}..."'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return f"a list of {len(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}[repr(value)]
    return repr(value)


def join_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


class ObjectReader:
    """Reads the fields of one JSON object, remembering which keys were asked for."""

    def __init__(self, obj: Any, path: str, source: str | None = None):
        if not isinstance(obj, dict):
            raise ConfigError(path or "<root>", f"expected an object, got {describe(obj)}", source)
        self.obj = obj
        self.path = path
        self.source = source
        self.known: list[str] = []

    def error(self, key: str | int | None, message: str) -> ConfigError:
        path = self.path if key is None else join_path(self.path, key)
        return ConfigError(path or "<root>", message, self.source)

    def has(self, key: str) -> bool:
        if key not in self.known:
            self.known.append(key)
        return key in self.obj

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        self.has(key)
        if key in self.obj:
            return self.obj[key]
        if default is _MISSING:
            raise self.error(key, "required field is missing")
        return default

    def child(self, key: str) -> ObjectReader:
        return ObjectReader(self.raw(key), join_path(self.path, key), self.source)

    def _typed(self, key, default, check: Callable[[Any], bool], expected: str, convert=None):
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not check(value):
            raise self.error(key, f"expected {expected}, got {describe(value)}")
        return convert(value) if convert else value

    def int(self, key: str, default: Any = _MISSING, *, min_value: int | None = None) -> int:
        expected = "an integer"
        if min_value == 1:
            expected = "a positive integer"
        elif min_value == 0:
            expected = "a non-negative integer"
        elif min_value is not None:
            expected = f"an integer >= {min_value}"
        return self._typed(
            key,
            default,
            lambda v: _is_int(v) and (min_value is None or int(v) >= min_value),
            expected,
            int,
        )

    def float(self, key: str, default: Any = _MISSING, *, min_value: float | None = None,
              positive: bool = False, max_value: float | None = None) -> float:
        expected = "a finite number"
        if positive:
            expected = "a positive finite number"
        elif min_value is not None and max_value is not None:
            expected = f"a number in [{min_value}, {max_value}]"
        elif min_value is not None:
            expected = f"a finite number >= {min_value}"

        def ok(v):
            if not _is_number(v):
                return False
            v = float(v)
            if not math.isfinite(v):  # JSON's NaN / Infinity extensions, 1e999
                return False
            if positive and not v > 0:
                return False
            if min_value is not None and v < min_value:
                return False
            return max_value is None or v <= max_value

        return self._typed(key, default, ok, expected, float)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        return self._typed(key, default, lambda v: isinstance(v, bool), "true or false")

    def str(self, key: str, default: Any = _MISSING) -> str:
        return self._typed(key, default, lambda v: isinstance(v, str) and v != "",
                           "a non-empty string")

    def int_or_word(self, key: str, default: Any, words: Sequence[str], *,
                    min_value: int = 1) -> int | str:
        """An integer of at least ``min_value``, or one of ``words`` (``"epoch"``)."""
        return self._typed(key, default,
                           lambda v: (_is_int(v) and v >= min_value) or (isinstance(v, str)
                                                                         and v in words),
                           f"an integer >= {min_value} or "
                           + " or ".join(f'"{w}"' for w in words),
                           lambda v: v if isinstance(v, str) else int(v))

    def choice(self, key: str, choices: Sequence[str], default: Any = _MISSING) -> str:
        return self._typed(key, default, lambda v: isinstance(v, str) and v in choices,
                           "one of " + ", ".join(f'"{c}"' for c in choices))

    def str_or_list(self, key: str, default: Any = _MISSING) -> tuple[str, ...]:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if isinstance(value, str) and value:
            return (value,)
        if (isinstance(value, list) and value
                and all(isinstance(v, str) and v for v in value)):
            return tuple(value)
        raise self.error(key, f"expected a name or a list of names, got {describe(value)}")

    def int_list(self, key: str, default: Any = _MISSING, *, min_value: int | None = None
                 ) -> tuple[int, ...]:
        value = self.raw(key, default)
        if value is default and default is not _MISSING:
            return value
        if not isinstance(value, list):
            raise self.error(key, f"expected a list of integers, got {describe(value)}")
        for i, v in enumerate(value):
            if not _is_int(v) or (min_value is not None and int(v) < min_value):
                what = "a positive integer" if min_value == 1 else "an integer"
                raise ConfigError(join_path(join_path(self.path, key), i),
                                  f"expected {what}, got {describe(v)}", self.source)
        return tuple(int(v) for v in value)

    def list(self, key: str, default: Any = _MISSING) -> list:
        return self._typed(key, default, lambda v: isinstance(v, list), "a list")

    def finish(self) -> None:
        """Raise on keys nobody asked for, listing the known ones."""
        unknown = [k for k in self.obj if k not in self.known]
        if unknown:
            known = ", ".join(f'"{k}"' for k in sorted(self.known)) or "none"
            raise self.error(unknown[0], f"unknown key; known keys here: {known}")


def _is_int(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, float) and v.is_integer()


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
