"""The settings layer (distlm.settings): the models are the source, the schema file is generated
from them and Snakemake's `validate` reads it, old keys say where they went."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import typing

import pytest
import yaml
from conftest import ROOT, TINY
from pydantic import BaseModel, ValidationError

from distlm.dag.config import ConfigError, validate_config, validate_settings
from distlm.settings import (
    MOVED,
    InferenceSettings,
    SamplingSettings,
    Settings,
)
from distlm.settings.schema import SCHEMA_FILE, schema_yaml, settings_schema
from distlm.settings.validate import with_override


def test_schema_file_is_generated_from_the_models():
    assert (ROOT / SCHEMA_FILE).read_text(encoding="utf-8") == schema_yaml()
    proc = subprocess.run(
        [sys.executable, "-m", "distlm.settings", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_check_fails_on_a_stale_file(tmp_path):
    (tmp_path / "workflow/schemas").mkdir(parents=True)
    (tmp_path / SCHEMA_FILE).write_text(schema_yaml().replace("default: 128", "default: 64"))
    cmd = [sys.executable, "-m", "distlm.settings", "--check", "--root", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1 and "--write" in proc.stderr


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, f in model.model_fields.items():
        yield prefix + name, f
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, prefix + name + ".")


def test_every_key_is_described_and_strict():
    undescribed = [k for k, f in _fields(Settings) if not f.description]
    assert not undescribed, f"keys without a description: {undescribed}"
    for _, f in _fields(Settings):
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cfg = ann.model_config
            assert cfg.get("extra") == "forbid" and cfg.get("frozen"), ann.__name__


def _snakemake_validate(data: dict) -> dict:
    from snakemake.utils import validate

    validate(data, str(ROOT / SCHEMA_FILE), set_default=True)
    return data


@pytest.mark.parametrize(
    "path", [TINY, ROOT / "config/config.yaml", ROOT / "config/gpt2-wikitext2.yaml"]
)
def test_snakemake_validate_fills_the_same_defaults(path):
    """Snakemake's own `validate` reads the generated schema and fills every default the models
    fill (a workflow that validates with it gets the same config)."""
    raw = yaml.safe_load(path.read_text())
    assert _snakemake_validate(copy.deepcopy(raw)) == validate_config(raw)
    assert _snakemake_validate({}) == validate_config({})


def test_snakemake_validate_refuses_what_the_models_refuse():
    import snakemake.exceptions

    for bad in ({"train": {"lr": 0}}, {"colour": 1}, {"broadcast": {"transport": "torch"}}):
        with pytest.raises(snakemake.exceptions.WorkflowError):
            _snakemake_validate(bad)
        with pytest.raises(ConfigError):
            validate_config(bad)


@pytest.mark.parametrize(
    "path", [TINY, ROOT / "config/config.yaml", ROOT / "config/gpt2-wikitext2.yaml"]
)
def test_settings_dump_to_the_config_as_written(path):
    """The workflow's config (every rule's params) and the typed settings agree value for value
    and type for type: an integer given for a real-valued key stays an integer, so every digest
    of settings (stage configs, data and model digests, the train run identity) is unchanged."""
    cfg = validate_config(yaml.safe_load(path.read_text()))
    assert Settings.model_validate(cfg).model_dump(exclude={"sweep"}) == cfg  # absent: no sweep
    cfg = validate_config({"transfer": {"bucket_mb": 2}, "train": {"lr": 1}})
    s = Settings.model_validate(cfg)
    assert type(s.transfer.bucket_mb) is int and type(s.train.lr) is int
    assert type(s.runtime.timeout_s) is int  # the default, 300
    assert type(Settings.model_validate({"train": {"lr": 0.5}}).train.lr) is float


def test_an_override_goes_through_the_one_validation():
    """A sweep run's settings (distlm.settings.validate.with_override): the base settings with a
    partial config merged over them, validated as a whole config is; errors name the source."""
    base = validate_settings(yaml.safe_load(TINY.read_text()))
    run = with_override(base, {"train": {"lr": 2}, "eval": {"stride": 16}}, source="run 'a'")
    assert run.train.lr == 2 and type(run.train.lr) is int and run.eval.stride == 16
    assert run.model_dump(exclude={"train", "eval"}) == base.model_dump(exclude={"train", "eval"})
    assert run.train.model_dump(exclude={"lr"}) == base.train.model_dump(exclude={"lr"})
    with pytest.raises(ConfigError, match=r"run 'a' is invalid:\n  train\.lrr: unknown key"):
        with_override(base, {"train": {"lrr": 1}}, source="run 'a'")
    with pytest.raises(ConfigError, match=r"run 'b' is invalid:\n  inference\.stages: 9"):
        with_override(base, {"inference": {"stages": 9}}, source="run 'b'")  # across keys


@pytest.mark.parametrize("key", sorted(MOVED))
def test_moved_keys_say_where_they_went(key):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{key}: (moved to|removed)") as e:
        validate_config({section: {name: 1}})
    new = {"broadcast": "transfer", "inference": "inference"}[section]
    assert f"{new}." in str(e.value)
    with pytest.raises(ValidationError, match=key.replace(".", r"\.")):
        Settings.model_validate({section: {name: 1}})


def test_sampling_ranges_are_defined_once():
    """`inference` is a SamplingSettings (its flat sampling keys are that model's own), so the
    sampler gets the settings' model, not a copy; both refuse the same out-of-range values."""
    s = InferenceSettings(temperature=0.5, top_k=3, top_p=0.9, seed=7, max_new_tokens=5)
    assert isinstance(s, SamplingSettings)
    assert InferenceSettings().temperature == 0  # the default: greedy, as `greedy: true` was
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": -1}):
        for model in (SamplingSettings, InferenceSettings):
            with pytest.raises(ValidationError, match=next(iter(bad))):
                model.model_validate(bad)


def test_validation_needs_no_checkout(tmp_path):
    """The library validates with the package alone, as a non-editable install has it: no file
    outside src/distlm (the schema is made from the models in memory)."""
    import shutil

    shutil.copytree(ROOT / "src" / "distlm", tmp_path / "site" / "distlm")
    site = str(tmp_path / "site")
    code = (
        "import distlm.dag.config as c, distlm.settings.schema as s;"
        f"assert c.__file__.startswith({site!r});"
        "assert c.validate_config({})['train']['keep_last'] == 2;"
        "assert s.settings_schema()['properties']['serve']['properties']['stages']['minimum'] == 1"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def _models(ann: object) -> list[type[BaseModel]]:
    """The models a field holds: its type, or each member of a union of models (model.init: the
    families' init settings), in order; [] for a leaf."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    members = [typing.get_args(a)[0] if typing.get_args(a) else a for a in typing.get_args(ann)]
    if typing.get_origin(ann) is typing.Annotated:
        return _models(typing.get_args(ann)[0])
    if members and all(isinstance(m, type) and issubclass(m, BaseModel) for m in members):
        return members
    return []


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, object]:
    """Every leaf key of a model, dotted, with its FieldInfo (a union of models: every member's
    keys, the first's where they share one)."""
    out: dict[str, object] = {}
    for name, f in model.model_fields.items():
        models = _models(f.annotation)
        for m in models:
            for k, v in _leaves(m, f"{prefix}{name}.").items():
                out.setdefault(k, v)
        if not models:
            out[prefix + name] = f
    return out


def test_stage_config_types_are_the_declared_keys():
    """Each stage's document type holds exactly the keys distlm.dag.stages declares for it, each with
    Settings' own field (type, range, default): the two cannot drift."""
    from distlm.dag.stages import NOT_STAGE_KEYS, STAGES, schema_keys
    from distlm.settings.stage_configs import STAGE_CONFIGS

    assert set(STAGE_CONFIGS) == set(STAGES)
    every = {k: f for k, f in _leaves(Settings).items() if k not in NOT_STAGE_KEYS}
    assert list(every) == schema_keys(settings_schema())
    for stage, cls in STAGE_CONFIGS.items():
        mine = {k: f for k, f in _leaves(cls).items() if k != "digest"}
        declared = [k for k in every if STAGES[stage].covers(k)]
        assert sorted(mine) == sorted(declared), stage
        for k, f in mine.items():
            assert repr(f) == repr(every[k]), (stage, k)


def test_stage_config_document_round_trip(tmp_path):
    from distlm.core.documents import DocumentError, read_document
    from distlm.core.io import digest
    from distlm.dag.stages import stage_config
    from distlm.settings.eval import EvalConfig
    from distlm.settings.stage_configs import write_stage_config
    from distlm.settings.train import TrainConfig

    cfg = validate_config(yaml.safe_load(TINY.read_text()))
    params = stage_config(cfg, "train")
    path = tmp_path / "train.json"
    assert write_stage_config("train", params, path) == digest(params)
    doc = read_document(path, TrainConfig)
    assert doc.params() == params and doc.digest == digest(params)
    assert doc.train.max_steps == cfg["train"]["max_steps"]
    with pytest.raises(DocumentError, match="distlm-config-train"):
        read_document(path, EvalConfig)
    with pytest.raises(ValidationError, match="train.lr"):
        TrainConfig.of({**params, "train": {**params["train"], "lr": -1}})


def test_stage_params_keep_the_config_key_order_and_values():
    """A rule's params are dumped from the typed settings and are the mapping the config held,
    key order and ints included: Snakemake compares params by their repr, so another order or
    2.0 for 2 would rerun every stage of a results folder an earlier release made."""
    from distlm.settings.stage_configs import stage_params
    from distlm.settings.validate import validate

    raw = yaml.safe_load(TINY.read_text())
    raw["train"] = dict(reversed(list(raw["train"].items())))
    raw["transfer"] = {"timeout_s": 60, **raw["transfer"]}
    cfg, settings = validate(raw)
    for stage in ("train", "model", "report"):  # stages that read whole sections
        for section, value in stage_params(settings, stage).items():
            assert repr(value) == repr(cfg[section]), (stage, section)  # order and types
    assert list(stage_params(settings, "train")["train"])[:2] == list(raw["train"])[:2]
    assert stage_params(settings, "train")["transfer"]["timeout_s"] == 60  # an int, not 60.0
    assert validate(yaml.safe_load(TINY.read_text()))[1] == settings.model_copy(
        update={"train": validate(yaml.safe_load(TINY.read_text()))[1].train}
    )  # equality is the values', whatever the key order


@pytest.mark.parametrize(
    ("key", "other"),
    [
        ("train.parallel", "fsdp"),
        ("train.activation_checkpointing", True),
        ("inference.cuda_graphs", False),
        ("inference.steps_in_flight", 2),
    ],
)
def test_a_key_newer_than_the_configs_dumps_only_when_it_differs_from_its_default(key, other):
    """A key marked ONLY_WHEN_SET (distlm.core.section): a config without it, or with it at its
    default, dumps the stage's params it dumped before the key existed (an upgrade reruns
    nothing); another value is in them (an edit reruns the stages that read it)."""
    from distlm.dag.stages import STAGES
    from distlm.settings.stage_configs import stage_params
    from distlm.settings.validate import validate

    section, name = key.split(".")
    stage = next(s for s in STAGES if STAGES[s].covers(key))
    raw = yaml.safe_load(TINY.read_text())
    before = stage_params(validate(copy.deepcopy(raw))[1], stage)
    assert name not in before[section]
    default = Settings.model_fields[section].annotation.model_fields[name].default  # type: ignore[union-attr]
    for value, dumped in ((default, False), (other, True)):
        edited = copy.deepcopy(raw)
        edited.setdefault(section, {})[name] = value
        params = stage_params(validate(edited)[1], stage)
        assert (name in params[section]) is dumped
        if not dumped:
            assert params == before
