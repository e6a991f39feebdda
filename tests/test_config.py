"""Config validation: defaults filled, unknown keys and impossible values rejected by name."""

import pytest
import yaml
from conftest import ROOT

from distlm.dag.config import ConfigError, load_config, validate_config


def test_defaults_are_filled():
    cfg = validate_config({})
    assert cfg["data"]["block_size"] == 128
    assert cfg["train"]["profile"]["enabled"] is False
    assert cfg["serve"]["host"] == "127.0.0.1" and cfg["serve"]["token_env"] is None


@pytest.mark.parametrize("name", ["config.yaml", "gpt2-wikitext2.yaml", "gpt2-small-cpu.yaml"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(ROOT / "config" / name)
    assert cfg["runtime"]["device"] in ("cpu", "cuda")


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"colour": 1}, "colour: unknown key"),
        ({"train": {"max_stepz": 3}}, "train.max_stepz: unknown key"),
        ({"data": {"block_size": "big"}}, "data.block_size: 'big' is not of type 'integer'"),
        ({"train": {"lr": -1}}, "train.lr: input should be greater than 0, got -1"),
        (
            {"transfer": {"transport": "carrier-pigeon"}},
            "transfer.transport: 'carrier-pigeon' is not one of 'torch' or 'uccl'",
        ),
        ({"broadcast": {"transport": "torch"}}, "broadcast.transport: moved to transfer.transport"),
        ({"broadcast": {"chunk_mb": 2}}, "broadcast.chunk_mb: moved to transfer.chunk_mb"),
        ({"inference": {"greedy": True}}, "inference.greedy: removed: greedy decoding is"),
        ({"eval": {"splits": ["test", "test"]}}, "eval.splits: 'test' is listed twice"),
        (
            {"inference": {"stages": 5}},
            "inference.stages: 5 pipeline stages but the model has only 4",
        ),
        (
            {"serve": {"stages": 5}},
            "serve.stages: 5 pipeline stages but the model has only 4",
        ),
        (
            {"data": {"block_size": 512}},
            "data.block_size: 512 is beyond the model's context of 256",
        ),
        ({"eval": {"context": 64, "stride": 65}}, "eval.stride"),
        ({"runtime": {"backend": "nccl", "device": "cpu"}}, "runtime.backend"),
        ({"model": {"source": "hub"}}, "model.name: required"),
        ({"model": {"init": {"n_embd": 100, "n_head": 3}}}, "model.init.n_embd"),
        ({"data": {"source": "local"}}, "data.local.train"),
    ],
)
def test_bad_config_names_the_key(raw, key):
    with pytest.raises(ConfigError) as e:
        validate_config(raw)
    assert key in str(e.value)


def test_bad_yaml_names_the_file(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(p)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_local_model_folder_architecture_is_checked(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_positions": 64}')
    raw = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    raw["model"] = {"source": "local", "name": str(tmp_path)}
    with pytest.raises(
        ConfigError, match="data.block_size: 128 is beyond the model's context of 64"
    ):
        validate_config(raw)
    raw["inference"] = {"stages": 3}
    with pytest.raises(
        ConfigError, match="inference.stages: 3 pipeline stages but the model has only 2"
    ):
        validate_config(raw)


def test_command_line_strings_are_coerced_to_the_schema_type():
    """snakemake --config 'train={"max_steps": 100}' hands over '100' (a string)."""
    cfg = validate_config(
        {
            "train": {"max_steps": "100", "lr": "3e-4", "compile": "true"},
            "eval": {"context": "null"},
        }
    )
    assert cfg["train"]["max_steps"] == 100 and cfg["train"]["lr"] == 3e-4
    assert cfg["train"]["compile"] is True and cfg["eval"]["context"] is None
    with pytest.raises(ConfigError, match="train.max_steps: 'many' is not of type 'integer'"):
        validate_config({"train": {"max_steps": "many"}})
    with pytest.raises(ConfigError, match="train.max_steps: True is not of type 'integer'"):
        validate_config({"train": {"max_steps": True}})
    assert (
        validate_config({"model": {"name": "123"}, "data": {"source": "embedded"}})["model"]["name"]
        == "123"
    )
