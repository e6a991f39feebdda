"""Reading a YAML config: the file, overrides merged over it, validated by `distlm.settings`.

`validate_config` fills defaults, rejects unknown keys, moved keys and out-of-range values, then
checks the constraints that span keys (stages vs layers, block size vs context). Every error names
the key. The workflow holds the typed `Settings` (each rule's params are its stage's typed config,
`distlm.settings.stage_configs`); the library takes the typed `Settings` too (`load_settings`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import yaml

from distlm.settings import ConfigError, Settings
from distlm.settings.validate import deep_merge, validate

__all__ = [
    "ConfigError",
    "deep_merge",
    "load_config",
    "load_settings",
    "validate_config",
    "validate_settings",
]


def validate_config(config: Mapping | None, *, source: str = "config") -> dict:
    """Return a validated copy of `config` with defaults filled in, or raise ConfigError."""
    return validate(config, source=source)[0]


def validate_settings(config: Mapping | None, *, source: str = "config") -> Settings:
    """The typed settings of a config mapping (defaults filled), or ConfigError."""
    return validate(config, source=source)[1]


def _read(path: str | os.PathLike, overrides: Mapping | None) -> tuple[dict, str]:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    if overrides:
        raw = deep_merge(raw, overrides)
    return raw, f"config {path}"


def load_settings(path: str | os.PathLike, overrides: Mapping | None = None) -> Settings:
    """Read a YAML config file, merge `overrides` (nested dicts), validate: the typed settings."""
    raw, source = _read(path, overrides)
    return validate(raw, source=source)[1]


def load_config(path: str | os.PathLike, overrides: Mapping | None = None) -> dict:
    """Read a YAML config file, merge `overrides` (nested dicts), validate and return it (the
    mapping, defaults filled in; `load_settings` gives the typed settings)."""
    raw, source = _read(path, overrides)
    return validate_config(raw, source=source)
