"""The rerun matrix: for every key of the config schema, what a dry run plans after editing it on
one finished tiny workflow must be exactly the jobs the table says; caching is the product.

The table is written here by hand, not derived from distlm.dag.stages, so that it checks the
declarations; a schema key with no row fails the test. One finished run, many dry runs (two at a
time), so it stays within a couple of minutes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY, copy_workflow, snakemake_cmd

from distlm.dag.config import deep_merge, validate_config
from distlm.dag.stages import STAGES, reruns, schema_keys, select
from distlm.dag.tables import rerun_table

pytestmark = pytest.mark.slow

SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
BASE = yaml.safe_load((ROOT / "config/config.yaml").read_text())

DATA = {"prepare_data"}
MODEL = {"serialize_model"}
BROADCAST = {"broadcast"}
TRAIN = {"train", "evaluate[trained]", "shard[trained]", "inference"}
EVAL = {"evaluate[base]", "evaluate[trained]"}
INFER = {"inference"}
REPORT = {"report"}
ALL_FROM_MODEL = MODEL | BROADCAST | TRAIN | EVAL | REPORT
ALL = DATA | ALL_FROM_MODEL
TORCH = BROADCAST | TRAIN | EVAL | REPORT  # every torch.distributed stage and what follows
NOTHING: set[str] = set()


def _llama(**init) -> dict:
    """An edit of a Llama-family key: model.init with architecture llama and that key."""
    return {"model": {"init": {"architecture": "llama", **init}}}


# key -> (the edit, as a config overlay; the jobs it reruns). Values differ from tiny.yaml's.
MATRIX: dict[str, tuple[dict, set[str]]] = {
    "runtime.device": ({"runtime": {"device": "auto"}}, TORCH | INFER),
    "runtime.backend": ({"runtime": {"backend": "nccl", "device": "auto"}}, TORCH | INFER),
    "runtime.timeout_s": ({"runtime": {"timeout_s": 99}}, TORCH),
    "runtime.seed": ({"runtime": {"seed": 7}}, TRAIN | REPORT),
    "data.source": ({"data": {"source": "hub"}}, ALL),
    "data.hub.path": ({"data": {"hub": {"path": "other"}}}, ALL),
    "data.hub.name": ({"data": {"hub": {"name": "other"}}}, ALL),
    "data.hub.revision": ({"data": {"hub": {"revision": "main"}}}, ALL),
    "data.hub.splits.train": ({"data": {"hub": {"splits": {"train": "tr"}}}}, ALL),
    "data.hub.splits.validation": ({"data": {"hub": {"splits": {"validation": "va"}}}}, ALL),
    "data.hub.splits.test": ({"data": {"hub": {"splits": {"test": "te"}}}}, ALL),
    "data.local.train": ({"data": {"local": {"train": ["a.txt"]}}}, ALL),
    "data.local.validation": ({"data": {"local": {"validation": ["b.txt"]}}}, ALL),
    "data.local.test": ({"data": {"local": {"test": ["c.txt"]}}}, ALL),
    "data.text_field": ({"data": {"text_field": "body"}}, ALL),
    "data.separator": ({"data": {"separator": "\n"}}, ALL),
    "data.validation_fraction": ({"data": {"validation_fraction": 0.1}}, ALL),
    "data.test_fraction": ({"data": {"test_fraction": 0.1}}, ALL),
    "data.block_size": ({"data": {"block_size": 32}}, ALL),
    "data.shard_mb": ({"data": {"shard_mb": 8}}, ALL),
    "data.tokenizer.vocab_size": ({"data": {"tokenizer": {"vocab_size": 512}}}, ALL),
    "data.tokenizer.min_frequency": ({"data": {"tokenizer": {"min_frequency": 3}}}, ALL),
    "data.tokenizer.sample_mb": ({"data": {"tokenizer": {"sample_mb": 1}}}, ALL),
    "data.tokenizer.name": ({"data": {"tokenizer": {"name": "gpt2"}}}, ALL),
    "model.source": ({"model": {"source": "hub", "name": "gpt2"}}, ALL),
    "model.name": ({"model": {"name": "gpt2"}}, ALL),
    "model.revision": ({"model": {"revision": "main"}}, ALL),
    "model.dtype": ({"model": {"dtype": "bfloat16"}}, ALL_FROM_MODEL),
    "model.init.n_layer": ({"model": {"init": {"n_layer": 4}}}, ALL_FROM_MODEL),
    "model.init.n_head": ({"model": {"init": {"n_head": 4}}}, ALL_FROM_MODEL),
    "model.init.n_embd": ({"model": {"init": {"n_embd": 32}}}, ALL_FROM_MODEL),
    "model.init.n_positions": ({"model": {"init": {"n_positions": 96}}}, ALL_FROM_MODEL),
    "model.init.dropout": ({"model": {"init": {"dropout": 0.1}}}, ALL_FROM_MODEL),
    "model.init.seed": ({"model": {"init": {"seed": 1}}}, ALL_FROM_MODEL),
    # the Llama family's keys (each with architecture llama: GPT-2 refuses them)
    "model.init.architecture": ({"model": {"init": {"architecture": "llama"}}}, ALL_FROM_MODEL),
    "model.init.tie_embeddings": (_llama(tie_embeddings=False), ALL_FROM_MODEL),
    "model.init.n_kv_head": (_llama(n_kv_head=1), ALL_FROM_MODEL),
    "model.init.intermediate_size": (_llama(intermediate_size=96), ALL_FROM_MODEL),
    "model.init.rope_theta": (_llama(rope_theta=5e5), ALL_FROM_MODEL),
    "model.init.rope_scaling": (
        _llama(rope_scaling={"factor": 4.0, "original_max_position_embeddings": 64}),
        ALL_FROM_MODEL,
    ),
    "model.init.rms_norm_eps": (_llama(rms_norm_eps=1e-6), ALL_FROM_MODEL),
    # Qwen3's own key (tiny.yaml: width 64, 2 heads of 32; heads of 8 instead)
    "model.init.head_dim": (
        {"model": {"init": {"architecture": "qwen3", "head_dim": 8}}},
        ALL_FROM_MODEL,
    ),
    "transfer.transport": ({"transfer": {"transport": "uccl"}}, BROADCAST | TRAIN | REPORT),
    "transfer.bucket_mb": ({"transfer": {"bucket_mb": 0.5}}, BROADCAST | TRAIN | REPORT),
    "transfer.chunk_mb": ({"transfer": {"chunk_mb": 0.125}}, BROADCAST | TRAIN | REPORT),
    "transfer.timeout_s": ({"transfer": {"timeout_s": 30}}, BROADCAST | TRAIN | REPORT),
    "broadcast.receivers": ({"broadcast": {"receivers": 1}}, BROADCAST | REPORT),
    **{
        f"train.{k}": ({"train": {k: v}}, TRAIN | REPORT)
        for k, v in {
            "nodes": 2,
            "nproc_per_node": 1,
            "max_steps": 9,
            "micro_batch_size": 2,
            "grad_accum_steps": 2,
            "lr": 0.003,
            "min_lr": 0.00002,
            "warmup_steps": 3,
            "weight_decay": 0.2,
            "beta1": 0.8,
            "beta2": 0.99,
            "grad_clip": 0.5,
            "precision": "bf16",
            "compile": True,
            "ckpt_every": 2,
            "keep_last": 3,
            "keep_runs": 5,
            "eval_every": 2,
            "eval_batches": 1,
            "log_every": 2,
            "max_restarts": 1,
            "global_batch_size": 16,
            "resume": "never",
            "fast_kernels": False,
            "parallel": "fsdp",
            "activation_checkpointing": True,
        }.items()
    },
    "train.ddp.bucket_cap_mb": ({"train": {"ddp": {"bucket_cap_mb": 5}}}, TRAIN | REPORT),
    "train.ddp.static_graph": ({"train": {"ddp": {"static_graph": True}}}, TRAIN | REPORT),
    "train.fsdp.reduce_every_micro_batch": (
        {"train": {"fsdp": {"reduce_every_micro_batch": False}}},
        TRAIN | REPORT,
    ),
    "train.profile.enabled": ({"train": {"profile": {"enabled": False}}}, TRAIN | REPORT),
    "train.profile.wait": ({"train": {"profile": {"wait": 2}}}, TRAIN | REPORT),
    "train.profile.warmup": ({"train": {"profile": {"warmup": 2}}}, TRAIN | REPORT),
    "train.profile.active": ({"train": {"profile": {"active": 1}}}, TRAIN | REPORT),
    "train.profile.top_ops": ({"train": {"profile": {"top_ops": 5}}}, TRAIN | REPORT),
    "eval.nproc_per_node": ({"eval": {"nproc_per_node": 1}}, EVAL | REPORT),
    "eval.context": ({"eval": {"context": 48}}, EVAL | REPORT),
    "eval.stride": ({"eval": {"stride": 16}}, EVAL | REPORT),
    "eval.batch_size": ({"eval": {"batch_size": 4}}, EVAL | REPORT),
    "eval.precision": ({"eval": {"precision": "bf16"}}, EVAL | REPORT),
    "eval.splits": ({"eval": {"splits": ["test"]}}, EVAL | REPORT),
    "inference.stages": ({"inference": {"stages": 2}}, {"shard[trained]"} | INFER | REPORT),
    "inference.prompts": ({"inference": {"prompts": "tests/configs/tiny.yaml"}}, INFER | REPORT),
    "inference.max_new_tokens": ({"inference": {"max_new_tokens": 4}}, INFER | REPORT),
    "inference.temperature": ({"inference": {"temperature": 0.31}}, INFER | REPORT),
    "inference.top_k": ({"inference": {"top_k": 5}}, INFER | REPORT),
    "inference.top_p": ({"inference": {"top_p": 0.5}}, INFER | REPORT),
    "inference.seed": ({"inference": {"seed": 3}}, INFER | REPORT),
    "inference.lanes": ({"inference": {"lanes": 2}}, INFER | REPORT),
    "inference.prompt_overflow": ({"inference": {"prompt_overflow": "reject"}}, INFER | REPORT),
    "inference.timeout_s": ({"inference": {"timeout_s": 33}}, INFER | REPORT),
    "inference.cuda_graphs": ({"inference": {"cuda_graphs": False}}, INFER | REPORT),
    "inference.steps_in_flight": ({"inference": {"steps_in_flight": 2}}, INFER | REPORT),
    "report.formats": ({"report": {"formats": ["png", "svg"]}}, REPORT),
}
for _k, _v in {
    "host": "0.0.0.0",
    "port": 8123,
    "token_env": "MY_TOKEN",
    "token_file": "token.txt",
    "max_tokens": 64,
    "max_request_bytes": 4096,
    "max_header_bytes": 4096,
    "max_json_depth": 8,
    "max_number_digits": 20,
    "max_connections": 16,
    "max_queued_sequences": 8,
    "backlog": 64,
    "header_timeout_s": 3,
    "body_timeout_s": 4,
    "keep_alive_timeout_s": 2,
    "linger_s": 2,
    "linger_bytes": 1024,
    "request_timeout_s": 60,
    "api_servers": 2,
    "stream_interval": 4,
    "stages": 2,  # its own shards (rule serve_shard), outside rule all
    "model": "base",  # what serve_shard cuts, outside rule all
    "follow_training": True,  # read by serve alone: the training job never reads it
}.items():
    MATRIX[f"serve.{_k}"] = ({"serve": {_k: _v}}, NOTHING)  # serve is not in rule all


_RULE = re.compile(r"^(?:local)?rule (\w+):$")
_WILDCARD = re.compile(r"^\s+wildcards: .*\bmodel=(\w+)")


def planned(forks, workdir: Path, overlay: dict, tmp: Path, name: str, *args: str) -> set[str]:
    """The jobs a dry run plans with `overlay` merged over tiny.yaml, as rule or rule[model]
    (rule all and the resolved-config files left out); `forks`: the snakemake_forks fixture."""
    edit = tmp / f"{name}.yaml"
    edit.write_text(yaml.safe_dump(overlay))
    proc = forks.run(snakemake_cmd(workdir, "-n", "--nolock", *args, configfiles=(TINY, edit)))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: {out[-3000:]}"
    jobs, rule = [], None
    for line in out.splitlines():
        if m := _RULE.match(line.strip()):
            rule = m.group(1)
            jobs.append(rule)
        elif rule and (m := _WILDCARD.match(line)):
            jobs[-1] = f"{rule}[{m.group(1)}]"
    # a stage's other rules (the data stage's listing, tokenizer and shards) count as its job
    part_of = {rule: st.rule for st in STAGES.values() for rule in st.parts}
    return {part_of.get(j, j) for j in jobs} - {"all", "resolve_config"}


def test_every_schema_key_has_a_row():
    keys = schema_keys(SCHEMA)
    missing = [k for k in keys if k not in MATRIX]
    extra = [k for k in MATRIX if k not in keys]
    assert not missing, f"schema keys without a row in the rerun matrix: {missing}"
    assert not extra, f"rows for keys the schema lacks: {extra}"


def _selected(cfg: dict, key: str) -> dict | None:
    """The key's part of a validated config; None where the config leaves it out (the Llama
    family's keys, left out of a GPT-2 config so that its caches stay as they were)."""
    try:
        return select(cfg, [key])
    except KeyError:
        return None


def test_every_row_changes_its_key():
    """A row whose edit equals the tiny config's value would pass on key order alone."""
    base = validate_config(deep_merge(BASE, yaml.safe_load(TINY.read_text())))
    same = []
    for key, (overlay, _) in MATRIX.items():
        edited = validate_config(deep_merge(base, overlay))
        if _selected(edited, key) == _selected(base, key):
            same.append(key)
    assert not same, f"rows whose edit leaves the key as it was: {same}"


def test_declarations_agree_with_the_matrix():
    """distlm.dag.stages (what config/README.md's table is made from) says the same as the matrix."""
    wrong = {
        k: (sorted(reruns(k)), sorted(want))
        for k, (_, want) in MATRIX.items()
        if set(reruns(k)) != want
    }
    assert not wrong, wrong


def test_config_readme_table_is_in_sync():
    assert rerun_table(SCHEMA) in (ROOT / "config/README.md").read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "distlm.dag.tables", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr


def test_dry_run_of_every_edit_plans_exactly_its_row(workflow_run, snakemake_forks, tmp_path):
    # The rows that rerun nothing are dry-run together, as one edit of all their keys: a job whose
    # params held any of those keys would be planned by it (each row changes its key:
    # test_every_row_changes_its_key), so nothing planned for all of them is nothing for each.
    idle = [k for k in MATRIX if MATRIX[k][1] == NOTHING]
    together: dict = {}
    for k in idle:
        together = deep_merge(together, MATRIX[k][0])
    cases = {k: MATRIX[k] for k in MATRIX if k not in idle}
    cases["the rows that rerun nothing: " + ", ".join(idle)] = (together, NOTHING)
    # a hub source is listed while the DAG is built: offline, from a local folder laid out like
    # the hub's wikitext (the hub id itself would need the network)
    from test_data import english, write_wikitext_copy

    write_wikitext_copy(tmp_path / "wikitext", english(12))
    hub = {"source": "hub", "hub": {"path": str(tmp_path / "wikitext")}}
    cases["data.source"] = ({"data": hub}, cases["data.source"][1])
    with ThreadPoolExecutor(max_workers=2) as pool:
        got = dict(
            zip(
                cases,
                pool.map(
                    lambda ik: planned(
                        snakemake_forks, workflow_run, cases[ik[1]][0], tmp_path, f"row{ik[0]}"
                    ),
                    enumerate(cases),
                ),
            )
        )
    wrong = {k: (sorted(got[k]), sorted(cases[k][1])) for k in cases if got[k] != cases[k][1]}
    assert not wrong, "\n".join(f"{k}: plans {g}, expected {w}" for k, (g, w) in wrong.items())


def test_forcerun_reruns_that_rule_and_its_consumers_only(workflow_run, snakemake_forks, tmp_path):
    assert planned(snakemake_forks, workflow_run, {}, tmp_path, "nothing") == NOTHING
    for rule, want in (
        ("train", TRAIN | REPORT),
        ("broadcast", BROADCAST | REPORT),
        ("shard", {"shard[trained]"} | INFER | REPORT),
        ("report", REPORT),
    ):
        got = planned(
            snakemake_forks, workflow_run, {}, tmp_path, f"forcerun-{rule}", "--forcerun", rule
        )
        assert got == want, (rule, sorted(got))


def test_serve_has_shards_of_its_own(workflow_run, snakemake_forks, tmp_path):
    """serve.stages cuts the trained model into serve's own shards (rule serve_shard): it never
    re-cuts batch inference's, and inference.stages never re-cuts serve's."""
    workflow_run = copy_workflow(workflow_run, tmp_path / "work")  # serve_shard writes into it
    assert planned(snakemake_forks, workflow_run, {}, tmp_path, "serve-first", "serve_shard") == {
        "serve_shard"
    }
    proc = subprocess.run(
        snakemake_cmd(workflow_run, "serve_shard"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    manifest = json.loads(
        (workflow_run / "results/serve/pipeline/shards/manifest.json").read_text()
    )
    assert manifest["stages"] == 1  # serve.stages' default, apart from inference.stages: 3
    assert (
        planned(snakemake_forks, workflow_run, {}, tmp_path, "serve-done", "serve_shard") == set()
    )
    other = {"inference": {"stages": 1}}
    assert (
        planned(snakemake_forks, workflow_run, other, tmp_path, "serve-inf", "serve_shard") == set()
    )
    edit = {"serve": {"stages": 2}}
    assert planned(snakemake_forks, workflow_run, edit, tmp_path, "serve-edit", "serve_shard") == {
        "serve_shard"
    }
