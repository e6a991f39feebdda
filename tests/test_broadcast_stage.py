"""The broadcast stage: its report and logs in the tiny workflow, and its input checks."""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import TINY

from distlm import DistlmError
from distlm.broadcast import run_broadcast_stage
from distlm.broadcast.documents import BroadcastReport
from distlm.core.documents import read_document
from distlm.dag.config import load_config
from distlm.dag.stages import stage_config
from distlm.model import WEIGHTS, load_safetensors, read_meta
from distlm.runtime.dist import distributed
from distlm.settings.transfer import BroadcastConfig
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


def test_with_no_receiver_the_stage_measures_the_move_to_the_device(workflow_run, tmp_path):
    """One rank (broadcast.receivers 0, or null on one GPU): the weights go from host memory to
    the device in the transfer's buckets, each chunk's checksum compared; the report says so
    (transport host-to-<device>, no receivers) and the report stage reads it."""
    from distlm.report.inputs import read_broadcast

    params = stage_config(load_config(TINY, {"broadcast": {"receivers": 0}}), "broadcast")
    cfg = BroadcastConfig.of(params)
    model = workflow_run / "results/model/base"
    out = tmp_path / "report.json"
    with distributed(backend="gloo", timeout_s=30) as topo:
        run_broadcast_stage(cfg, topo=topo, model_dir=model, report_path=out)
    doc = read_document(out, BroadcastReport)
    s = doc.stats
    sd = load_safetensors(model / WEIGHTS)
    assert doc.world_size == 1 and doc.receivers_configured == 0 and s.receivers == []
    assert s.transport == "host-to-cpu" and s.device == "cpu" and s.chain == [0]
    assert s.bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert s.buckets > 1 and s.seconds > 0 and s.gbps and s.gbps > 0
    assert s.verified is True and s.all_verified is True and s.mismatches == []
    _, rows = read_broadcast(out)
    assert list(rows["transport"]) == ["host-to-cpu"] and list(rows["verified"]) == [True]


def test_a_chunk_changed_on_its_way_to_the_device_is_named(monkeypatch):
    """The checksum on the device is compared with the host's: a byte that changes between them
    fails the verdict and names the bucket and the tensor."""
    import torch

    from distlm.broadcast import stage
    from distlm.runtime.device import DeviceBackend
    from distlm.settings import TransferSettings

    tensors = {"a.weight": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(10)}

    class OnTheDevice(stage.Checksum):
        """The second checksum made (the device's; the host's comes first) sees the first chunk
        with one byte flipped: what a move that changed the byte would give."""

        made = 0

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            OnTheDevice.made += 1
            self.flip = OnTheDevice.made == 2

        def __call__(self, data, out):
            if self.flip:
                self.flip, data = False, data.clone()
                data[12345] ^= 0xFF
            return super().__call__(data, out)

    monkeypatch.setattr(stage, "Checksum", OnTheDevice)
    s = stage.load_to_device(
        tensors,
        settings=TransferSettings(bucket_mb=0.5, chunk_mb=0.25),
        hw=DeviceBackend.cpu(),
        backend="gloo",
    )
    assert s.verified is False and s.all_verified is False
    assert len(s.mismatches) == 1 and "bucket 0 chunk 0" in s.mismatches[0]
    assert "a.weight" in s.mismatches[0]
