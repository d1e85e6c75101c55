"""What a config field is: its default, its help text and its check (``setting``), the checks themselves, and
``Section``, the base of every config section (config/sections.py), which coerces and checks each field when a
section is constructed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field, fields
from typing import Any, ClassVar

from ..errors import ConfigError
from .coerce import coerce, field_types

# ----------------------------------------------------------------------------------------------------------
# field checks: each returns None when the value is fine, else the text "must be ..."


def positive(v: Any) -> str | None:
    return None if v > 0 else "must be > 0"


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must be >= 0"


def unit_open(v: Any) -> str | None:  # [0, 1)
    return None if 0 <= v < 1 else "must be in [0, 1)"


def unit_closed(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be in [0, 1]"


def fraction(v: Any) -> str | None:  # (0, 1]
    return None if 0 < v <= 1 else "must be in (0, 1]"


def choice(*allowed: Any) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in allowed else f"must be one of {', '.join(map(repr, allowed))}"

    check.choices = allowed  # type: ignore[attr-defined]
    return check


def or_minus_one(check: Callable[[Any], str | None], meaning: str) -> Callable[[Any], str | None]:
    """``check``, with -1 allowed too (``meaning``: what -1 stands for, named in the error)."""
    def either(v: Any) -> str | None:
        problem = check(v) if v != -1 else None
        return f"{problem} (or -1: {meaning})" if problem else None

    return either


def setting(default: Any, help: str, check: Callable[[Any], str | None] | None = None) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, "check": check})
    return field(default=default, metadata={"help": help, "check": check})


# ----------------------------------------------------------------------------------------------------------
# a section checks its fields when constructed (types coerced: 3 → 3.0 for a float field), so an invalid
# section cannot exist; Config checks the rules across sections.


class Section:
    _name: ClassVar[str]

    def __post_init__(self) -> None:
        types = field_types(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            value = coerce(self._name, f.name, types[f.name], getattr(self, f.name))
            object.__setattr__(self, f.name, value)
            check = f.metadata.get("check")
            problem = check(value) if check is not None else None
            if problem:
                raise ConfigError(f"{self._name}.{f.name} {problem}, got {value!r}")
        self._check()

    def _check(self) -> None:
        """Rules between this section's fields."""
