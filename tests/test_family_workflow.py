"""The whole workflow through `snakemake --profile profiles/local` on a sweep that crosses the model
families (tests/configs/tiny-families.yaml over tiny.yaml and tiny-single.yaml): a tiny Llama (1
KV head, untied, Llama 3.2's rope scaling, 3 layers in 2 pipeline stages), and folders shaped as
SmolLM2-135M and Qwen3-0.6B ship, through `model.source: local`. The tiny GPT-2 is the tiny
workflow's own (tests/test_workflow.py). One run serves every check."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import ROOT, SINGLE, TINY, run_snakemake
from harness.hub_folder import qwen3_shaped_folder, smollm2_shaped_folder

from distlm.core.documents import read_document
from distlm.dag.sweep import SweepRun
from distlm.data.sources import load_embedded
from distlm.evaluate.documents import EvalReport
from distlm.model import load_model_dir, read_args, read_manifest

FAMILIES = ROOT / "tests" / "configs" / "tiny-families.yaml"
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
RUNS = {"llama": "llama", "smollm2-local": "llama", "qwen3-local": "qwen3"}


@pytest.fixture(scope="module")
def families_run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("families")
    texts = [text for _, text in load_embedded()][:300]
    smollm2_shaped_folder(wd / "hub", texts)
    qwen3_shaped_folder(wd / "hub", texts)
    # one rank for train, eval and broadcast (tiny-single.yaml: how they split the work across
    # ranks is the same code for every family, tested on the tiny GPT-2 in the session's tiny
    # workflow; DDP of each family's parameters: tests/test_family.py), each run's pipeline in 2
    # stages (tiny-families.yaml)
    configs = (TINY, SINGLE, FAMILIES)
    proc = run_snakemake(wd, configfiles=tuple(configs))
    return wd, proc


@pytest.mark.slow
@pytest.mark.with_requeue
def test_a_sweep_across_families_runs_every_stage(families_run):
    from transformers import AutoModelForCausalLM

    wd, _ = families_run
    for name, model_type in RUNS.items():
        run = read_document(wd / f"results/runs/{name}/run.json", SweepRun)
        folders = {job: wd / folder for job, folder in run.jobs.items()}
        base = folders["serialize_model"] / "model/base"
        final = folders["train"] / "train/final"
        for folder in (base, final):
            config = json.loads((folder / "config.json").read_text())
            assert config["model_type"] == model_type
            assert config["architectures"] == [ARCHITECTURES[model_type]], (name, folder)
            # written by distlm, loaded by transformers unchanged, to the same logits
            hf = AutoModelForCausalLM.from_pretrained(folder).eval()
            ours = load_model_dir(folder)
            x = torch.arange(16)[None] % hf.config.vocab_size
            with torch.no_grad():  # distlm's model of the family: transformers' logits
                torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-5, atol=1e-5)
        args = read_args(final)
        if name == "llama":
            assert (args.n_kv_heads, args.head_dim) == (1, 32) and not args.tied
            assert args.rope.kind == "llama3"  # pyright: ignore[reportAttributeAccessIssue]
        if name == "qwen3-local":  # its head width, not width / heads, shapes the KV cache
            assert (args.n_kv_heads, args.head_dim) == (2, 16)
        metrics = (folders["train"] / "train/metrics.csv").read_text().splitlines()[1:]
        loss = [float(r.split(",")[1]) for r in metrics]
        assert len(loss) == 8 and loss[-1] < loss[0], (name, loss)
        for model in ("base", "trained"):
            ev = read_document(folders[f"evaluate[{model}]"] / f"eval/{model}.json", EvalReport)
            assert ev.splits["validation"].tokens_scored > 0
        man = read_manifest(folders["shard[trained]"] / "pipeline/trained")
        assert man.stages == 2
        lines = (folders["inference"] / "inference/generations.jsonl").read_text().splitlines()
        recs = [json.loads(line) for line in lines]
        assert recs and all(1 <= r["tokens"] == len(r["token_ids"]) for r in recs)
        page = (wd / f"results/runs/{name}/report/summary.html").read_text()
        assert "Validation loss" in page and 'class="not-collected"' not in page
    assert (wd / "results/report/summary.html").is_file()
