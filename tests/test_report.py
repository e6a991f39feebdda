"""Profile reports: readers, figures, tables and the HTML summary; the tiny workflow's report
rendered in headless Chromium; `snakemake --report`."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import run_snakemake

from distlm.broadcast.documents import BroadcastReport
from distlm.core.documents import write_document
from distlm.data.documents import DataStats, SplitStats
from distlm.evaluate.documents import EvalReport, SplitEval
from distlm.inference.documents import InferenceTiming
from distlm.report import (
    FIGURES,
    ITEMS,
    LAYOUT,
    SECTIONS,
    TABLES,
    ReportError,
    build_report,
    category,
    outputs,
)
from distlm.report.inputs import collect
from distlm.runtime.device import DeviceBackend
from distlm.settings import ProfileSettings
from distlm.train.documents import ProfileSummary
from distlm.train.metrics import Metrics
from distlm.train.profiling import StepProfiler
from distlm.transfer.documents import ReceiverStats, TransferStats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BENCH_HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


# ----------------------------------------------------------------------------- fixtures


def write_train(results: Path, steps: int = 12) -> None:
    """metrics.csv and val.csv through the training stage's own writer."""
    m = Metrics(
        enabled=True,
        metrics_csv=results / LAYOUT["metrics"],
        val_csv=results / LAYOUT["val"],
        tb_dir=None,
    )
    for s in range(1, steps + 1):
        loss = 7.0 - 0.3 * s
        m.log_step(
            {
                "step": s,
                "loss": loss,
                "perplexity": 2.718281828**loss,
                "grad_norm": 1.0 / s,
                "lr": 1e-3 * min(1.0, s / 3),
                "tokens": 512 * s,
                "tokens_per_s": 1000.0 + s,
                "step_time_s": 0.5,
            }
        )
        if s % 4 == 0:
            m.log_val(
                {
                    "step": s,
                    "val_loss": loss + 0.2,
                    "val_perplexity": 2.718281828 ** (loss + 0.2),
                    "tokens": 512 * s,
                }
            )
    m.flush()
    m.close()


def write_profile(results: Path, ranks=(0, 1), enabled: bool = True) -> None:
    """A real torch.profiler window through the training stage's StepProfiler, per rank."""
    cfg = ProfileSettings(enabled=enabled, wait=0, warmup=1, active=1, top_ops=8)
    for rank in ranks:
        prof = StepProfiler(
            cfg,
            out_dir=results / LAYOUT["profile"],
            rank=rank,
            hw=DeviceBackend.cpu(),
            start_step=0,
        )
        with prof:
            for _ in range(3):
                a = torch.randn(64, 64)
                (a @ a).relu().sum()
                prof.step()
        if rank == 0:
            prof.write_summary(steps_run=3)


def write_eval(results: Path, name: str, ppl: float) -> None:
    """An EvalReport through the evaluation stage's writer."""
    import math

    splits = {
        s: SplitEval(
            mean_loss=math.log(ppl * f),
            perplexity=ppl * f,
            tokens_scored=1000,
            tokens=1064,
            windows=10,
            context=64,
            stride=32,
            seconds=0.5,
            tokens_per_s=2000.0,
            tokens_sha256="0" * 64,
        )
        for s, f in (("validation", 1.0), ("test", 1.1))
    }
    write_document(
        results / LAYOUT[f"eval_{name}"],
        EvalReport(
            name=name,
            method="sliding window",
            model={},
            data={},
            context=64,
            stride=32,
            batch_size=8,
            precision="fp32",
            device="cpu",
            world_size=2,
            config_digest="d",
            splits=splits,
            seconds=1.0,
        ),
    )


def write_broadcast(results: Path) -> None:
    """A BroadcastReport through the broadcast stage's writer."""
    common = {
        "transport": "torch",
        "backend": "gloo",
        "device": "cpu",
        "src": 0,
        "chain": [0, 1, 2],
        "bytes": 4_000_000,
        "stream_bytes": 4_000_000,
        "tensors": 10,
        "tied_tensors": 1,
        "buckets": 2,
        "bucket_bytes": 2_000_000,
        "chunk_bytes": 500_000,
        "metadata_seconds": 0.001,
        "mismatches": [],
    }
    receivers = [
        ReceiverStats(
            rank=r,
            seconds=0.018 + r / 1000,
            gbps=0.21 - r / 100,
            verified=True,
            checksum_seconds=0.001,
            unpack_seconds=0.001,
            mismatches=[],
        )
        for r in (1, 2)
    ]
    stats = TransferStats(
        **common,
        rank=0,
        role="sender",
        seconds=0.02,
        gbps=0.2,
        verified=True,
        all_verified=True,
        receivers=receivers,
    )
    write_document(
        results / LAYOUT["broadcast"],
        BroadcastReport(
            model="results/model/base",
            model_sha256="0" * 64,
            world_size=3,
            receivers_configured=2,
            bucket_mb=2,
            chunk_mb=0.5,
            timeout_s=60,
            config_digest="d",
            stats=stats,
        ),
    )


def timing_run(stages: int, lanes: int, prompts: int = 6) -> dict:
    """One run in the layout distlm.inference.engine.batch.generate_batch writes."""
    per_prompt = [
        {
            "index": i,
            "ttft_s": 0.05 * stages * (1 + i // lanes),
            "queue_s": 0.05 * (i // lanes),
            "total_s": 0.5,
            "decode_tokens_per_s": 20.0,
            "tokens_per_s": 16.0,
        }
        for i in range(prompts)
    ]
    return {
        "stages": stages,
        "lanes": lanes,
        "micro_batch_size": lanes,
        "prompts": prompts,
        "tokens": 8 * prompts,
        "wall_s": 0.4 * stages,
        "tokens_per_s": 8 * prompts / (0.4 * stages),
        "ttft_s": {
            "mean": sum(p["ttft_s"] for p in per_prompt) / prompts,
            "max": max(p["ttft_s"] for p in per_prompt),
        },
        "per_prompt": per_prompt,
        "per_stage": [
            {
                "stage": s,
                "compute_s": 0.1,
                "send_s": 0.01,
                "recv_wait_s": 0.05 * s,
                "micro_batches": 10,
                "items": 40,
                "messages_sent": 10,
                "bytes_sent": 1000,
                "comm_s": 0.01 + 0.05 * s,
            }
            for s in range(stages)
        ],
        "hosts": [{"stage": s} for s in range(stages)],
        "model": "results/train/final",
    }


def write_inference(results: Path, sweep: bool = False) -> None:
    path = results / LAYOUT["timing"]
    path.parent.mkdir(parents=True, exist_ok=True)
    timing = (
        {"runs": [timing_run(st, ln) for st in (1, 2, 3) for ln in (1, 4)]}
        if sweep
        else timing_run(3, 4)
    )
    path.write_text(json.dumps(timing))
    (results / LAYOUT["generations"]).write_text(
        "".join(
            json.dumps(
                {
                    "index": i,
                    "prompt": f"p{i} <b>",
                    "text": f"text {i}\nline",
                    "tokens": 8,
                    "finish_reason": "length",
                    "ttft_s": 0.1,
                }
            )
            + "\n"
            for i in range(3)
        )
    )


def write_benchmarks(results: Path, rules=("prepare_data", "train", "report")) -> None:
    folder = results / LAYOUT["benchmarks"]
    folder.mkdir(parents=True, exist_ok=True)
    for i, rule in enumerate(rules):
        (folder / f"{rule}.tsv").write_text(
            BENCH_HEADER + f"{1.5 + i}\t0:00:01\t{300 + i}\t900\t280\t290\t1\t1\t90\t{1.4 + i}\n"
        )


def write_all(results: Path) -> None:
    write_document(
        results / LAYOUT["stats"],
        DataStats(
            source={"kind": "embedded"},
            config_digest="d",
            tokenizer="bpe",
            vocab_size=1024,
            eos_token_id=0,
            block_size=64,
            splits={
                s: SplitStats(
                    documents=3,
                    tokens=6400 + i,
                    blocks=100,
                    tail_tokens_not_in_blocks=i,
                    tokens_sha256="0" * 64,
                )
                for i, s in enumerate(("train", "validation", "test"))
            },
            seconds=1.0,
        ),
    )
    write_broadcast(results)
    write_train(results)
    write_profile(results)
    write_eval(results, "base", 900.0)
    write_eval(results, "trained", 300.0)
    write_inference(results)
    write_benchmarks(results)


def images(page: str) -> list[str]:
    return re.findall(r'<img [^>]*src="([^"]*)"', page)


# ----------------------------------------------------------------------------- unit tests


def test_full_report_embeds_every_figure(tmp_path):
    write_all(tmp_path / "results")
    out = tmp_path / "report"
    written = build_report(tmp_path / "results", out, formats=["png", "svg"])
    assert {p.relative_to(out).as_posix() for p in written} == (
        {"summary.html"} | {path for _, path in outputs(["png", "svg"])}
    )
    page = (out / "summary.html").read_text()
    srcs = images(page)
    assert len(srcs) == len(FIGURES)
    assert all(s.startswith("data:image/png;base64,") for s in srcs)
    assert 'class="not-collected"' not in page
    assert "<b>" not in page and "p0 &lt;b&gt;" in page  # generated text is escaped
    for item in FIGURES:
        assert (out / item.path("png")).read_bytes().startswith(PNG_MAGIC)
        assert b"<svg" in (out / item.path("svg")).read_bytes()[:2000]
    # the numbers reach the tables
    assert "900" in (out / "tables/eval_perplexity.html").read_text()
    assert "0.333x" in page  # trained / base perplexity
    bench = (out / "tables/rule_benchmarks.html").read_text()
    assert "prepare_data" in bench and "train" in bench
    assert ">report<" not in bench  # the report rule's own (stale) benchmark is left out


def test_an_operator_listed_twice_for_a_rank_is_one_bar(tmp_path):
    """On a GPU torch's key_averages() lists an operator's CPU and device events apart under one
    name (the H200 run of 2026-11-26: the report rule failed on the duplicate label). The figure
    draws the rank's rows of a name as one bar, their sum."""
    import pandas as pd

    from distlm.report.figures import profile_ops

    write_all(tmp_path)
    inp = collect(tmp_path)
    p = inp.profile
    name = p[p["rank"] == 0]["operator"].iloc[0]
    twice = pd.concat([p, p[(p["rank"] == 0) & (p["operator"] == name)]], ignore_index=True)
    twice.attrs = p.attrs
    inp.profile = twice
    fig = profile_ops(inp)
    assert fig is not None
    widths = sorted(b.get_width() for b in fig.axes[0].patches)
    want = 2 * p[(p["rank"] == 0) & (p["operator"] == name)]["self_ms"].iloc[0]
    assert any(abs(w - want) < 1e-9 for w in widths), (want, widths)


def test_collect_reads_real_writer_formats(tmp_path):
    write_all(tmp_path)
    inp = collect(tmp_path)
    assert inp.missing == {}
    assert list(inp.metrics["step"]) == list(range(1, 13))
    assert inp.metrics["loss"].iloc[-1] == pytest.approx(7.0 - 0.3 * 12)
    assert list(inp.val["step"]) == [4, 8, 12]
    assert set(inp.profile["rank"]) == {0, 1}
    assert (inp.profile["self_ms"] >= 0).all() and len(inp.profile) > 0
    assert set(inp.evals["model"]) == {"base", "trained"}
    assert list(inp.receivers["receiver"]) == [1, 2]
    assert inp.inference.to_dict("records")[0] | {"ttft_max_s": 0} == {
        "stages": 3,
        "lanes": 4,
        "prompts": 6,
        "tokens": 48,
        "wall_s": pytest.approx(1.2),
        "tokens_per_s": pytest.approx(40.0),
        "ttft_mean_s": pytest.approx(0.2),
        "ttft_max_s": 0,
    }
    assert list(inp.stages["stage"]) == [0, 1, 2] and len(inp.prompts) == 6
    assert list(inp.generations["generated"]) == ["text 0\nline", "text 1\nline", "text 2\nline"]
    assert list(inp.benchmarks["rule"]) == ["prepare_data", "train"]
    assert inp.benchmarks["max_rss_mb"].iloc[1] == 301


def test_inference_sweep(tmp_path):
    """A timing file holding a sweep over stage counts and lanes gives one row per run."""
    write_inference(tmp_path, sweep=True)
    inp = collect(tmp_path)
    assert sorted(zip(inp.inference["stages"], inp.inference["lanes"])) == [
        (s, ln) for s in (1, 2, 3) for ln in (1, 4)
    ]
    assert list(inp.stages["stage"]) == [0, 1, 2]  # the last run's split


def test_untagged_timing_and_profile_read_as_documents(tmp_path):
    """timing.json and profile.json as distlm wrote them before they carried a format tag read
    unchanged; the stages' writers now tag them, and both read alike."""
    write_inference(tmp_path)  # untagged, as the stage wrote it before the tag
    path = tmp_path / LAYOUT["timing"]
    assert "format" not in json.loads(path.read_text())
    old = collect(tmp_path)
    write_document(path, InferenceTiming.model_validate(timing_run(3, 4)))
    assert json.loads(path.read_text())["format"] == "distlm-inference-timing/1"
    new = collect(tmp_path)
    assert isinstance(old.timing, InferenceTiming) and old.timing == new.timing
    assert old.timing.stages == 3 and old.timing.ttft_s.max == pytest.approx(0.3)
    assert old.inference is not None and old.inference.equals(new.inference)
    write_profile(tmp_path, ranks=(0,), enabled=False)
    summary = tmp_path / LAYOUT["profile"] / "profile.json"
    tagged = json.loads(summary.read_text())
    assert tagged["format"] == ProfileSummary.tag() and "captured" not in tagged
    summary.write_text(json.dumps({k: v for k, v in tagged.items() if k != "format"}))
    assert "profiling is off" in collect(tmp_path).missing["profile"]


def test_nothing_collected_gives_notes_and_files(tmp_path):
    out = tmp_path / "report"
    written = build_report(tmp_path / "absent", out)
    assert len(written) == 1 + len(ITEMS)
    page = (out / "summary.html").read_text()
    assert images(page) == []
    assert page.count('class="not-collected"') == len(LAYOUT)
    for key, rel in LAYOUT.items():
        assert html.escape(str(tmp_path / "absent" / rel)) in page, key
    for item in FIGURES:  # the file exists and says why it is empty
        assert (out / item.path()).read_bytes().startswith(PNG_MAGIC)
    for item in TABLES:
        assert "not collected" in (out / item.path()).read_text()


def test_partial_inputs(tmp_path):
    """Base eval only and profiling off: the figure draws what exists, notes name the rest."""
    write_eval(tmp_path, "base", 500.0)
    write_train(tmp_path)
    write_profile(tmp_path, ranks=(0,), enabled=False)
    out = tmp_path / "report"
    build_report(tmp_path, out)
    page = (out / "summary.html").read_text()
    assert "profiling is off: train.profile.enabled is false" in page
    assert f"{html.escape(str(tmp_path / 'eval/trained.json'))} is absent" in page
    srcs = images(page)  # train_loss, train_schedule, val_loss, perplexity
    assert len(srcs) == 4


def test_profile_window_not_captured(tmp_path):
    folder = tmp_path / LAYOUT["profile"]
    folder.mkdir(parents=True)
    (folder / "profile.json").write_text(
        json.dumps(
            {
                # as distlm wrote it before profile.json carried a format tag
                "enabled": True,
                "window": {"wait": 1, "warmup": 1, "active": 1},
                "captured": False,
                "first_step": 1,
                "reason": "the run had 1 steps after its start, the window needs 3",
            }
        )
    )
    inp = collect(tmp_path)
    assert "window needs 3" in inp.missing["profile"]


@pytest.mark.parametrize(
    "rel, content, expected",
    [
        (LAYOUT["metrics"], "step,loss\n1,2.5\n2,oops\n", "column 'loss' row 2"),
        (LAYOUT["metrics"], "step,lr\n1,0.1\n", "missing column(s) loss"),
        (LAYOUT["val"], "step,loss\n1,2\n", "missing column(s) val_loss"),
        (LAYOUT["stats"], "{not json", "not valid JSON"),
        (LAYOUT["stats"], json.dumps({"splits": {}}), "no format tag where 'distlm-data-stats/2'"),
        (
            LAYOUT["stats"],
            json.dumps({"format": "distlm-data-stats/0", "splits": {}}),
            "written by another version of distlm",
        ),
        (
            LAYOUT["stats"],
            json.dumps({"format": "distlm-data-stats/1", "splits": {"train": {"tokens": "many"}}}),
            "malformed DataStats: field",
        ),
        (
            LAYOUT["eval_base"],
            json.dumps({"format": "distlm-eval/2", "splits": {"test": {"perplexity": 3}}}),
            "malformed EvalReport: field",
        ),
        (LAYOUT["broadcast"], json.dumps({"transport": "torch"}), "'distlm-broadcast/2'"),
        (LAYOUT["timing"], "[]", "expected a distlm-inference-timing/1 object, got list"),
        (
            LAYOUT["timing"],
            json.dumps({**timing_run(2, 1), "ttft_s": 0.5}),
            "malformed InferenceTiming: field ttft_s",
        ),
        (
            LAYOUT["timing"],
            json.dumps({"runs": [{**timing_run(2, 1), "ttft_s": {"mean": 1}}]}),
            "malformed InferenceSweep: field runs.0.ttft_s.max",
        ),
        (
            LAYOUT["timing"],
            json.dumps({"format": "distlm-eval/2", **timing_run(2, 1)}),
            "a 'distlm-eval/2' document where 'distlm-inference-timing/1'",
        ),
        (
            LAYOUT["timing"],
            json.dumps({"format": "distlm-inference-timing/0", **timing_run(2, 1)}),
            "written by another version of distlm",
        ),
        (
            "train/profile/profile.json",
            json.dumps({"enabled": "sometimes", "window": {"wait": 1, "warmup": 1, "active": 1}}),
            "malformed ProfileSummary: field enabled",
        ),
        (
            "train/profile/profile.json",
            json.dumps({"format": "distlm-train-profile/1", "enabled": False}),
            "malformed ProfileSummary: field window",
        ),
        (LAYOUT["generations"], '{"prompt": "a"}\nnot json\n', "line 2 is not valid JSON"),
        ("benchmarks/train.tsv", "s\tmax_rss\nslow\t1\n", "column 's' row 1"),
        ("train/profile/top-ops-rank0.json", json.dumps({"rank": 0, "ops": {}}), "field ops"),
    ],
)
def test_malformed_file_is_named(tmp_path, rel, content, expected):
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    with pytest.raises(ReportError) as e:
        build_report(tmp_path, tmp_path / "report")
    assert str(path) in str(e.value) and expected in str(e.value)
    assert not (tmp_path / "report" / "summary.html").exists()


# ----------------------------------------------------------------------------- Chromium


def chromium() -> str | None:
    return next(
        (
            shutil.which(n)
            for n in ("chromium", "chromium-browser", "google-chrome")
            if shutil.which(n)
        ),
        None,
    )


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

# Marks every image once the page has loaded: loaded images have a natural width.
CHECK_IMAGES = """<script>
window.addEventListener("load", () => {
  for (const img of document.images)
    img.setAttribute("data-loaded", String(img.complete && img.naturalWidth > 0));
  document.body.setAttribute("data-checked", String(document.images.length));
});
</script>"""


def render(page: Path, tmp_path: Path) -> tuple[str, Path]:
    """Headless Chromium: (DOM after the load event, a full-width screenshot)."""
    exe = chromium()
    if exe is None:
        pytest.skip("chromium not installed (Debian: apt-get install chromium)")
    probe = tmp_path / "probe.html"
    text = page.read_text(encoding="utf-8")
    assert "</body>" in text
    probe.write_text(text.replace("</body>", CHECK_IMAGES + "</body>"), encoding="utf-8")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    dom = run("--virtual-time-budget=5000", "--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-3000:]
    shot = tmp_path / "summary.png"
    res = run("--window-size=1280,2400", "--hide-scrollbars", f"--screenshot={shot}", page.as_uri())
    assert res.returncode == 0 and shot.is_file(), res.stderr[-3000:]
    return dom.stdout, shot


def test_chromium_loads_every_image_of_synthetic_report(tmp_path):
    write_all(tmp_path / "results")
    build_report(tmp_path / "results", tmp_path / "report")
    dom, shot = render(tmp_path / "report" / "summary.html", tmp_path)
    assert shot.stat().st_size > 10_000
    assert f'data-checked="{len(FIGURES)}"' in dom
    assert dom.count('data-loaded="true"') == len(FIGURES)


def test_chromium_detects_a_broken_image(tmp_path):
    """The check itself can fail: a corrupt image is reported as not loaded."""
    page = tmp_path / "broken.html"
    page.write_text(
        '<!DOCTYPE html><html><body><img src="data:image/png;base64,AAAA"></body></html>'
    )
    dom, _ = render(page, tmp_path)
    assert 'data-loaded="false"' in dom and 'data-loaded="true"' not in dom


# ----------------------------------------------------------------------------- the tiny workflow


def test_workflow_report(workflow_run, tmp_path):
    """The tiny workflow runs every stage with profiling on: every figure is drawn and loads."""
    report = workflow_run / "results" / "report"
    for _, path in outputs(["png"]):  # tiny.yaml keeps report.formats at its default, png
        assert (report / path).is_file(), path
    page = (report / "summary.html").read_text()
    assert 'src="http' not in page and 'href="http' not in page  # opens offline, from disk
    assert 'class="not-collected"' not in page
    assert len(images(page)) == len(FIGURES)
    dom, shot = render(report / "summary.html", tmp_path)
    assert f'data-checked="{len(FIGURES)}"' in dom
    assert dom.count('data-loaded="true"') == len(FIGURES)
    from matplotlib.image import imread

    pixels = imread(shot)
    assert pixels.shape[1] == 1280 and pixels.std() > 0.05  # a rendered page, not a blank one
    log = (workflow_run / "logs/report/report.log").read_text()
    assert "0 inputs not collected" in log


def test_snakemake_report(workflow_run):
    """`snakemake --report` collects every registered figure and table with its caption."""
    out = workflow_run / "report.html"
    run_snakemake(workflow_run, "--report", str(out), timeout=600)
    text = out.read_text(encoding="utf-8")
    for _, path in outputs(["png"]):
        assert Path(path).name in text, path
    for section in SECTIONS:
        assert category(section) in text
    assert "profiler during training" in text  # a caption from workflow/report/profile_ops.rst
