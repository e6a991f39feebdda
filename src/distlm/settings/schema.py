"""The JSON schema of the config, generated from the models (`Settings.model_json_schema`) in the
shape Snakemake's `validate` and JSON-schema tools read: every section inlined (no `$ref`), a
nested section's default `{}` (its keys' defaults fill it), nullable keys as `type: [T, "null"]`.

`python -m distlm.settings --write|--check` keeps `workflow/schemas/config.schema.yaml` (what
Snakemake and editors read) equal to `schema_yaml()`; the library never reads that file.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import yaml

from distlm.settings.root import Settings

SCHEMA_FILE = "workflow/schemas/config.schema.yaml"  # relative to a checkout's root

# the order keys are written in, for a readable file; others follow in pydantic's order
_ORDER = (
    "$schema",
    "title",
    "type",
    "enum",
    "items",
    "pattern",
    "minLength",
    "minimum",
    "exclusiveMinimum",
    "maximum",
    "exclusiveMaximum",
    "minItems",
    "uniqueItems",
    "default",
    "description",
    "additionalProperties",
    "properties",
)


def _inline(node: Any, defs: dict) -> Any:
    if isinstance(node, list):
        return [_inline(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = _inline(copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[1]]), defs)
        rest = {k: _inline(v, defs) for k, v in node.items() if k != "$ref"}
        if "default" in rest and target.get("type") == "object":
            rest["default"] = {}  # its keys' own defaults fill it in
        # the field's description (where it has one) wins over the class docstring
        return {**target, **rest}
    out = {k: _inline(v, defs) for k, v in node.items() if k not in ("$defs", "title")}
    if "anyOf" in out:  # `T | None`: one type list, the constraints of T
        members = out["anyOf"]
        nulls = [m for m in members if m == {"type": "null"}]
        others = [m for m in members if m != {"type": "null"}]
        if len(nulls) == 1 and len(others) == 1 and isinstance(others[0].get("type"), str):
            del out["anyOf"]
            out = {**others[0], **out, "type": [others[0]["type"], "null"]}
    if "properties" in node:
        out["properties"] = {
            k: _inline(v, defs) for k, v in node["properties"].items()
        }  # property names are keys, never dropped
    return out


def _merge_families(node: Any) -> Any:
    """model.init, a union of the families' init settings (`oneOf`, one object a family told apart
    by its `architecture` const), as one object for editors and the config's walkers: every key
    of every family, `architecture` an enum, each family's own key saying whose it is. The models
    (a discriminated union) refuse the keys of another family; the schema is no second gate."""
    if isinstance(node, list):
        return [_merge_families(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _merge_families(v) for k, v in node.items()}
    members = node.get("oneOf")
    if not members or not all("architecture" in m.get("properties", {}) for m in members):
        return node
    names = [m["properties"]["architecture"]["const"] for m in members]
    owners: dict[str, list[str]] = {}
    for name, m in zip(names, members):
        for key in m["properties"]:
            owners.setdefault(key, []).append(name)
    props: dict[str, Any] = {}
    for m in members:
        for key, sub in m["properties"].items():
            if key in props:
                continue
            sub = dict(sub)
            if key == "architecture":
                sub.pop("const")
                # no default: a config that names no family dumps without the key (the first's)
                sub = {**sub, "enum": names}
                sub["description"] = (
                    "The model family: "
                    + "; ".join(
                        str(x["properties"]["architecture"]["description"]).rstrip(".")
                        for x in members
                    )
                    + f". Default: {names[0]}."
                )
            elif len(owners[key]) < len(members):
                sub["description"] = f"{', '.join(owners[key])} only: {sub.get('description', '')}"
            props[key] = sub
    rest = {k: v for k, v in node.items() if k != "oneOf"}
    return {
        **rest,
        "type": "object",
        "default": {},
        "additionalProperties": False,
        "properties": props,
    }


def _tidy(node: Any) -> Any:
    """Keys in a readable order, descriptions on one line (docstrings wrap)."""
    if isinstance(node, list):
        return [_tidy(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k in ("default", "enum") else _tidy(v)) for k, v in node.items()}
    if isinstance(out.get("description"), str):
        out["description"] = " ".join(out["description"].split())
    if "properties" in node:
        out["properties"] = {k: _tidy(v) for k, v in node["properties"].items()}
    return {
        **{k: out[k] for k in _ORDER if k in out},
        **{k: v for k, v in out.items() if k not in _ORDER},
    }


@cache
def _schema() -> dict:
    raw = Settings.model_json_schema(mode="validation")
    body = _tidy(_merge_families(_inline(raw, raw.get("$defs", {}))))
    head = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "distlm workflow configuration",
    }
    return {**head, **body}


def settings_schema() -> dict:
    """The config's JSON schema (a fresh copy), made from the models."""
    return copy.deepcopy(_schema())


HEADER = (
    "# Generated from the models in src/distlm/settings by `python -m distlm.settings --write`;\n"
    "# do not edit. config/README.md explains every key.\n"
)


def schema_yaml() -> str:
    """The schema file's text."""
    return HEADER + yaml.safe_dump(
        settings_schema(), sort_keys=False, width=100, allow_unicode=True
    )
