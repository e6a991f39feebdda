"""A config mapping (YAML, Snakemake's `config`) -> `Settings`, with errors that name the key.

Snakemake's `--config 'train={"max_steps": 100}'` hands nested values over as strings: a string
is turned into the number, boolean or null its key asks for when it parses as one, before the
models (strict: no other coercion) check it. Defaults are filled into the mapping from the models,
so the workflow's `config` keeps the values as written; the typed settings keep them too, in the
config's key order (distlm.settings.base.Section), so each rule's params, dumped from them, are
the mapping the config held.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from distlm.family import REGISTRY
from distlm.settings.base import ConfigError
from distlm.settings.root import Settings, moved_keys
from distlm.settings.schema import settings_schema

_SCALARS = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None)}


def coerce_strings(cfg: Any, schema: Mapping) -> None:
    """In place: a string where the schema asks for a number, boolean or null becomes one when
    YAML parses it as one."""
    if not isinstance(cfg, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in cfg:
            continue
        value = cfg[name]
        if isinstance(value, dict):
            coerce_strings(value, sub)
            continue
        types = sub.get("type", [])
        types = [types] if isinstance(types, str) else types
        if not isinstance(value, str) or "string" in types or not types:
            continue
        try:
            parsed = yaml.safe_load(value)
        except yaml.YAMLError:
            continue
        if isinstance(parsed, str) and "number" in types:  # YAML 1.1 reads "3e-4" as a string
            try:
                parsed = float(parsed)
            except ValueError:
                continue
        ok = [t for t in types if t in _SCALARS and isinstance(parsed, _SCALARS[t])]
        if ok and not (isinstance(parsed, bool) and "boolean" not in ok):
            cfg[name] = parsed


def fill_defaults(cfg: Any, schema: Mapping) -> None:
    """In place: every key the config leaves out gets the schema's (the models') default."""
    if not isinstance(cfg, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in cfg and "default" in sub:
            cfg[name] = copy.deepcopy(sub["default"])
        if name in cfg and "properties" in sub:
            fill_defaults(cfg[name], sub)


_TYPES = {
    "int_type": "integer",
    "int_parsing": "integer",
    "int_from_float": "integer",
    "float_type": "number",
    "float_parsing": "number",
    "bool_type": "boolean",
    "bool_parsing": "boolean",
    "string_type": "string",
    "list_type": "array",
    "model_type": "object",
    "model_attributes_type": "object",
    "dict_type": "object",
}


def _section(loc: tuple) -> type[BaseModel] | None:
    """The model at `loc` (a path of field names under Settings), if it is one."""
    model: Any = Settings
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


_INIT = ("model", "init")


def _family_key(loc: tuple) -> tuple[tuple, str | None]:
    """A model.init error's key without the family tag pydantic puts in it, and that family."""
    if loc[:2] == _INIT and len(loc) > 2 and loc[2] in REGISTRY:
        return (*_INIT, *loc[3:]), str(loc[2])
    return loc, None


def explain(e: ValidationError) -> list[str]:
    """One line per error, each naming the dotted key; enums list their valid values."""
    lines = []
    for err in e.errors():
        loc, family = _family_key(tuple(err["loc"]))
        key = ".".join(str(p) for p in loc)
        kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
        if kind == "extra_forbidden" and family is not None and len(loc) == 3:
            others = [n for n, s in REGISTRY.items() if loc[2] in s.init.model_fields]
            known = ", ".join(REGISTRY[family].init.model_fields)
            where = f"a key of architecture {', '.join(others)}, not" if others else "unknown in"
            lines.append(f"{key}: {where} {family} (known here: {known})")
        elif kind == "extra_forbidden":
            section = _section(loc[:-1])
            known = ", ".join(section.model_fields) if section else "?"
            lines.append(f"{key}: unknown key (known here: {known})")
        elif kind == "union_tag_invalid" and loc == _INIT:
            lines.append(
                f"model.init.architecture: {ctx.get('tag')!r} is not one of "
                f"{', '.join(map(repr, REGISTRY))}"
            )
        elif kind == "literal_error":
            lines.append(f"{key}: {value!r} is not one of {ctx.get('expected')}")
        elif kind in _TYPES:
            lines.append(f"{key}: {value!r} is not of type '{_TYPES[kind]}'")
        elif kind == "value_error":
            msg = str(ctx.get("error", err["msg"]))
            lines.append(f"{key}: {msg}" if key else msg)
        else:
            msg = err["msg"]
            lines.append(f"{key}: {msg[:1].lower()}{msg[1:]}, got {value!r}")
    return lines


def deep_merge(base: Mapping, over: Mapping) -> dict:
    """`over` merged into a copy of `base`, section by section (a non-mapping value replaces)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def with_override(settings: Settings, override: Mapping[str, Any], *, source: str) -> Settings:
    """`settings` with `override` (a partial config in nested sections: a sweep run's) merged over
    it, through the one validation: the typed settings of that run, or ConfigError naming
    `source` and the key. The result has no sweep of its own."""
    base = settings.model_dump(exclude={"sweep"})  # the validated mapping, in the config's order
    return validate(deep_merge(base, override), source=source)[1]


def validate(config: Mapping | None, *, source: str = "config") -> tuple[dict, Settings]:
    """(the config with defaults filled in, its Settings), or ConfigError naming every bad key."""
    cfg = copy.deepcopy(dict(config or {}))
    moved = moved_keys(cfg)
    if moved:
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(moved))
    schema = settings_schema()
    coerce_strings(cfg, schema)
    fill_defaults(cfg, schema)
    try:
        settings = Settings.model_validate(cfg)
    except ValidationError as e:
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(explain(e))) from None
    except ConfigError as e:
        raise ConfigError(f"{source} is invalid:\n  {e}") from None
    return cfg, settings
