"""The eval stage inside the tiny workflow: both models, every split, checked against a reference."""

import json
import math

import pytest
import torch
import yaml
from conftest import TINY
from test_eval import reference

from distlm.data import TokenBlocks
from distlm.evaluate import load_model, sliding_windows


@pytest.fixture(scope="module")
def evals(workflow_run):
    return {
        m: json.loads((workflow_run / f"results/eval/{m}.json").read_text())
        for m in ("base", "trained")
    }


def test_eval_outputs(workflow_run, evals):
    ecfg = yaml.safe_load(TINY.read_text())["eval"]
    stats = json.loads((workflow_run / "results/data/stats.json").read_text())
    workflow_run / "results/data/tokens.h5"
    for name, folder in (("base", "results/model/base"), ("trained", "results/train/final")):
        res = evals[name]
        meta = json.loads((workflow_run / folder / "distlm.json").read_text())
        assert res["name"] == name and res["model"]["model_sha256"] == meta["model_sha256"]
        assert (res["context"], res["stride"]) == (ecfg["context"], ecfg["stride"])
        assert res["world_size"] == ecfg["nproc_per_node"] and res["precision"] == "fp32"
        assert list(res["splits"]) == ["validation", "test"]
        for split, r in res["splits"].items():
            n = stats["splits"][split]["tokens"]
            assert (
                r["tokens"] == n and r["tokens_sha256"] == stats["splits"][split]["tokens_sha256"]
            )
            ws = sliding_windows(n, ecfg["context"], ecfg["stride"])
            assert r["tokens_scored"] == n - 1 == sum(w.n_scored for w in ws)
            assert r["perplexity"] == pytest.approx(math.exp(r["mean_loss"]), rel=1e-12)
            assert r["seconds"] > 0 and r["tokens_per_s"] > 0
        assert (workflow_run / f"results/benchmarks/evaluate_{name}.tsv").is_file()
        log = (workflow_run / f"logs/eval/{name}.log").read_text()
        assert "[rank 0] INFO distlm.evaluate" in log and "[rank 1] INFO distlm.evaluate" in log
        for rank in range(ecfg["nproc_per_node"]):
            rank_log = (workflow_run / f"logs/eval/{name}.rank{rank}.log").read_text()
            assert f"[rank {rank}] INFO distlm.runtime.dist: process group up" in rank_log
    assert evals["base"]["data"]["sha256"] == evals["trained"]["data"]["sha256"]
    # what training gained: 8 steps from a random init already lower the held-out perplexity
    for split in ("validation", "test"):
        assert (
            evals["trained"]["splits"][split]["perplexity"]
            < evals["base"]["splits"][split]["perplexity"]
        )


def test_workflow_result_equals_single_process_reference(workflow_run, evals):
    """The 2-rank torchrun result of the trained checkpoint against the direct forward + CE loop."""
    final = workflow_run / "results/train/final"
    load_model(final, torch.device("cpu"))  # the eval stage's loader takes it (sha256 checked)
    tokens = TokenBlocks(workflow_run / "results/data/tokens.h5", "validation").tokens()
    res = evals["trained"]
    ref_loss, ref_n = reference(final, tokens, res["context"], res["stride"])
    got = res["splits"]["validation"]
    assert got["tokens_scored"] == ref_n
    assert abs(got["mean_loss"] - ref_loss) / ref_loss < 1e-5
