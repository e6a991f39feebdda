"""No training, evaluation, inference or serving process imports transformers' modeling code:
every rank runs distlm's own model of its family (distlm.family), and transformers stays the
format on disk, the tokenizers and the tests' reference. Checked in what the processes of the
user's commands loaded (tests/harness/process_hooks: each writes sys.modules when it exits):
the tiny workflow's run (train, evaluate, broadcast, infer) and a server answering a request
(its API server and its pipeline's stage 0)."""

from __future__ import annotations

import re

import pytest
import test_inference
from conftest import processes_of
from harness.processes import entry_point, process_env, process_records

tiny_models = test_inference.tiny_models  # the fixture: a tiny GPT-2's pipeline folders

# transformers' model code: modeling_utils and each model's modeling_<name> (its auto classes'
# name tables, models.auto.modeling_auto, and modeling_rope_utils come with a config or a
# tokenizer: no model code, and no torch beyond what distlm has loaded)
MODELING = re.compile(r"^transformers\.(modeling_utils$|models\.(?!auto\.)[^.]+\.modeling_)")
# what importing transformers' model code pulled into every rank, at 5-6 CPU-s a process
HEAVY = ("scipy", "transformers.loss.loss_utils", "transformers.modeling_utils")


def _check(records: list[dict], entries: dict[str, bool]) -> None:
    """`entries`: entry point -> whether its processes may import transformers at all (for a
    tokenizer); none may import its modeling code."""
    seen = {e: 0 for e in entries}
    for rec in records:
        e = entry_point(rec)
        if e not in entries:
            continue
        seen[e] += 1
        mods = rec["modules"]
        modeling = [m for m in mods if MODELING.match(m)]
        assert not modeling, f"{e} ({' '.join(rec['argv'][:3])}): {modeling[:5]}"
        assert not [m for m in HEAVY if m in mods], (e, [m for m in HEAVY if m in mods])
        if not entries[e]:
            assert "transformers" not in mods, f"{e} imports transformers"
    assert all(seen.values()), f"entry points whose processes were not seen: {seen}"


def test_the_workflows_ranks_import_no_modeling_code(workflow_run):
    records = process_records(processes_of(workflow_run))
    _check(records, {"train": False, "evaluate": False, "broadcast": False, "infer": True})
    ranks = [r for r in records if entry_point(r) == "train"]
    assert len(ranks) == 2 and all(r["first_step_cpu_s"] for r in ranks)


@pytest.mark.slow
def test_a_servers_processes_import_no_modeling_code(tiny_models, tmp_path):
    from openai import OpenAI
    from test_server import TOKEN, start_server, stop_server

    records = tmp_path / "processes"
    server = start_server(tiny_models[1], 1, tmp_path, env=process_env(records))
    try:
        client = OpenAI(base_url=server.base + "/v1", api_key=TOKEN, max_retries=0)
        out = client.completions.create(model="x", prompt="A class", max_tokens=4, temperature=0)
        assert out.choices[0].text is not None
    finally:
        stop_server(server)
    serve = [r for r in process_records(records) if entry_point(r) == "serve"]
    assert any("--engine" in r["argv"] for r in serve), [r["argv"][:4] for r in serve]
    assert any("--engine" not in r["argv"] for r in serve)  # the API server
    _check(process_records(records), {"serve": True})
