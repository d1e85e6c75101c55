"""A TOML or ``--set`` value into its config field's type (3 → 3.0 for a float field), and one field checked alone."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from ..errors import ConfigError


def type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def coerce(section: str, name: str, tp: Any, value: Any) -> Any:
    key = f"{section}.{name}"
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {value!r}")
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list:  # lists of positive numbers (bandwidths)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list) and value and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value
        ):
            return [float(v) for v in value]
        raise ConfigError(f"{key} must be a non-empty list of positive numbers, got {value!r}")
    raise ConfigError(f"{key} must be {type_name(tp)}, got {value!r}")


def check_field(cls: type, name: str, value: Any) -> None:
    """Coerce and check one field of section ``cls`` alone (the rules between fields are the section's)."""
    f = next(f for f in fields(cls) if f.name == name)
    value = coerce(cls._name, name, field_types(cls)[name], value)  # type: ignore[attr-defined]
    check = f.metadata.get("check")
    problem = check(value) if check is not None else None
    if problem:
        raise ConfigError(f"{cls._name}.{name} {problem}, got {value!r}")  # type: ignore[attr-defined]


def field_types(cls: type) -> dict[str, Any]:
    import typing

    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}
