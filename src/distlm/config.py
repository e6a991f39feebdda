"""The one source of truth for settings: a YAML config validated against the JSON schema.

`validate_config` fills defaults, rejects unknown keys and out-of-range values, then checks the
constraints that span keys (stages vs layers, block size vs context). Every error names the key.
Stage scripts receive the resolved config written by the workflow, never a second set of defaults.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import jsonschema.validators
import yaml

from distlm import DistlmError
from distlm.io import digest, read_json, write_json

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(DistlmError):
    """A config key is unknown, mistyped or impossible; the message names the key."""


def load_schema(path: str | os.PathLike = SCHEMA_PATH) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _with_defaults(cls):
    validate_props = cls.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_props(validator, properties, instance, schema)

    return jsonschema.validators.extend(cls, {"properties": set_defaults})


_Validator = _with_defaults(jsonschema.Draft202012Validator)


_SCALARS = {"integer": int, "number": (int, float), "boolean": bool, "null": type(None)}


def _coerce_strings(cfg: Any, schema: dict) -> None:
    """Snakemake's `--config 'train={"max_steps": 100}'` passes nested values as strings: turn a
    string into the number, boolean or null its schema asks for when it parses as one."""
    if not isinstance(cfg, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        if name not in cfg:
            continue
        value = cfg[name]
        if isinstance(value, dict):
            _coerce_strings(value, sub)
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


def _key(path: Iterable[Any]) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def validate_config(config: Mapping, *, schema: dict | None = None, source: str = "config") -> dict:
    """Return a validated copy of `config` with defaults filled in, or raise ConfigError."""
    cfg = copy.deepcopy(dict(config or {}))
    schema = schema or load_schema()
    _coerce_strings(cfg, schema)
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = []
        for e in errors:
            where = _key(e.absolute_path)
            if e.validator == "additionalProperties":
                extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
                known = ", ".join(sorted(e.schema.get("properties", {})))
                for k in extra:
                    lines.append(
                        f"{_key([*e.absolute_path, k])}: unknown key (known here: {known})"
                    )
            else:
                lines.append(f"{where}: {e.message}")
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(lines))
    check_consistency(cfg, source=source)
    return cfg


def check_consistency(cfg: dict, *, source: str = "config") -> None:
    """Constraints the schema cannot express; known before any job starts."""
    problems = []
    arch = known_architecture(cfg)
    if arch is not None:
        n_layer, n_positions = arch
        if cfg["inference"]["stages"] > n_layer:
            problems.append(
                f"inference.stages: {cfg['inference']['stages']} pipeline stages but the model has "
                f"only {n_layer} layers"
            )
        if cfg["data"]["block_size"] > n_positions:
            problems.append(
                f"data.block_size: {cfg['data']['block_size']} is beyond the model's context "
                f"of {n_positions} positions"
            )
        ctx = cfg["eval"]["context"]
        if ctx is not None and ctx > n_positions:
            problems.append(f"eval.context: {ctx} is beyond the model's context of {n_positions}")
        stride = cfg["eval"]["stride"]
        if ctx is None and stride is not None and stride > n_positions:
            problems.append(
                f"eval.stride: {stride} is larger than the context (eval.context null = the "
                f"model's {n_positions})"
            )
    ev = cfg["eval"]
    if ev["context"] is not None and ev["stride"] is not None and ev["stride"] > ev["context"]:
        problems.append(f"eval.stride: {ev['stride']} is larger than eval.context {ev['context']}")
    if cfg["runtime"]["backend"] == "nccl" and cfg["runtime"]["device"] == "cpu":
        problems.append(
            "runtime.backend: nccl needs runtime.device cuda (or auto); use gloo on cpu"
        )
    m = cfg["model"]
    if m["source"] in ("hub", "local") and not m["name"]:
        problems.append(f"model.name: required when model.source is {m['source']}")
    if m["source"] == "init" and m["init"]["n_embd"] % m["init"]["n_head"]:
        problems.append(
            f"model.init.n_embd: {m['init']['n_embd']} is not divisible by "
            f"model.init.n_head {m['init']['n_head']}"
        )
    d = cfg["data"]
    if d["source"] == "local" and not d["local"]["train"]:
        problems.append("data.local.train: at least one file is required when data.source is local")
    if problems:
        raise ConfigError(f"{source} is invalid:\n  " + "\n  ".join(problems))


def known_architecture(cfg: dict) -> tuple[int, int] | None:
    """(n_layer, n_positions) when known without the network: init config or a local folder."""
    m = cfg["model"]
    if m["source"] == "init":
        return m["init"]["n_layer"], m["init"]["n_positions"]
    if m["source"] == "local" and m["name"]:
        p = Path(m["name"]) / "config.json"
        if p.is_file():
            import json

            try:
                c = json.loads(p.read_text())
                return int(c.get("n_layer", c.get("num_hidden_layers"))), int(
                    c.get("n_positions", c.get("max_position_embeddings"))
                )
            except (ValueError, TypeError, json.JSONDecodeError):
                raise ConfigError(f"model.name: {p} is not a readable model config") from None
    return None


def load_config(path: str | os.PathLike, overrides: Mapping | None = None) -> dict:
    """Read a YAML config file, merge `overrides` (nested dicts), validate and return it."""
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
    return validate_config(raw, source=f"config {path}")


def deep_merge(base: Mapping, over: Mapping) -> dict:
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def write_resolved(part: Mapping, path: str | os.PathLike) -> str:
    """Write the config keys a multi-process stage reads (distlm.stages.stage_config) with their
    digest, for every rank to read; return the digest."""
    part = copy.deepcopy(dict(part))
    part["_digest"] = digest(part)
    write_json(path, part)
    return part["_digest"]


def read_resolved(path: str | os.PathLike) -> dict:
    return read_json(path, what="resolved config")
