"""The README's performance table, rendered from the committed benchmark JSON (never typed by hand).

    python benchmarks/summary.py            # rewrite the block between README.md's markers
    python benchmarks/summary.py --check    # exit 1 when README.md is not what the JSON says

Each row is one goal of the speed issue (#31) or a peer figure reported beside them: the figure
from its JSON file, the goal, and whether the figure meets it (computed here from the raw value,
not from the rounded one shown). Below the table, each file's date, machine, the code it measured
and its command. docs/performance.md has the current figures, what bounds each and how to
reproduce them; benchmarks/LOG.md the record of every run;
tests/test_docs.py runs `--check`, so a re-measured JSON file without a re-rendered README fails
the tests.
"""

from __future__ import annotations

import argparse
import json
import operator
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distlm.core.io import write_text

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BEGIN = "<!-- performance: rendered by `python benchmarks/summary.py` from the JSON below; do not edit by hand -->"
END = "<!-- /performance -->"

SERVE = "benchmarks/inference/serve-results.json"
PEERS = "benchmarks/inference/serve-results-peers.json"
BATCH = "benchmarks/inference/results.json"
UPDATE = "benchmarks/inference/update-results.json"
SWAP_STALL_GPU_S = 0.3  # issue #65: GPT-2 small's weights switched in at most 0.3 s on a GPU
UPDATE_P99 = 2.0  # issue #65: p99 during a live update at most 2x the steady p99, 0 failures
TRAIN = "benchmarks/train/results-cpu.json"
TRAIN_GPT2 = "benchmarks/train/results-cpu-gpt2.json"
E2E = "benchmarks/e2e/results-gpt2-small-cpu.json"
# benchmarks/gpu/run.sh's figures, committed once a GPU machine ran it (issue #45's goals)
TRAIN_GPU = "benchmarks/train/results-gpu.json"
SERVE_GPU = "benchmarks/inference/serve-results-gpu.json"
# issue #63 on the CPU: the peer at 16 and 64 clients (3 repeats of 15 s), and the host path at 64
SERVE_63 = "benchmarks/inference/serve-results-peer-16-64.json"
SERVE_63_GOALS = {16: 2.0, 64: 2.5}
HOST = "benchmarks/inference/profile-serve.json"
HOST_API_US = 25.0  # the API server's CPU a token at 64 clients, at most
HOST_ENGINE_MS = 0.5  # stage 0's host time a decode step outside the forward pass, at most
TRAIN_GPU_SMOLLM2 = "benchmarks/train/results-gpu-smollm2.json"
BATCH_GPU = "benchmarks/inference/results-gpu.json"
SMOLLM2_MFU = 0.35  # issue #45: the Llama family's steady-state MFU at SmolLM2-135M's shape
BATCH_GPU_GOAL = 2.0  # issue #45: all prompts in flight against `generate` batched, on the GPU
GPU_RUN = "benchmarks/gpu/run.sh"
# issue #78: the data stage against nanoGPT's prepare.py way (benchmarks/data/bench_prep.py)
DATA = "benchmarks/data/results.json"
DATA_SPEED = 1.2  # tokens a second of the whole stage, two shard jobs on the two cores
DATA_RSS_MB = 1000.0  # the largest data process's peak RSS at each size
DATA_RSS_GROWTH = 1.2  # from the smaller corpus to the larger
DATA_SCALING = 1.8  # two shard jobs on two cores against one on one
DATA_LOADER = 1.0  # the training loader against nanoGPT's get_batch
DATA_FINEWEB_MB = 2000.0  # one FineWeb-edu shard's job
DATA_WAIT = 0.01  # a GPU training step's wait for its rows, at most this share of the step
WORKFLOW_GPU = "benchmarks/gpu/workflow-gpu.json"  # run.sh's workflow step (config/gpu.yaml)

# The serving goals (issue #31): (clients, the ratio's key, its name) -> (comparison, bound): at
# least 2x the peer's throughput and at most 0.5x its p99 latency at 16 and 64 clients; ahead of
# it at 1 and 4.
SERVE_GOALS = {
    (1, "throughput", "throughput"): (">", 1.0),
    (4, "throughput", "throughput"): (">", 1.0),
    (16, "throughput", "throughput"): ("≥", 2.0),
    (64, "throughput", "throughput"): ("≥", 2.0),
    (16, "p99", "p99 latency"): ("≤", 0.5),
    (64, "p99", "p99 latency"): ("≤", 0.5),
}
COMPARE = {">": operator.gt, "≥": operator.ge, "≤": operator.le}
# batch inference: the one-stage run with all prompts in flight against `generate` batched, the
# target bench.py judges (its targets_met key names the bound)
BATCH_GOAL = 1.5


@dataclass(frozen=True)
class Row:
    what: str
    against: str
    measured: str
    goal: str
    met: bool | None  # None: reported, no goal
    source: str
    device: str = ""  # the device that gave the figure (device_of its file)

    def cells(self) -> list[str]:
        status = "reported" if self.met is None else ("met" if self.met else "**not met**")
        if not (ROOT / self.source).is_file() or self.source.endswith(".sh"):
            status = "waits for a GPU run"
        device = self.device or device_of(load(self.source))
        return [
            self.what,
            self.against,
            device,
            self.measured,
            self.goal,
            status,
            f"`{self.source}`",
        ]


def load(rel: str) -> dict[str, Any]:
    path = ROOT / rel
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"benchmarks/summary.py: cannot read {rel}: {e}") from e


def ratio(value: float, goal: float | None = None) -> str:
    """`value` with two decimals, or three where two would round it across `goal`."""
    text = f"{value:.2f}x"
    if goal is not None and (round(value, 2) >= goal) != (value >= goal):
        text = f"{value:.3f}x"
    return text


def by_clients(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {int(r["clients"]): r for r in rows}


def serving_rows() -> list[Row]:
    data = load(SERVE)
    ours = by_clients(data["ratios"]["distlm-s1_over_peer"])
    two = by_clients(data["ratios"]["distlm-s2_over_peer"])
    peer = "`transformers serve --continuous-batching`"
    rows = []
    for (clients, key, name), (op, bound) in SERVE_GOALS.items():
        value = ours[clients][key]
        rows.append(
            Row(
                f"serving, 1 stage, {clients} client{'s' * (clients > 1)}: {name}",
                peer,
                ratio(value, bound),
                f"{op} {bound:g}x",
                COMPARE[op](value, bound),
                SERVE,
            )
        )
    figures = " / ".join(ratio(two[c]["throughput"]) for c in sorted(two))
    counts = "/".join(str(c) for c in sorted(two))
    rows.append(
        Row(f"serving, 2 stages, {counts} clients: throughput", peer, figures, "", None, SERVE)
    )
    ours = by_clients(load(SERVE_63)["ratios"]["distlm-s1_over_peer"])
    for clients, bound in SERVE_63_GOALS.items():
        value = ours[clients]["throughput"]
        rows.append(
            Row(
                f"serving, 1 stage, {clients} clients, median of 3: throughput (#63)",
                peer,
                ratio(value, bound),
                f"≥ {bound:g}x",
                value >= bound,
                SERVE_63,
            )
        )
    host = load(HOST)
    after, before = host["repeats"]["after"], host["repeats"]["before"]

    def median(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    api = median(after, "server_cpu_us_per_token")
    engine = median(after, "engine_ms_a_step_outside_forward_and_picks")
    api_before = median(before, "server_cpu_us_per_token")
    engine_before = median(before, "engine_ms_a_step_outside_forward_and_picks")
    rows += [
        Row(
            "serving, 64 clients: the API server's CPU a token (#63)",
            "the release before, taking turns",
            f"{api:.1f} us ({api / api_before:.2f}x)",
            f"≤ {HOST_API_US:g} us",
            api <= HOST_API_US,
            HOST,
        ),
        Row(
            "serving, 64 clients: stage 0's host time a step outside the forward pass (#63)",
            "the release before, taking turns",
            f"{engine:.2f} ms ({engine / engine_before:.2f}x)",
            f"≤ {HOST_ENGINE_MS:g} ms",
            engine <= HOST_ENGINE_MS,
            HOST,
        ),
    ]
    peers = load(PEERS)
    model = peers["model"]
    for name, label in (("llamacpp-f32", "f32"), ("llamacpp-f16", "f16")):
        theirs = by_clients(peers["ratios"][f"distlm-s1_over_{name}"])
        figures = " / ".join(ratio(theirs[c]["throughput"]) for c in sorted(theirs))
        counts = "/".join(str(c) for c in sorted(theirs))
        rows.append(
            Row(
                f"serving ({model}), 1 stage, {counts} clients: throughput",
                f"llama.cpp's server, GGUF {label}",
                figures,
                "",
                None,
                PEERS,
            )
        )
    return rows


def batch_rows() -> list[Row]:
    data = load(BATCH)
    r = data["ratios"]
    met = data["targets_met"][f"s1 in flight >= {BATCH_GOAL:g}x hf_generate_batched"]
    return [
        Row(
            "batch inference, all prompts in flight: 1 stage (2 / 3 stages)",
            "HF `generate`, batched",
            f"{ratio(r['s1_in_flight_vs_hf_batched'], BATCH_GOAL)} "
            f"({ratio(r['s2_in_flight_vs_hf_batched'])} / {ratio(r['s3_in_flight_vs_hf_batched'])})",
            f"≥ {BATCH_GOAL:g}x at 1 stage",
            bool(met),
            BATCH,
        ),
        Row(
            "batch inference, all prompts in flight: 1 stage (2 / 3 stages)",
            "CTranslate2 `generate_batch`",
            f"{ratio(r['s1_in_flight_vs_ct2'])} ({ratio(r['s2_in_flight_vs_ct2'])}"
            f" / {ratio(r['s3_in_flight_vs_ct2'])})",
            "",
            None,
            BATCH,
        ),
    ]


def training_rows() -> list[Row]:
    rows = []
    for rel, shape in ((TRAIN, "the embedded default"), (TRAIN_GPT2, "GPT-2 small's shape")):
        data = load(rel)
        goal, met = data["targets_cpu"], data["targets_met"]
        value = data["ratios_distlm"]["mean_over_hf"]
        rows.append(
            Row(
                f"training, {shape}: mean tokens/s",
                "HF `Trainer`",
                ratio(value, goal["mean_over_hf"]),
                f"≥ {goal['mean_over_hf']:g}x",
                bool(met["mean_over_hf"]),
                rel,
            )
        )
        fraction = data["flops"]["achieved"]["distlm"]["fraction_of_matmul_peak"]
        target = goal.get("fraction_of_matmul_peak")
        rows.append(
            Row(
                f"training, {shape}: FLOP/s (6N + 12·L·H·Q·T a token)",
                "the machine's fp32 matmul peak, same run",
                f"{fraction:.1%}",
                "" if target is None else f"≥ {target:.0%}",
                None if target is None else bool(met["fraction_of_matmul_peak"]),
                rel,
            )
        )
    return rows


def e2e_rows() -> list[Row]:
    data = load(E2E)
    total = data["total"]
    return [
        Row(
            "every stage at GPT-2 small's shape on CPU (`config/gpt2-small-cpu.yaml`)",
            "",
            f"{total['wall_s']:.0f} s, peak RSS {total['peak_rss_mb'] / 1024:.1f} GiB",
            "per-stage table committed",
            None,
            E2E,
        )
    ]


def device_of(data: dict[str, Any]) -> str:
    """The device a file's figures came from: its GPU's name, or the CPU's cores."""
    device = data.get("device")
    if isinstance(device, str) and device not in ("", "cpu"):
        return device
    m = data.get("machine") or data.get("host") or {}
    cpus = m.get("cpus") or m.get("logical_cpus")
    return f"CPU, {cpus} cores" if cpus else "CPU"


def waits(what: str, against: str, goal: str) -> Row:
    """A GPU goal's row before benchmarks/gpu/run.sh's figures for it are committed."""
    return Row(what, against, "not measured", goal, None, GPU_RUN, "GPU (not run yet)")


def gpu_rows() -> list[Row]:
    """Issue #45's goals on a GPU, from benchmarks/gpu/run.sh's files once they are committed;
    until then one row each saying that they wait for a GPU run."""
    rows = []
    if (ROOT / TRAIN_GPU).is_file():
        mfu = load(TRAIN_GPU)["mfu"]
        value = mfu.get("distlm_over_reference")
        rows.append(
            Row(
                "training, GPT-2 small's shape: steady-state MFU",
                "the nanoGPT-style compiled loop, same run",
                "n/a" if value is None else f"{ratio(value, 1.1)} ({mfu['distlm']:.1%} MFU)",
                "≥ 1.1x",
                None if value is None else value >= 1.1,
                TRAIN_GPU,
            )
        )
    else:
        rows.append(
            waits(
                "training on a GPU, GPT-2 small's shape: steady-state MFU",
                "the nanoGPT-style compiled loop",
                "≥ 1.1x",
            )
        )
    if (ROOT / TRAIN_GPU_SMOLLM2).is_file():
        mfu = load(TRAIN_GPU_SMOLLM2)["mfu"].get("distlm")
        rows.append(
            Row(
                "training, SmolLM2-135M's shape: steady-state MFU",
                "the GPU's dense bf16 peak",
                "n/a" if mfu is None else f"{mfu:.1%}",
                f"≥ {SMOLLM2_MFU:.0%}",
                None if mfu is None else mfu >= SMOLLM2_MFU,
                TRAIN_GPU_SMOLLM2,
            )
        )
    else:
        rows.append(
            waits(
                "training on a GPU, SmolLM2-135M's shape: steady-state MFU",
                "the GPU's dense bf16 peak",
                f"≥ {SMOLLM2_MFU:.0%}",
            )
        )
    if (ROOT / BATCH_GPU).is_file():
        value = load(BATCH_GPU)["ratios"].get("s1_in_flight_vs_hf_batched")
        rows.append(
            Row(
                "batch inference on the GPU, all prompts in flight, 1 stage",
                "HF `generate`, batched, on the GPU",
                "n/a" if value is None else ratio(value, BATCH_GPU_GOAL),
                f"≥ {BATCH_GPU_GOAL:g}x",
                None if value is None else value >= BATCH_GPU_GOAL,
                BATCH_GPU,
            )
        )
    else:
        rows.append(
            waits(
                "batch inference on a GPU, all prompts in flight, 1 stage",
                "HF `generate`, batched, on the GPU",
                f"≥ {BATCH_GPU_GOAL:g}x",
            )
        )
    if (ROOT / SERVE_GPU).is_file():
        ratios = load(SERVE_GPU)["ratios"]
        # one stage, with one API server process (distlm-s1) and with N (distlm-s1-aN)
        for variant in sorted(k for k in ratios if re.fullmatch(r"distlm-s1(-a\d+)?_over_peer", k)):
            ours = by_clients(ratios[variant])
            api = re.search(r"-a(\d+)_", variant)
            procs = f", {api[1]} API server processes" if api else ""
            for clients in sorted(ours):
                for key, op, bound in (("throughput", "≥", 3.0), ("p99", "≤", 0.5)):
                    value = ours[clients][key]
                    rows.append(
                        Row(
                            f"serving on the GPU, 1 stage{procs}, {clients} clients: {key}",
                            "`transformers serve --continuous-batching --device cuda`",
                            ratio(value, bound),
                            f"{op} {bound:g}x",
                            COMPARE[op](value, bound),
                            SERVE_GPU,
                        )
                    )
    else:
        rows.append(
            waits(
                "serving on a GPU, 16 / 64 clients: throughput (p99)",
                "`transformers serve --continuous-batching --device cuda`",
                "≥ 3x (≤ 0.5x)",
            )
        )
    # issue #65: the switch's stall (the server's own figure: every token stopped, messages.Stall)
    update = load(SERVE_GPU).get("update", {}) if (ROOT / SERVE_GPU).is_file() else {}
    stall = update.get("switch_s_max")
    what = "live weight update on a GPU, GPT-2 small's shape, 64 clients: the switch's stall"
    if stall is not None:
        rows.append(
            Row(
                what,
                "-",
                f"{stall:.3f} s",
                f"≤ {SWAP_STALL_GPU_S:g} s",
                stall <= SWAP_STALL_GPU_S,
                SERVE_GPU,
            )
        )
    else:
        rows.append(waits(what, "-", f"≤ {SWAP_STALL_GPU_S:g} s"))
    # issue #78: the training loader's wait for rows, a share of a GPT-2 small step on the GPU
    flow = load(WORKFLOW_GPU).get("train", {}) if (ROOT / WORKFLOW_GPU).is_file() else {}
    share = flow.get("data_wait_share")
    what = "training on a GPU, GPT-2 small's shape: the step's wait for its rows"
    if share is not None:
        rows.append(Row(what, "the step", f"{share:.2%}", "≤ 1%", share <= DATA_WAIT, WORKFLOW_GPU))
    else:
        rows.append(waits(what, "the step", f"≤ {DATA_WAIT:.0%}"))
    return rows


def machine(data: dict[str, Any]) -> str:
    """One line for a file's machine, from whichever of the benchmarks' layouts it has."""
    m = data.get("machine") or data.get("host") or {}
    cpus = m.get("cpus") or m.get("logical_cpus")
    torch = m.get("torch") or data.get("torch")
    transformers = m.get("transformers") or data.get("transformers")
    parts = [f"{cpus} CPUs" if cpus else None, m.get("cpu"), f"torch {torch}" if torch else None]
    parts.append(f"transformers {transformers}" if transformers else None)
    return ", ".join(p for p in parts if p)


def code_of(rel: str, data: dict[str, Any]) -> str:
    """Which code gave a file's figures: the commit it records having measured (benchmarks/
    provenance.py), or, for a file written before it recorded one, the commit that committed it
    (the code measured is that commit's parent or older)."""
    revision = str(data.get("revision") or "")
    if revision:
        sha, _, rest = revision.partition(" ")
        return f"measured on {sha[:10]}" + (f" {rest}" if rest else "")
    sha = subprocess.run(
        ["git", "log", "-1", "--format=%h", "--abbrev=10", "--", rel],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return f"committed in {sha}, measured before it" if sha else "not committed yet"


def update_rows() -> list[Row]:
    """Live weight updates under load (bench_update.py): no failure, no answer from mixed
    weights, no greedy answer other than `generate`'s, and the p99 during an update."""
    d = load(UPDATE)
    clean = d["failed"] == 0 and d["mixed_or_unknown_weights"] == 0 and d["greedy_differs"] == 0
    pushes = d.get("pushes", 0)
    how = f"{d['args']['updates'] - pushes} from disk" + (
        f", {pushes} pushed by a 2-rank training job" if pushes else ""
    )
    return [
        Row(
            f"serving, live weight updates ({how}, policy {d['args']['policy']}), "
            f"{d['args']['clients']} clients: p99 during an update",
            "the same server's steady p99",
            f"{ratio(d['p99_ratio'], UPDATE_P99)}; {d['failed']} failed, "
            f"{d['mixed_or_unknown_weights']} mixed",
            f"≤ {UPDATE_P99:g}x, 0 failed",
            clean and d["p99_ratio"] <= UPDATE_P99,
            UPDATE,
        )
    ]


def data_rows() -> list[Row]:
    """Issue #78's goals: the data stage beside nanoGPT's prepare.py way."""
    d = load(DATA)
    nanogpt = "nanoGPT's `prepare.py` way (`datasets.map(num_proc=2)`, one `np.memmap`)"
    sizes = list(d["prep"])
    rows = []
    for mb in sizes:
        p = d["prep"][mb]
        runs = len(p["tokens_per_s_ratios"])
        rows.append(
            Row(
                f"dataset prep, {p['corpus_mb']:g} MB corpus ({p['tokens'] / 1e6:.1f}M tokens): "
                f"tokens a second, {p['distlm']['shards']} shard jobs on 2 cores, median of {runs}",
                nanogpt,
                ratio(p["tokens_per_s_ratio"], DATA_SPEED)
                + f" ({' / '.join(ratio(x) for x in p['tokens_per_s_ratios'])})",
                f"≥ {DATA_SPEED:g}x",
                p["tokens_per_s_ratio"] >= DATA_SPEED,
                DATA,
            )
        )
    peaks = [d["prep"][mb]["peak_rss_mb"]["distlm"] for mb in sizes]
    theirs = [d["prep"][mb]["peak_rss_mb"]["nanogpt"] for mb in sizes]
    rows.append(
        Row(
            f"dataset prep, {' / '.join(sizes)} MB: the largest process's peak RSS",
            "the same, nanoGPT's way: " + " / ".join(f"{m:.0f} MB" for m in theirs),
            " / ".join(f"{m:.0f} MB" for m in peaks) + f" ({d['peak_rss_growth']:.2f}x)",
            f"≤ {DATA_RSS_MB:g} MB, ≤ {DATA_RSS_GROWTH:g}x",
            max(peaks) <= DATA_RSS_MB and d["peak_rss_growth"] <= DATA_RSS_GROWTH,
            DATA,
        )
    )
    if "scaling" in d:
        sc = d["scaling"]["ratio"]
        rows.append(
            Row(
                "dataset prep: two shard jobs on two cores, tokens a second",
                "one job on one core",
                ratio(sc, DATA_SCALING),
                f"≥ {DATA_SCALING:g}x",
                sc >= DATA_SCALING,
                DATA,
            )
        )
    if "loader" in d:
        lo = d["loader"]
        rows.append(
            Row(
                f"training loader, random steps on {lo['store_tokens'] / 1e6:.0f}M tokens: "
                "tokens a second",
                "nanoGPT's `get_batch` (memmap, random offsets)",
                ratio(lo["ratio"], DATA_LOADER),
                f"≥ {DATA_LOADER:g}x",
                lo["ratio"] >= DATA_LOADER,
                DATA,
            )
        )
    if "fineweb" in d:
        fw = d["fineweb"]["shard"]
        rows.append(
            Row(
                f"dataset prep, one FineWeb-edu-shaped shard ({d['fineweb']['text_mb']:g} MB of "
                "parquet text): its job's peak RSS",
                "",
                f"{fw['peak_rss_mb']:.0f} MB",
                f"< {DATA_FINEWEB_MB:g} MB",
                fw["peak_rss_mb"] < DATA_FINEWEB_MB,
                DATA,
            )
        )
    return rows


def render() -> str:
    rows = (
        serving_rows()
        + update_rows()
        + batch_rows()
        + training_rows()
        + data_rows()
        + e2e_rows()
        + gpu_rows()
    )
    header = ["what", "distlm against", "device", "measured", "goal", "", "from"]
    lines = [
        BEGIN,
        "| " + " | ".join(header) + " |",
        "| " + " | ".join("---" for _ in header) + " |",
        *("| " + " | ".join(row.cells()) + " |" for row in rows),
        "",
        "Measured on:",
        "",
    ]
    for rel in dict.fromkeys(row.source for row in rows):
        if rel == GPU_RUN:
            lines.append(
                f"- `{rel}`: the rows that name it have no committed figures yet: a GPU machine "
                "has not run their steps (docs/performance.md#gpu)"
            )
            continue
        data = load(rel)
        date = str(data["date"]).replace("T", " ")[:16] + " UTC"
        command = str(data["command"]).split(" --note")[0]
        if rel == E2E:  # it records the user's command it ran in a scratch folder
            command = f"python benchmarks/e2e/run.py --configfile {data['config']}"
        elif command.split()[0].endswith(".py"):  # bench.py, bench_serve.py: their name only
            command = f"python {Path(rel).parent}/{command}"
        lines.append(f"- `{rel}`: {date}, {machine(data)}, {code_of(rel, data)}; `{command}`")
    lines.append(END)
    return "\n".join(lines)


def block(text: str, path: Path) -> tuple[int, int]:
    """The span of the rendered block in `text` (README.md), markers included."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(
            f"benchmarks/summary.py: {path} has no performance block: put the lines\n{BEGIN}\n"
            f"{END}\nwhere the table goes, then run `python benchmarks/summary.py`"
        )
    return start, end + len(END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if README.md is stale")
    parser.add_argument("--readme", type=Path, default=README, help="the file with the block")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    start, end = block(text, args.readme)
    fresh = text[:start] + render() + text[end:]
    if fresh == text:
        print(f"{args.readme}: the performance table is what the JSON says")
        return 0
    if args.check:
        print(
            f"{args.readme}: the performance table differs from the committed JSON; "
            "run `python benchmarks/summary.py` and commit the result",
            file=sys.stderr,
        )
        return 1
    write_text(args.readme, fresh)  # atomic and durable, like every write of distlm's
    print(f"{args.readme}: performance table rendered")
    return 0


if __name__ == "__main__":
    sys.exit(main())
