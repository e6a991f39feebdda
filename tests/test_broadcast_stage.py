"""The broadcast stage: its report and logs in the tiny workflow, and its input checks."""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import TINY

from distlm import DistlmError
from distlm.broadcast import run_broadcast_stage
from distlm.config import load_config
from distlm.dist import distributed
from distlm.documents import BroadcastReport, read_document
from distlm.model import WEIGHTS, load_safetensors, read_meta
from distlm.settings.stage import BroadcastConfig
from distlm.stages import stage_config
from distlm.transfer import TransferError


def test_stage_report_in_the_tiny_workflow(workflow_run):
    cfg = load_config(TINY)
    doc = read_document(workflow_run / "results/broadcast/report.json", BroadcastReport)
    report = {**doc.model_dump(), **doc.stats.model_dump()}
    model = workflow_run / "results/model/base"
    sd = load_safetensors(model / WEIGHTS)
    receivers = cfg["broadcast"]["receivers"]
    assert report["transport"] == cfg["transfer"]["transport"] == "torch"
    assert report["backend"] == "gloo" and report["world_size"] == 1 + receivers
    assert report["bytes"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert report["tensors"] == len(sd)
    assert report["bucket_bytes"] == int(cfg["transfer"]["bucket_mb"] * 2**20)
    assert report["buckets"] == -(-report["stream_bytes"] // report["bucket_bytes"]) > 1
    assert report["model_sha256"] == read_meta(model).model_sha256
    assert [r["rank"] for r in report["receivers"]] == list(range(1, receivers + 1))
    for r in report["receivers"]:
        assert r["verified"] is True and r["mismatches"] == []
        assert r["seconds"] > 0 and r["gbps"] > 0
    assert report["all_verified"] is True
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[rank (\d+)\] ")
    for rank in range(1 + receivers):
        lines = (workflow_run / f"logs/broadcast/rank{rank}.log").read_text().splitlines()
        assert lines and all(
            stamp.match(line) and stamp.match(line).group(1) == str(rank) for line in lines
        )
        assert any(
            ("received" if rank else "sent") in line and "verified: True" in line for line in lines
        )
    assert (workflow_run / "results/benchmarks/broadcast.tsv").is_file()


def test_stage_refuses_a_tampered_model_and_a_wrong_world(workflow_run, tmp_path):
    cfg = BroadcastConfig.of(stage_config(load_config(TINY), "broadcast"))
    model = tmp_path / "model"
    shutil.copytree(workflow_run / "results/model/base", model)
    with distributed(backend="gloo", timeout_s=30) as topo:
        with pytest.raises(TransferError, match="launched with 1"):
            run_broadcast_stage(cfg, topo=topo, model_dir=model, report_path=tmp_path / "r.json")
        sd = load_safetensors(model / WEIGHTS)
        name = next(iter(sd))
        sd[name] = sd[name] + 1
        from safetensors.torch import save_file

        save_file(sd, str(model / WEIGHTS))
        with pytest.raises(DistlmError, match=r"model.safetensors: sha256 .* does not match"):
            run_broadcast_stage(cfg, topo=topo, model_dir=model, report_path=tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
