"""The ecosystem's tools on what distlm writes and serves: `transformers serve` and
`AutoModelForCausalLM` load the trained folder of the tiny workflow unchanged; lm-eval's
`local-completions` model scores the tasks in tests/lm_eval/ against a running distlm server
exactly as its `hf` model does on the same folder."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import test_server
import torch
from harness.peer import transformers_serve_command, transformers_serve_env

from distlm.runtime.dist import free_port

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "lm_eval"
tiny_models = test_server.tiny_models
hf_reference = test_server.hf_reference
server = test_server.server  # the shared 2-stage server (its token: test_server.TOKEN)


def post(base: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def start_transformers_serve(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            # a cache for the tests' few short requests (see transformers_serve_command)
            transformers_serve_command(folder, port=port, kv_blocks=32),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=transformers_serve_env(1),
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"transformers serve exited:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"transformers serve did not come up:\n{log.read_text()[-4000:]}")


def transformers_serve_once(folder: Path, body: dict, log: Path) -> dict:
    """One completion of `transformers serve` started on `folder` (stopped afterwards)."""
    proc, base = start_transformers_serve(folder, log)
    try:
        return post(base, {"model": str(folder), **body})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def test_trained_folder_loads_in_transformers_serve_and_automodel(workflow_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = workflow_run / "results" / "train" / "final"
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    tok = AutoTokenizer.from_pretrained(final)
    prompt = "The class"
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
    want = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)

    proc, base = start_transformers_serve(final, tmp_path / "transformers-serve.log")
    try:
        doc = post(base, {"model": str(final), "prompt": prompt, "max_tokens": 6, "temperature": 0})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    assert doc["choices"][0]["text"] == want
    assert doc["usage"]["completion_tokens"] == len(out[0]) - ids.shape[1]
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before  # loaded as it is


def _evaluate(
    model: str,
    model_args: str,
    tasks: tuple[str, ...] = ("distlm_mc", "distlm_rolling", "distlm_gen"),
    *,
    chat: bool = False,
) -> dict:
    """lm-eval's `simple_evaluate` on the tasks of tests/lm_eval/, seeded; `chat`: the prompts go
    through the tokenizer's chat template (lm-eval's --apply_chat_template)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=1,
        apply_chat_template=chat,
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def chat_over_api(model: str, base: str) -> dict:
    """lm-eval's `local-chat-completions` against the server at `base` (its --model `model`):
    the greedy task through the chat template."""
    return _evaluate(
        "local-chat-completions",
        f"model={model},base_url={base}/v1/chat/completions,num_concurrent=1,max_retries=1,"
        "max_length=64",
        ("distlm_gen",),
        chat=True,
    )


def chat_with_hf(weights: Path, tokenizer: Path) -> dict:
    """The same task through lm-eval's `hf` model of `weights`, with `tokenizer`'s template."""
    return _evaluate(
        "hf",
        f"pretrained={weights},tokenizer={tokenizer},device=cpu,dtype=float32,max_length=64",
        ("distlm_gen",),
        chat=True,
    )


def assert_same_evaluation(api: dict, hf: dict) -> None:
    """Every score of lm-eval against the server equals its `hf` model's (1e-3; perplexities of a
    random model are ~1e8: those to 1e-3 relative), and every per-document answer: generations
    exactly, log-likelihoods to 1e-3."""
    for task, metrics in hf["results"].items():
        for name, value in metrics.items():
            if isinstance(value, float) and "stderr" not in name:
                want = pytest.approx(value, abs=1e-3, rel=1e-3 if "perplexity" in name else 0)
                assert api["results"][task][name] == want, (task, name)
    for task in hf["samples"]:
        got, want = api["samples"][task], hf["samples"][task]
        assert len(got) == len(want) == 6
        for g, w in zip(got, want):
            for a, b in zip(g["filtered_resps"], w["filtered_resps"]):
                if task == "distlm_gen":
                    assert a == b, task
                else:
                    ll_a = a[0] if isinstance(a, (list, tuple)) else a
                    ll_b = b[0] if isinstance(b, (list, tuple)) else b
                    assert ll_a == pytest.approx(ll_b, abs=1e-3), task


def assert_same_chat_answers(api: dict, hf: dict) -> None:
    """lm-eval's chat-templated greedy answers (distlm_gen) against the server equal its `hf`
    model's, document by document, and went through the template (TEMPLATE's 'assistant:')."""
    got = [d["filtered_resps"] for d in api["samples"]["distlm_gen"]]
    want = [d["filtered_resps"] for d in hf["samples"]["distlm_gen"]]
    assert len(got) == 6 and got == want
    assert all("assistant:" in str(d["arguments"]) for d in hf["samples"]["distlm_gen"])
    assert api["results"]["distlm_gen"] == hf["results"]["distlm_gen"]


@pytest.mark.slow
def test_lm_eval_over_the_server_equals_its_hf_model(server, monkeypatch, hub_offline):
    """Multiple choice (log-likelihoods of token-id prompts, echo, logprobs), rolling perplexity
    and greedy generation with stop strings: every score and every per-document answer of
    `local-completions` against distlm equals lm-eval's `hf` model on the model folder, to 1e-3."""
    pytest.importorskip("lm_eval")
    folder = test_server.tiny_models_folder(server)
    monkeypatch.chdir(ROOT)  # the task YAMLs name their data relative to the repository root
    monkeypatch.setenv("OPENAI_API_KEY", test_server.TOKEN)  # sent as the bearer token
    api = _evaluate(
        "local-completions",
        f"model=s2,base_url={server.base}/v1/completions,tokenizer={folder},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,max_length=64",
    )
    hf = _evaluate("hf", f"pretrained={folder},device=cpu,dtype=float32,max_length=64")
    assert_same_evaluation(api, hf)
    assert api["results"]["distlm_rolling"]["word_perplexity,none"] > 1
