"""Building a :class:`~lordo.config.Config`: TOML files, ``--set section.key=value`` overrides, presets, and the
description of every field that ``lordo train --help`` prints."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .coerce import check_field
from .run_config import PRESETS, SECTIONS, Config
from .sections import ModelConfig

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef,unused-ignore]


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is read as TOML (numbers, true/false, quoted or bare strings)."""
    if "=" not in text:
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(
            f"--set key {key!r} must be section.key with a section from: {', '.join(SECTIONS)}"
        )
    section, name = key.split(".")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as cosine or ./data
    return section, name, value


def _set_in(tree: dict[str, dict[str, Any]], section: str, name: str, value: Any, check: bool = False) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; sections are: {', '.join(SECTIONS)}")
    allowed = [f.name for f in fields(SECTIONS[section])]
    if name not in allowed:
        raise ConfigError(f"unknown config key {section}.{name!r}; keys of [{section}] are: {', '.join(allowed)}")
    if check:  # a value a later override replaces is still checked: a mistake is not hidden by another one
        check_field(SECTIONS[section], name, value)
    tree.setdefault(section, {})[name] = value


def load_toml(path: str | Path) -> dict[str, dict[str, Any]]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        # JSON is accepted too (a run's config.json, a sweep's base.json); TOML is the format for people
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a table of [section] tables")
    tree: dict[str, dict[str, Any]] = {}
    for section, body in raw.items():
        if section == "derived" and path.suffix == ".json":
            continue  # what a run computed (config.json); not settings
        if not isinstance(body, dict):
            raise ConfigError(
                f"{path}: top-level key {section!r} must be a [section]; sections are: {', '.join(SECTIONS)}"
            )
        for name, value in body.items():
            try:
                _set_in(tree, section, name, value)
            except ConfigError as exc:
                raise ConfigError(f"{path}: {exc}") from None
    return tree


def build_config(
    file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    tree: dict[str, dict[str, Any]] | None = None,
) -> Config:
    """Resolve a configuration from an optional TOML file, a nested dict and ``--set`` overrides."""
    given: dict[str, dict[str, Any]] = {}
    sources = [load_toml(file)] if file is not None else []
    if tree:
        sources.append(tree)
    for src in sources:
        for section, body in src.items():
            if not isinstance(body, dict):
                raise ConfigError(f"config section {section!r} must be a table of keys")
            for name, value in body.items():
                _set_in(given, section, name, value)
    for text in overrides:
        _set_in(given, *parse_override(text), check=True)

    model = dict(given.get("model", {}))
    preset = model.get("preset", ModelConfig().preset)
    if preset not in PRESETS:
        raise ConfigError(f"model.preset must be one of {', '.join(map(repr, PRESETS))}, got {preset!r}")
    given["model"] = {**PRESETS[preset], **model}

    sections = {section: cls(**given.get(section, {})) for section, cls in SECTIONS.items()}
    return Config(**sections)


def validate(cfg: Config) -> None:
    """Check every field of every section again, then the rules across sections (after changing a built
    config's fields by hand; construction already checks)."""
    for section in SECTIONS:
        getattr(cfg, section).__post_init__()
    cfg.__post_init__()


def describe() -> str:
    """Every config key with its default and help, for ``lordo train --help`` and the docs."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        defaults = cls()  # the section alone: optim.lr shows 0 (the strategy's default), not what Config resolves
        for f in fields(cls):
            check = f.metadata.get("check")
            choices = getattr(check, "choices", None)
            extra = f" (one of: {', '.join(map(str, choices))})" if choices else ""
            default = json.dumps(getattr(defaults, f.name))
            lines.append(f"  {section}.{f.name} = {default}  -- {f.metadata['help']}{extra}")
    return "\n".join(lines)
